// CUDA repack of fp8 [N, K] into the packed Marlin layout (vLLM's), the scale
// permutation (the binding folds and rounds the scales first), and the
// dequantize that reads the packed layout (used for the dequantize-once path
// at large M). Index math: marlin_fp8.h.
// Not on the hot path (weight load time); one thread per output word/element.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kv_b_proj/marlin_fp8.h"

namespace mla_ext {
namespace marlin_fp8 {
namespace {

constexpr int kThreads = 256;

// register budget: 48
__global__ void repack_words_kernel(const uint8_t* __restrict__ w, int64_t ldw, int64_t N, int64_t n_tiles,
                                    uint32_t* __restrict__ qweight, int64_t total_words) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int in_tile = static_cast<int>(i % kWordsPerTile);
    const int64_t tile = i / kWordsPerTile;  // = kt * n_tiles + nt
    const int64_t kt = tile / n_tiles, nt = tile % n_tiles;
    qweight[i] = pack_word(w, ldw, N, kt, nt, in_tile / kWordsPerLane, in_tile % kWordsPerLane);
  }
}

// register budget: 48
__global__ void permute_scales_kernel(const uint16_t* __restrict__ s, int64_t N, int64_t n_pad, int64_t total,
                                      bool grouped, uint16_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = i / n_pad, pos = i % n_pad;
    const int64_t n = pos / kTileN * kTileN + scale_col(static_cast<int>(pos % kTileN), grouped);
    out[i] = n < N ? s[g * N + n] : uint16_t{0};
  }
}

template <ActKind kAct>
__device__ __forceinline__ float act_to_float(uint16_t h) {
  if constexpr (kAct == ActKind::kFp16) {
    return __half2float(__ushort_as_half(h));
  } else {
    return __uint_as_float(static_cast<uint32_t>(h) << 16);
  }
}

template <ActKind kAct>
// register budget: 48
__global__ void dequant_kernel(DequantParams p, int64_t total_words) {
  const int64_t n_pad = padded_n(p.N), n_tiles = n_pad / kTileN;
  const int64_t gk = p.group_size > 0 ? p.group_size : p.K;
  const bool grouped = grouped_scales(p.K, p.group_size);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int in_tile = static_cast<int>(i % kWordsPerTile);
    const int64_t tile = i / kWordsPerTile;
    const int64_t kt = tile / n_tiles, nt = tile % n_tiles;
    const int lane = in_tile / kWordsPerLane, j = in_tile % kWordsPerLane;
    const int c = word_col(lane, j);
    const int64_t n = nt * kTileN + c;
    if (n >= p.N) continue;
    const int64_t k0 = kt * kTileK + word_k0(lane);
    // k0..k0+9 share a group (groups are multiples of 16 k).
    const float s = act_to_float<kAct>(p.scales[(k0 / gk) * n_pad + nt * kTileN + scale_pos(c, grouped)]);
    uint32_t regs[2];
    dequant_word<kAct>(p.qweight[i], regs);
    for (int b = 0; b < 4; ++b) {
      p.out[n * p.K + k0 + byte_dk(b)] = act_to_float<kAct>(dequant_half(regs, b)) * s;
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
  const int64_t n_pad = padded_n(p.N), n_tiles = n_pad / kTileN;
  const int64_t words = n_tiles * (p.K / kTileK) * kWordsPerTile;
  repack_words_kernel<<<grid_for(words), kThreads, 0, st>>>(p.w, p.ldw, p.N, n_tiles, p.qweight, words);
  const int64_t total = p.G * n_pad;
  permute_scales_kernel<<<grid_for(total), kThreads, 0, st>>>(p.scales, p.N, n_pad, total, p.grouped,
                                                              p.scales_out);
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
