// CUDA concat_and_cache_mla (write new tokens) and compute_kv_scale.
//
// Two kernels of each, selected by the ops' `kernel` argument
// (WriteKernel): kVector (default) = write_vec_kernel / amax_rows_kernel, the
// lane logic of csrc/cache/write_lanes.h (16-byte loads, 8/16-byte stores,
// multiplications by the reciprocal of power-of-two scales, an amax without
// per-element division; shared with the host emulator the tests run);
// kScalar = the element-by-element write_kernel / amax_kernel below, kept
// selectable until a GPU has measured both.
//
// Scalar write: one warp per token, 8 tokens per CTA. fp8_ds_mla: lane l owns the
// 16 latent values [16 l, 16 l + 16), so each 128-value tile is 8 lanes and its
// amax is an 8-lane shuffle reduction; the tile scale and the saturating
// e4m3 encode use the same fp8.h functions as the CPU kernel (bit-identical).
// nvfp4_ds_mla: lane l owns latent block l (16 values, 8 code bytes, one
// scale byte at its permuted position), through the same nvfp4_ds_mla.h
// functions as the CPU kernel; lanes 0..31 encode rope values l and l + 32.
// kv scale: a grid-stride amax with one atomicMax per warp on the fp32 bits
// (non-negative floats order like their bit patterns), then a one-thread
// finalize; three stream-ordered launches, no host sync, no workspace.
#include <cuda_runtime.h>

#include <algorithm>

#include "cache/cache_kernels.h"
#include "cache/nvfp4_ds_mla.h"
#include "cache/write_lanes.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {
namespace {

constexpr int kTokensPerCta = 8;
constexpr int kThreads = 32 * kTokensPerCta;

// In-row indices and byte counts are int64: rows may be 2^31 elements or more.
__device__ inline float load_f32(const uint8_t* row, ElemType t, int64_t i) {
  if (t == ElemType::kBF16) return fp8::bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
  if (t == ElemType::kF16) return fp8::f16_bits_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
  return reinterpret_cast<const float*>(row)[i];
}

__device__ void copy_bytes(uint8_t* d, const uint8_t* s, int64_t n, int lane) {
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(d) % 4 == 0 && reinterpret_cast<uintptr_t>(s) % 4 == 0) {
    for (int64_t i = lane; i < n / 4; i += 32)
      reinterpret_cast<uint32_t*>(d)[i] = reinterpret_cast<const uint32_t*>(s)[i];
  } else {
    for (int64_t i = lane; i < n; i += 32) d[i] = s[i];
  }
}

