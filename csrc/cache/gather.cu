// The row-wise CUDA gathers of the paged latent cache (SPEC §6), backend
// "cuda_rowwise" (GatherKernel::kRowwise): gather_and_maybe_dequant_cache and
// cp_gather_cache share one kernel template. The default kernel is the
// page-granular one (gather_paged.cu); this one stays selectable until a GPU
// has measured both.
//
// Memory-bound, so: one warp per dst row, 8 rows per CTA, grid sized from
// dst.size(0) (no host sync: each warp finds its request by binary search
// over cu_seq_lens and rows past cu_seq_lens[num_reqs] return at once).
// Rows move in 8-element chunks (8-byte fp8 loads, 16/32-byte stores) when
// the row pointers allow, else element by element. fp8 decode goes through a
// 256-entry shared table built per CTA: decode(b) * k_scale already rounded
// to the output type for per-tensor formats (exactly the CPU kernel's table),
// decode(b) in fp32 for fp8_ds_mla (times the row's tile scale) and
// nvfp4_ds_mla (its block scales and rope). nvfp4_ds_mla: lane l decodes latent
// block l (one 8-byte load, its scale byte at the permuted position, two
// 8-value stores); lanes 0..7 decode 8 rope bytes each.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cache/cache_kernels.h"
#include "cache/nvfp4_ds_mla.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {
namespace {

constexpr int kRowsPerCta = 8;
constexpr int kThreads = 32 * kRowsPerCta;

struct OutBF16 {
  using T = __nv_bfloat16;
  static __device__ T from(float x) { return __float2bfloat16_rn(x); }
};
struct OutF16 {
  using T = __half;
  static __device__ T from(float x) { return __float2half_rn(x); }
};
struct OutF32 {
  using T = float;
  static __device__ T from(float x) { return x; }
};

template <class T>
struct alignas(8 * sizeof(T)) Pack8 {
  T v[8];
};

__device__ inline bool aligned(const void* p, int n) {
  return (reinterpret_cast<uintptr_t>(p) % n) == 0;
}

// Row sizes and in-row indices are int64: a row may be 2^31 bytes or more.
__device__ void raw_row(const uint8_t* src, uint8_t* d, int64_t bytes, int lane) {
  if (!src) {
    if (bytes % 16 == 0 && aligned(d, 16)) {
      for (int64_t c = lane; c < bytes / 16; c += 32) reinterpret_cast<uint4*>(d)[c] = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t i = lane; i < bytes; i += 32) d[i] = 0;
    }
  } else if (bytes % 16 == 0 && aligned(d, 16) && aligned(src, 16)) {
    for (int64_t c = lane; c < bytes / 16; c += 32)
      reinterpret_cast<uint4*>(d)[c] = __ldg(reinterpret_cast<const uint4*>(src) + c);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) d[i] = src[i];
  }
}

template <class T>
__device__ void per_tensor_row(const uint8_t* src, T* d, int64_t w, const T* lut, int lane) {
  if (w % 8 == 0 && aligned(src, 8) && aligned(d, 8 * sizeof(T))) {
    for (int64_t c = lane; c < w / 8; c += 32) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(src) + c);
      Pack8<T> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o.v[j] = lut[(q.x >> (8 * j)) & 0xFF];
        o.v[4 + j] = lut[(q.y >> (8 * j)) & 0xFF];
      }
      reinterpret_cast<Pack8<T>*>(d)[c] = o;
    }
  } else {
    for (int64_t i = lane; i < w; i += 32) d[i] = lut[src[i]];
  }
}

