// CUDA repack of fp8 [N, K] into the packed Marlin-style layout, the scale
// permutation/folding, and the dequantize that reads the packed layout (used
// for the dequantize-once path at large M). Index math: marlin_fp8.h.
// Not on the hot path (weight load time); one thread per output word/element.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kv_b_proj/marlin_fp8.h"

namespace mla_ext {
namespace marlin_fp8 {
namespace {

constexpr int kThreads = 256;

__global__ void repack_words_kernel(const uint8_t* __restrict__ w, int64_t ldw, int64_t N, int64_t K,
                                    uint32_t* __restrict__ qweight, int64_t total_words) {
  const int64_t k_tiles = K / kTileK;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int in_tile = static_cast<int>(i % kWordsPerTile);
    const int64_t tile = i / kWordsPerTile;
    const int64_t nt = tile / k_tiles, kt = tile % k_tiles;
    qweight[i] = pack_word(w, ldw, N, nt, kt, in_tile / kWordsPerLane, in_tile % kWordsPerLane);
  }
}

__global__ void permute_scales_kernel(const float* __restrict__ s, int64_t N, int64_t n_pad, int64_t total,
                                      float fold, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = i / n_pad, pos = i % n_pad;
    const int64_t n = pos / kTileN * kTileN + scale_col(static_cast<int>(pos % kTileN));
    out[i] = n < N ? s[g * N + n] * fold : 0.0f;
  }
}

template <ActKind kAct>
__global__ void dequant_kernel(DequantParams p, int64_t total_words) {
  const int64_t k_tiles = p.K / kTileK, n_pad = padded_n(p.N);
  const int64_t gk = p.group_size > 0 ? p.group_size : p.K;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int in_tile = static_cast<int>(i % kWordsPerTile);
    const int64_t tile = i / kWordsPerTile;
    const int64_t nt = tile / k_tiles, kt = tile % k_tiles;
    const int lane = in_tile / kWordsPerLane, j = in_tile % kWordsPerLane;
    const int c = word_col(lane, j);
    const int64_t n = nt * kTileN + c;
    if (n >= p.N) continue;
    const int64_t k0 = kt * kTileK + word_k0(lane);
    const float s = p.scales[(k0 / gk) * n_pad + nt * kTileN + scale_pos(c)];  // k0..k0+9 share a group
    uint32_t regs[2];
    dequant_word<kAct>(p.qweight[i], regs);
    for (int b = 0; b < 4; ++b) {
      const uint16_t h = static_cast<uint16_t>(regs[b >> 1] >> ((b & 1) * 16));
      float v;
      if constexpr (kAct == ActKind::kFp16) {
        v = __half2float(__ushort_as_half(h));
      } else {
        v = __uint_as_float(static_cast<uint32_t>(h) << 16);
      }
      p.out[n * p.K + k0 + byte_dk(b)] = v * s;
    }
  }
}

int grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

int marlin_fp8_repack_cuda(const RepackParams& p, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t n_pad = padded_n(p.N);
  const int64_t words = n_pad / kTileN * (p.K / kTileK) * kWordsPerTile;
  repack_words_kernel<<<grid_for(words), kThreads, 0, st>>>(p.w, p.ldw, p.N, p.K, p.qweight, words);
  const float fold = ldexpf(1.0f, fold_log2(p.act));
  const int64_t total = p.G * n_pad;
  permute_scales_kernel<<<grid_for(total), kThreads, 0, st>>>(p.scales, p.N, n_pad, total, fold, p.scales_out);
  return static_cast<int>(cudaGetLastError());
}

int marlin_fp8_dequantize_cuda(const DequantParams& p, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t words = padded_n(p.N) / kTileN * (p.K / kTileK) * kWordsPerTile;
  if (p.act == ActKind::kFp16) {
    dequant_kernel<ActKind::kFp16><<<grid_for(words), kThreads, 0, st>>>(p, words);
  } else {
    dequant_kernel<ActKind::kBf16><<<grid_for(words), kThreads, 0, st>>>(p, words);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace marlin_fp8
}  // namespace mla_ext