__device__ void write_ds_mla(const WriteParams& p, int64_t t, uint8_t* dst, int lane) {
  constexpr int kPerLane = ds_mla::kLatentDim / 32;  // 16
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  float x[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    x[j] = load_f32(kv, p.in_type, lane * kPerLane + j);
    amax = fmaxf(amax, fabsf(x[j]));
  }
  // Lanes 8k..8k+7 hold tile k.
#pragma unroll
  for (int off = 4; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  const float s = fp8::ds_mla_tile_scale(amax, ds_mla::kE4M3Max, ds_mla::kMinScale);
  uint8_t* q = dst + ds_mla::kLatentOffset + lane * kPerLane;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) q[j] = fp8::encode_e4m3_sat(x[j] / s);
  if (lane % 8 == 0) memcpy(dst + ds_mla::kScaleOffset + 4 * (lane / 8), &s, 4);
  uint8_t* rope = dst + ds_mla::kRopeOffset;
  const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
  for (int i = lane; i < ds_mla::kRopeDim; i += 32) {
    const uint16_t h = i >= p.R ? 0
                       : p.in_type == ElemType::kBF16 ? reinterpret_cast<const uint16_t*>(pe)[i]
                                                     : fp8::f32_to_bf16_bits(load_f32(pe, p.in_type, i));
    rope[2 * i] = static_cast<uint8_t>(h & 0xFF);
    rope[2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
}

__device__ __forceinline__ void write_nvfp4_ds_mla(const WriteParams& p, int64_t t, uint8_t* dst, int lane) {
  namespace nv = nvfp4_ds_mla;
  static_assert(nv::kNumBlocks == 32, "one latent block per lane");
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  float x[nv::kBlockSize];
#pragma unroll
  for (int j = 0; j < nv::kBlockSize; ++j) x[j] = load_f32(kv, p.in_type, lane * nv::kBlockSize + j);
  uint32_t w[2];
  const uint8_t sb = nv::encode_block(x, w);
  uint8_t* q = dst + nv::kLatentOffset + lane * (nv::kBlockSize / 2);
  if (reinterpret_cast<uintptr_t>(q) % 8 == 0) {
    *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int j = 0; j < nv::kBlockSize / 2; ++j) q[j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
  }
  dst[nv::kScaleOffset + nv::scale_byte(lane)] = sb;
  const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
  for (int i = lane; i < nv::kRopeDim; i += 32) dst[nv::kRopeOffset + i] = fp8::encode_e4m3_sat(load_f32(pe, p.in_type, i));
}

// At least 4 CTAs (1024 threads) per SM: with the thread count alone, ptxas
// (CUDA 13) capped the kernel at 40 registers and spilled in the nvfp4_ds_mla
// path; 4 CTAs allow 64 and it uses 53, no spills (sm_86 and sm_90a).
// register budget: 64
__global__ void __launch_bounds__(kThreads, 4) write_kernel(const WriteParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerCta + threadIdx.x / 32;
  if (t >= p.num_tokens) return;
  uint8_t* dst = write_dest_row(p, t);
  if (!dst) return;
  switch (quant_mode(p.format)) {
    case QuantMode::kNone: {
      const int eb = elem_bytes(p.in_type);
      copy_bytes(dst, p.kv_c + t * p.kv_c_row_stride, p.L * eb, lane);
      copy_bytes(dst + p.L * eb, p.k_pe + t * p.k_pe_row_stride, p.R * eb, lane);
      break;
    }
    case QuantMode::kFp8PerTensor: {
      const float scale = checked_k_scale(*p.k_scale);  // NaN bytes for an invalid scale
      const bool e4m3 = p.format == CacheFormat::kFp8E4M3;
      const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
      const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
      for (int64_t i = lane; i < p.L + p.R; i += 32) {
        const float x = i < p.L ? load_f32(kv, p.in_type, i) : load_f32(pe, p.in_type, i - p.L);
        dst[i] = e4m3 ? fp8::encode_e4m3_sat(x / scale) : fp8::encode_e5m2_sat(x / scale);
      }
      break;
    }
    case QuantMode::kFp8PerTile: write_ds_mla(p, t, dst, lane); break;
    case QuantMode::kNvfp4PerBlock: write_nvfp4_ds_mla(p, t, dst, lane); break;
  }
}

// register budget: 64
__global__ void amax_kernel(const KvScaleParams p, unsigned int* amax_bits) {
  const int64_t width = p.L + p.R;
  const int64_t n = static_cast<int64_t>(p.num_tokens) * width;
  float amax = 0.0f;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = k / width;
    const int64_t i = k % width;
    const float a = fabsf(i < p.L ? load_f32(p.kv_c + t * p.kv_c_row_stride, p.in_type, i)
                                  : load_f32(p.k_pe + t * p.k_pe_row_stride, p.in_type, i - p.L));
    if (isfinite(a)) amax = fmaxf(amax, a);  // non-finite values are ignored
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  if (threadIdx.x % 32 == 0 && amax > 0.0f) atomicMax(amax_bits, __float_as_uint(amax));
}

// Vectorised writer (WriteKernel::kVector): one warp per token, the lane
// pieces of write_lanes.h. fp8_ds_mla's tile amax is an 8-lane shuffle
// reduction between ds_load and ds_store (the emulator runs the same max).
// ptxas (CUDA 13.0): 44 registers on sm_86, 48 on sm_90a, no spills (the
// bound, 4 CTAs of 256 threads per SM, allows 64).
// register budget: 64
__global__ void __launch_bounds__(kThreads, 4) write_vec_kernel(const WriteParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerCta + threadIdx.x / 32;
  if (t >= p.num_tokens) return;  // uniform per warp
  uint8_t* dst = write_dest_row(p, t);
  if (!dst) return;  // uniform per warp
  switch (quant_mode(p.format)) {
    case QuantMode::kNone: wl::copy_lane(p, t, dst, lane); break;
    case QuantMode::kFp8PerTensor:
      wl::per_tensor_lane(p, t, dst, lane, checked_k_scale(*p.k_scale));  // NaN bytes for an invalid scale
      break;
    case QuantMode::kFp8PerTile: {
      float x[wl::kDsPerLane];
      float amax = wl::ds_load(p, t, lane, x);
#pragma unroll
      for (int off = 4; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
      wl::ds_store(p, t, dst, lane, x, amax);
      break;
    }
    case QuantMode::kNvfp4PerBlock: wl::nvfp4_lane(p, t, dst, lane); break;
  }
}

// compute_kv_scale's amax, WriteKernel::kVector: warps stride over work items
// (a token's kv_c or k_pe columns, 4096 at a time), lanes over the item's
// columns (16-byte loads where aligned); no division per value.
// ptxas (CUDA 13.0): 33 registers on sm_86, 32 on sm_90a, no spills.
// register budget: 64
__global__ void __launch_bounds__(kThreads) amax_rows_kernel(const KvScaleParams p, unsigned int* amax_bits) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t items = wl::amax_items(p);
  float amax = 0.0f;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; it < items; it += warps)
    amax = fmaxf(amax, wl::amax_lane(p, it, lane));
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  if (lane == 0 && amax > 0.0f) atomicMax(amax_bits, __float_as_uint(amax));
}

// register budget: 64
__global__ void finalize_scale_kernel(float* out, float fp8_max) {
  out[0] = fmaxf(out[0] / fp8_max, kMinKvScale);
}

}  // namespace

int write_cuda(const WriteParams& p, void* stream) {
  if (p.num_tokens <= 0) return 0;
  const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(p.num_tokens) + kTokensPerCta - 1) / kTokensPerCta));
  if (p.kernel == WriteKernel::kScalar) {
    write_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  } else {
    write_vec_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

int kv_scale_cuda(const KvScaleParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The output doubles as the amax accumulator (0.0f has all bits zero).
  cudaError_t err = cudaMemsetAsync(p.out, 0, sizeof(float), s);
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t n = static_cast<int64_t>(p.num_tokens) * (p.L + p.R);
  if (n > 0 && p.kernel == WriteKernel::kScalar) {
    const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
    amax_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(p, reinterpret_cast<unsigned int*>(p.out));
  } else if (n > 0) {
    const int64_t blocks = std::min<int64_t>((wl::amax_items(p) + kTokensPerCta - 1) / kTokensPerCta, 2048);
    amax_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(p, reinterpret_cast<unsigned int*>(p.out));
  }
  finalize_scale_kernel<<<1, 1, 0, s>>>(p.out, p.fp8_max);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cache
}  // namespace mla_ext