template <class Out>
__device__ void ds_mla_row(const uint8_t* src, typename Out::T* d, int64_t w, const float* lut, int lane) {
  using T = typename Out::T;
  constexpr int kChunksPerTile = ds_mla::kTileSize / 8;
  if (aligned(src, 16) && aligned(d, 8 * sizeof(T))) {
    const float* scales = reinterpret_cast<const float*>(src + ds_mla::kScaleOffset);
    for (int c = lane; c < ds_mla::kLatentDim / 8; c += 32) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(src + ds_mla::kLatentOffset) + c);
      const float s = __ldg(scales + c / kChunksPerTile);
      Pack8<T> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o.v[j] = Out::from(lut[(q.x >> (8 * j)) & 0xFF] * s);
        o.v[4 + j] = Out::from(lut[(q.y >> (8 * j)) & 0xFF] * s);
      }
      reinterpret_cast<Pack8<T>*>(d)[c] = o;
    }
    const int rope_chunks = static_cast<int>(w - ds_mla::kLatentDim) / 8;  // 8 or 0 (w is 576 or 512)
    if (lane < rope_chunks) {
      const uint4 r = __ldg(reinterpret_cast<const uint4*>(src + ds_mla::kRopeOffset) + lane);
      const uint32_t words[4] = {r.x, r.y, r.z, r.w};
      Pack8<T> o;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint16_t h = static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2)));
        o.v[j] = Out::from(fp8::bf16_bits_to_f32(h));
      }
      reinterpret_cast<Pack8<T>*>(d + ds_mla::kLatentDim)[lane] = o;
    }
  } else {
    for (int i = lane; i < static_cast<int>(w); i += 32) {
      if (i < ds_mla::kLatentDim) {
        float s;
        memcpy(&s, src + ds_mla::kScaleOffset + 4 * (i / ds_mla::kTileSize), 4);
        d[i] = Out::from(lut[src[ds_mla::kLatentOffset + i]] * s);
      } else {
        const uint8_t* pe = src + ds_mla::kRopeOffset + 2 * (i - ds_mla::kLatentDim);
        d[i] = Out::from(fp8::bf16_bits_to_f32(static_cast<uint16_t>(pe[0] | (pe[1] << 8))));
      }
    }
  }
}

template <class Out>
__device__ void nvfp4_ds_mla_row(const uint8_t* src, typename Out::T* d, const float* lut, int lane) {
  namespace nv = nvfp4_ds_mla;
  using T = typename Out::T;
  static_assert(nv::kNumBlocks == 32 && nv::kBlockSize == 16, "one latent block per lane");
  const float s = lut[src[nv::kScaleOffset + nv::scale_byte(lane)]];
  const uint8_t* q = src + nv::kLatentOffset + lane * (nv::kBlockSize / 2);
  T* dl = d + lane * nv::kBlockSize;
  if (aligned(q, 8) && aligned(dl, 8 * sizeof(T))) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(q));
    const uint32_t words[2] = {w.x, w.y};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      Pack8<T> o;
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = Out::from(nv::decode_e2m1((words[h] >> (4 * j)) & 0xFu) * s);
      reinterpret_cast<Pack8<T>*>(dl)[h] = o;
    }
  } else {
#pragma unroll
    for (int j = 0; j < nv::kBlockSize / 2; ++j) {
      const uint32_t b = q[j];
      dl[2 * j] = Out::from(nv::decode_e2m1(b & 0xFu) * s);
      dl[2 * j + 1] = Out::from(nv::decode_e2m1(b >> 4) * s);
    }
  }
  if (lane < nv::kRopeDim / 8) {
    const uint8_t* pe = src + nv::kRopeOffset + 8 * lane;
    T* dr = d + nv::kLatentDim + 8 * lane;
    if (aligned(pe, 8) && aligned(dr, 8 * sizeof(T))) {
      const uint2 r = __ldg(reinterpret_cast<const uint2*>(pe));
      Pack8<T> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o.v[j] = Out::from(lut[(r.x >> (8 * j)) & 0xFF]);
        o.v[4 + j] = Out::from(lut[(r.y >> (8 * j)) & 0xFF]);
      }
      *reinterpret_cast<Pack8<T>*>(dr) = o;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) dr[j] = Out::from(lut[pe[j]]);
    }
  }
}

