// CUDA kernel for merge_attn_states (see merge_states.h for the contract).
//
// Memory-bound: each (token, head) row is handled by a group of threads of
// one block that moves it in 16-byte packs (8 x 16-bit or 4 x fp32) when the
// pointers and strides allow, single elements otherwise. Every thread reads
// its row's two LSEs, the block synchronises, and only then does one thread
// per row write the merged LSE, so `out_lse` may alias an input LSE.
#include "attention/merge_states.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mla_ext {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// A pack of kVec elements moved as one access of kVec*sizeof(T) bytes.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// blockDim = (threads_per_row, rows_per_block); each row is one (token, head).
template <typename T, int kVec>
__global__ void merge_kernel(MergeParams p, int64_t packs_per_row) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.num_tokens * p.num_heads;
  const int64_t t = active ? row / p.num_heads : 0;
  const int64_t h = active ? row % p.num_heads : 0;

  float a = -INFINITY, b = -INFINITY;
  if (active) {
    a = p.prefix_lse[h * p.prefix_lse_sh + t * p.prefix_lse_st];
    b = p.suffix_lse[h * p.suffix_lse_sh + t * p.suffix_lse_st];
  }
  // Everyone has read the LSEs before anyone may overwrite them (aliasing).
  __syncthreads();
  if (!active) return;

  if (a == INFINITY) a = -INFINITY;
  if (b == INFINITY) b = -INFINITY;
  const float m = fmaxf(a, b);
  const bool empty = (m == -INFINITY);
  float s1 = 0.f, s2 = 0.f, lse = -INFINITY;
  if (!empty) {
    const float w1 = __expf(a - m), w2 = __expf(b - m);
    const float inv = 1.f / (w1 + w2);
    s1 = w1 * inv;
    s2 = w2 * inv;
    lse = m + __logf(w1 + w2);
  }

  const T* x1 = static_cast<const T*>(p.prefix_o) + t * p.prefix_st + h * p.prefix_sh;
  const T* x2 = static_cast<const T*>(p.suffix_o) + t * p.suffix_st + h * p.suffix_sh;
  T* y = static_cast<T*>(p.out) + t * p.out_st + h * p.out_sh;
  using P = Pack<T, kVec>;
  for (int64_t i = threadIdx.x; i < packs_per_row; i += blockDim.x) {
    P r1, r2, o;
    // An empty side is never read: its o may hold anything (0 * inf = NaN).
    if (s1 != 0.f) r1 = reinterpret_cast<const P*>(x1)[i];
    if (s2 != 0.f) r2 = reinterpret_cast<const P*>(x2)[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float v = 0.f;
      if (s1 != 0.f) v += s1 * to_f32(r1.v[k]);
      if (s2 != 0.f) v += s2 * to_f32(r2.v[k]);
      o.v[k] = from_f32<T>(v);
    }
    reinterpret_cast<P*>(y)[i] = o;
  }
  if (threadIdx.x == 0 && p.out_lse != nullptr) p.out_lse[h * p.out_lse_sh + t * p.out_lse_st] = lse;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <typename T>
void launch(const MergeParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_tokens * p.num_heads;
  if (rows == 0) return;  // a zero-width head still gets its LSEs written below
  constexpr int kVec = 16 / sizeof(T);
  const int64_t es = sizeof(T);
  const bool vec = (p.head_size % kVec == 0) && aligned16(p.out) && aligned16(p.prefix_o) &&
                   aligned16(p.suffix_o) && (p.out_st * es) % 16 == 0 && (p.out_sh * es) % 16 == 0 &&
                   (p.prefix_st * es) % 16 == 0 && (p.prefix_sh * es) % 16 == 0 &&
                   (p.suffix_st * es) % 16 == 0 && (p.suffix_sh * es) % 16 == 0;
  const int64_t packs = vec ? p.head_size / kVec : p.head_size;
  int tpr = 1;  // threads per row: the next power of two >= packs, at most a warp
  while (tpr < packs && tpr < 32) tpr <<= 1;
  const dim3 block(tpr, kThreads / tpr);
  const int64_t grid = (rows + block.y - 1) / block.y;
  if (vec) {
    merge_kernel<T, kVec><<<static_cast<unsigned>(grid), block, 0, stream>>>(p, packs);
  } else {
    merge_kernel<T, 1><<<static_cast<unsigned>(grid), block, 0, stream>>>(p, packs);
  }
}

}  // namespace

int merge_attn_states_cuda(const MergeParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case MergeDType::kFloat32:
      launch<float>(p, s);
      break;
    case MergeDType::kFloat16:
      launch<__half>(p, s);
      break;
    case MergeDType::kBFloat16:
      launch<__nv_bfloat16>(p, s);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mla_ext
