// CUDA concat_and_cache_mla (write new tokens) and compute_kv_scale:
// write_vec_kernel / amax_rows_kernel, the lane logic of
// csrc/cache/write_lanes.h (16-byte loads, 8/16-byte stores, multiplications
// by the reciprocal of power-of-two scales, an amax without per-element
// division; shared with the host emulator the tests run).
//
// kv scale: a warp-strided amax with one atomicMax per warp on the fp32 bits
// (non-negative floats order like their bit patterns), then a one-thread
// finalize; three stream-ordered launches, no host sync, no workspace.
#include <cuda_runtime.h>

#include <algorithm>

#include "cache/cache_kernels.h"
#include "cache/write_lanes.h"

namespace mla_ext {
namespace cache {
namespace {

constexpr int kTokensPerCta = 8;
constexpr int kThreads = 32 * kTokensPerCta;

// The writer: one warp per token, the lane
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

// compute_kv_scale's amax: warps stride over work items
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
  write_vec_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int kv_scale_cuda(const KvScaleParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The output doubles as the amax accumulator (0.0f has all bits zero).
  cudaError_t err = cudaMemsetAsync(p.out, 0, sizeof(float), s);
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t n = static_cast<int64_t>(p.num_tokens) * (p.L + p.R);
  if (n > 0) {
    const int64_t blocks = std::min<int64_t>((wl::amax_items(p) + kTokensPerCta - 1) / kTokensPerCta, 2048);
    amax_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(p, reinterpret_cast<unsigned int*>(p.out));
  }
  finalize_scale_kernel<<<1, 1, 0, s>>>(p.out, p.fp8_max);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cache
}  // namespace mla_ext