// KIND: GatherKind as int. Out is unused for kRaw.
// ptxas (CUDA 13.0): 32-40 registers on sm_86 and sm_90a, no spills.
template <class Out, int KIND>
// register budget: 64
__global__ void __launch_bounds__(kThreads) gather_kernel(const GatherParams p) {
  using T = typename Out::T;
  __shared__ T lut_t[256];
  __shared__ float lut_f[256];
  if constexpr (KIND == static_cast<int>(GatherKind::kFp8E4M3) ||
                KIND == static_cast<int>(GatherKind::kFp8E5M2)) {
    const float scale = checked_k_scale(*p.k_scale);  // NaN rows for an invalid scale
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
      const float v = KIND == static_cast<int>(GatherKind::kFp8E4M3) ? fp8::decode_e4m3(b) : fp8::decode_e5m2(b);
      lut_t[b] = Out::from(v * scale);
    }
    __syncthreads();
  } else if constexpr (KIND == static_cast<int>(GatherKind::kFp8DsMla) ||
                       KIND == static_cast<int>(GatherKind::kNvfp4DsMla)) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) lut_f[b] = fp8::decode_e4m3(b);
    __syncthreads();
  }
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / 32;
  const int64_t lo = max(p.cu_seq_lens[0], 0);
  const int64_t hi = min(static_cast<int64_t>(p.cu_seq_lens[p.num_reqs]), static_cast<int64_t>(p.dst_rows));
  if (t < lo || t >= hi) return;
  const uint8_t* src = gather_source_row(p, t);
  uint8_t* drow = p.dst + t * p.dst_row_stride;
  if constexpr (KIND == static_cast<int>(GatherKind::kRaw)) {
    raw_row(src, drow, p.row_bytes, lane);
  } else {
    T* d = reinterpret_cast<T*>(drow);
    if (!src) {
      raw_row(nullptr, drow, p.width * static_cast<int64_t>(sizeof(T)), lane);  // zeros
    } else if constexpr (KIND == static_cast<int>(GatherKind::kFp8DsMla)) {
      ds_mla_row<Out>(src, d, p.width, lut_f, lane);
    } else if constexpr (KIND == static_cast<int>(GatherKind::kNvfp4DsMla)) {
      nvfp4_ds_mla_row<Out>(src, d, lut_f, lane);  // width is 576 (checked by the bindings)
    } else {
      per_tensor_row(src, d, p.width, lut_t, lane);
    }
  }
}

template <class Out>
void launch_dequant(const GatherParams& p, dim3 grid, cudaStream_t s) {
  switch (p.kind) {
    case GatherKind::kFp8E4M3:
      gather_kernel<Out, static_cast<int>(GatherKind::kFp8E4M3)><<<grid, kThreads, 0, s>>>(p);
      break;
    case GatherKind::kFp8E5M2:
      gather_kernel<Out, static_cast<int>(GatherKind::kFp8E5M2)><<<grid, kThreads, 0, s>>>(p);
      break;
    case GatherKind::kNvfp4DsMla:
      gather_kernel<Out, static_cast<int>(GatherKind::kNvfp4DsMla)><<<grid, kThreads, 0, s>>>(p);
      break;
    default:
      gather_kernel<Out, static_cast<int>(GatherKind::kFp8DsMla)><<<grid, kThreads, 0, s>>>(p);
      break;
  }
}

}  // namespace

int gather_cuda_rowwise(const GatherParams& p, void* stream) {
  if (p.num_reqs <= 0 || p.dst_rows <= 0) return 0;
  const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(p.dst_rows) + kRowsPerCta - 1) / kRowsPerCta));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.kind == GatherKind::kRaw) {
    gather_kernel<OutF32, static_cast<int>(GatherKind::kRaw)><<<grid, kThreads, 0, s>>>(p);
  } else if (p.dst_type == ElemType::kBF16) {
    launch_dequant<OutBF16>(p, grid, s);
  } else if (p.dst_type == ElemType::kF16) {
    launch_dequant<OutF16>(p, grid, s);
  } else {
    launch_dequant<OutF32>(p, grid, s);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cache
}  // namespace mla_ext
