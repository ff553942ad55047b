// Lane-level pieces of the vectorised cache writer (write.cu write_vec_kernel)
// and of its kv-scale amax (amax_rows_kernel), shared
// with the host emulator (tests/cache/emulator/paged_gather_emulator.cpp) that the tests
// run against the CPU kernel on machines without a GPU.
//
// One warp per token, lane `lane` of 32:
//   native copy   every segment (kv_c bytes, then k_pe bytes) in N-byte units,
//                 N the largest of 16, 8, 4, 2, 1 dividing both addresses and
//                 the length; four loads in flight per lane before its stores.
//   fp8 per tensor  groups of 8 values: one 16-byte load (bf16/fp16; two for
//                 fp32), one 8-byte store of 8 e4m3/e5m2 bytes.
//   fp8_ds_mla    lane owns latent values [16 lane, 16 lane + 16): two 16-byte
//                 loads (four for fp32), the 128-value tile's amax across its 8
//                 lanes (the kernel's shuffles, the emulator's loop), one
//                 16-byte store of 16 e4m3 bytes; lanes 0, 8, 16, 24 store their
//                 tile's 4-byte scale; lanes 0..7 move 8 k_pe values each (16
//                 bytes in, 16 bytes of bf16 out).
//   nvfp4_ds_mla  lane owns latent block `lane`: two 16-byte loads, one 8-byte
//                 store of the 16 codes, one scale byte (the 32 lanes' bytes
//                 fill one 32-byte sector: one transaction per warp); lanes
//                 0..7 encode 8 k_pe values each: one 16-byte load, one 8-byte
//                 store.
// Rows whose addresses do not allow a vector width take narrower loads/stores
// (down to one element), with the same results.
//
// Division by a power-of-two scale is a multiplication by its reciprocal, bit
// for bit: see pow2_reciprocal. The other divisions (a per-tensor k_scale that
// is not a power of two, nvfp4's e4m3 block scales) stay IEEE divisions, as
// in the CPU kernel and the reference.
// Torch-free.
#pragma once

#include <cstdint>

#include "cache/cache_kernels.h"
#include "cache/nvfp4_ds_mla.h"
#include "cache/vec.h"
#include "common/cache_layout.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {
namespace wl {

constexpr int kLanes = 32;

MLA_HOST_DEVICE inline bool aligned_to(const void* p, int n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

// ---------------------------------------------------------------------------
// power-of-two scales

// 1 / s, exactly, when s = 2^k is a normal power of two (k in [-126, 127]):
// 2^-k is representable (a normal, or 2^-127 = the subnormal 0x00400000), and
// +inf -> +0. Returns false (and 1 / s unset) for anything else.
//
// Why x * (1 / s) is bit-identical to x / s for s = 2^k: IEEE 754 makes both
// the division and the multiplication return their exact real result rounded
// once (round to nearest even). With 1 / s = 2^-k exact, the exact results
// x / 2^k and x * 2^-k are the same real number, so the rounded results are
// the same float: also when that result is subnormal (one rounding, on the
// same value), overflows (both +-inf), is zero (sign of x either way: s > 0),
// and for x = +-inf (+-inf) and x = NaN (NaN). For s = +inf (a tile scale of
// an infinite amax): x / inf and x * 0 are both +-0 for finite x (sign of x)
// and NaN for infinite or NaN x. This needs subnormals kept (no -ftz, no fast
// math: nvcc's and the host compilers' default) and the product rounded on
// its own (vec::mul_rn: never contracted into an FMA).
// tests/test_cache_paged_gather.py checks it over every power of two and
// adversarial x (subnormal results, ties, inf, NaN).
MLA_HOST_DEVICE inline bool pow2_reciprocal(float s, float* inv) {
  const uint32_t u = fp8::f32_bits(s);
  const uint32_t e = (u >> 23) & 0xFFu;
  if (u == 0x7F800000u) {  // +inf
    *inv = 0.0f;
    return true;
  }
  if ((u & 0x807FFFFFu) != 0 || e == 0 || e == 0xFFu) return false;  // negative, not 2^k, subnormal, NaN
  *inv = e <= 253 ? fp8::bits_f32((254u - e) << 23) : fp8::bits_f32(0x00400000u);  // 2^(127 - e)
  return true;
}

// x / s as the CPU kernel computes it, with the division replaced by a
// multiplication when s is a power of two (inv_ok, inv from pow2_reciprocal).
MLA_HOST_DEVICE inline float scaled(float x, float s, bool inv_ok, float inv) {
  return inv_ok ? vec::mul_rn(x, inv) : x / s;
}

// ---------------------------------------------------------------------------
// input rows

MLA_HOST_DEVICE inline float load_value(const uint8_t* row, ElemType t, int64_t i) {
  if (t == ElemType::kBF16) return fp8::bf16_bits_to_f32(vec::load_plain<2>(row + 2 * i));
  if (t == ElemType::kF16) return vec::f16_to_f32(vec::load_plain<2>(row + 2 * i));
  return fp8::bits_f32(vec::load_plain<4>(row + 4 * i));
}

// Values [i, i + 8) of a row (i a multiple of 8); `vec16`: the row starts at a
// 16-byte boundary, so the 8 values are one (16-bit) or two (fp32) 16-byte loads.
MLA_HOST_DEVICE inline void load8(const uint8_t* row, ElemType t, int64_t i, bool vec16, float* x) {
  if (!vec16) {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = load_value(row, t, i + j);
    return;
  }
  if (t == ElemType::kF32) {
    const vec::U32x4 a = vec::load_plain<16>(row + 4 * i), b = vec::load_plain<16>(row + 4 * i + 16);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = fp8::bits_f32(w[j]);
    return;
  }
  const vec::U32x4 a = vec::load_plain<16>(row + 2 * i);
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (t == ElemType::kBF16) {
      x[2 * j] = fp8::bits_f32(w[j] << 16);
      x[2 * j + 1] = fp8::bits_f32(w[j] & 0xFFFF0000u);
    } else {
      x[2 * j] = vec::f16_to_f32(w[j]);
      x[2 * j + 1] = vec::f16_to_f32(w[j] >> 16);
    }
  }
}

// Stores NB (4, 8 or 16) bytes held little-endian in w[] at d, with the widest
// stores d's alignment allows.
template <int NB>
MLA_HOST_DEVICE inline void store_bytes(uint8_t* d, const uint32_t* w) {
  if (aligned_to(d, NB)) {
    if constexpr (NB == 16) {
      vec::store<16>(d, vec::U32x4{w[0], w[1], w[2], w[3]});
    } else if constexpr (NB == 8) {
      vec::store<8>(d, vec::U32x2{w[0], w[1]});
    } else {
      vec::store<4>(d, w[0]);
    }
  } else if (aligned_to(d, 4)) {
#pragma unroll
    for (int i = 0; i < NB / 4; ++i) vec::store<4>(d + 4 * i, w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < NB; ++i) vec::store<1>(d + i, static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4))));
  }
}

// ---------------------------------------------------------------------------
// native copy

template <int N>
MLA_HOST_DEVICE inline void copy_units(uint8_t* d, const uint8_t* s, int64_t units, int lane) {
  constexpr int kBatch = 4;
  for (int64_t i0 = lane; i0 < units; i0 += kBatch * kLanes) {
    typename vec::Bytes<N>::T v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (i0 + k * kLanes < units) v[k] = vec::load_plain<N>(s + N * (i0 + k * kLanes));
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (i0 + k * kLanes < units) vec::store<N>(d + N * (i0 + k * kLanes), v[k]);
    }
  }
}

MLA_HOST_DEVICE inline void copy_segment(uint8_t* d, const uint8_t* s, int64_t n, int lane) {
  const uint64_t a = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | static_cast<uint64_t>(n) | 16u;
  switch (static_cast<int>(a & (~a + 1))) {
    case 16: return copy_units<16>(d, s, n / 16, lane);
    case 8: return copy_units<8>(d, s, n / 8, lane);
    case 4: return copy_units<4>(d, s, n / 4, lane);
    case 2: return copy_units<2>(d, s, n / 2, lane);
    default: return copy_units<1>(d, s, n, lane);
  }
}

MLA_HOST_DEVICE inline void copy_lane(const WriteParams& p, int64_t t, uint8_t* dst, int lane) {
  const int64_t eb = elem_bytes(p.in_type);
  copy_segment(dst, p.kv_c + t * p.kv_c_row_stride, p.L * eb, lane);
  copy_segment(dst + p.L * eb, p.k_pe + t * p.k_pe_row_stride, p.R * eb, lane);
}

// ---------------------------------------------------------------------------
// per-tensor fp8

MLA_HOST_DEVICE inline uint8_t encode_fp8(float x, bool e4m3) {
  return e4m3 ? fp8::encode_e4m3_sat(x) : fp8::encode_e5m2_sat(x);
}

MLA_HOST_DEVICE inline void per_tensor_lane(const WriteParams& p, int64_t t, uint8_t* dst, int lane, float scale) {
  const bool e4m3 = p.format == CacheFormat::kFp8E4M3;
  float inv = 0.0f;
  const bool inv_ok = pow2_reciprocal(scale, &inv);
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
  const bool groups = p.L % 8 == 0 && p.R % 8 == 0;
  if (!groups) {
    for (int64_t i = lane; i < p.L + p.R; i += kLanes) {
      const float x = i < p.L ? load_value(kv, p.in_type, i) : load_value(pe, p.in_type, i - p.L);
      vec::store<1>(dst + i, encode_fp8(scaled(x, scale, inv_ok, inv), e4m3));
    }
    return;
  }
  const bool kv16 = aligned_to(kv, 16), pe16 = aligned_to(pe, 16);
  for (int64_t g = lane; g < (p.L + p.R) / 8; g += kLanes) {
    const int64_t i = 8 * g;
    float x[8];
    if (i < p.L) {
      load8(kv, p.in_type, i, kv16, x);
    } else {
      load8(pe, p.in_type, i - p.L, pe16, x);
    }
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j / 4] |= static_cast<uint32_t>(encode_fp8(scaled(x[j], scale, inv_ok, inv), e4m3)) << (8 * (j % 4));
    store_bytes<8>(dst + i, w);
  }
}

// ---------------------------------------------------------------------------
// fp8_ds_mla

constexpr int kDsPerLane = ds_mla::kLatentDim / kLanes;  // 16
static_assert(kDsPerLane == 16 && ds_mla::kTileSize == 8 * kDsPerLane, "8 lanes per 128-value tile");

// Loads the lane's 16 latent values; returns their amax (NaN ignored, as
// the CPU kernel's std::max).
MLA_HOST_DEVICE inline float ds_load(const WriteParams& p, int64_t t, int lane, float* x) {
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  const bool kv16 = aligned_to(kv, 16);
  load8(kv, p.in_type, kDsPerLane * lane, kv16, x);
  load8(kv, p.in_type, kDsPerLane * lane + 8, kv16, x + 8);
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kDsPerLane; ++j) {
    const float a = x[j] < 0.0f ? -x[j] : x[j];
    amax = a > amax ? a : amax;
  }
  return amax;
}

// Given the tile's amax (max over its 8 lanes' ds_load results): the lane's 16
// e4m3 bytes, its tile's scale (lanes 8k), 8 k_pe values (lanes 0..7).
MLA_HOST_DEVICE inline void ds_store(const WriteParams& p, int64_t t, uint8_t* dst, int lane, const float* x,
                                     float tile_amax) {
  const float s = fp8::ds_mla_tile_scale(tile_amax, ds_mla::kE4M3Max, ds_mla::kMinScale);
  float inv = 0.0f;
  const bool inv_ok = pow2_reciprocal(s, &inv);  // always true: s = 2^k (k in [-13, 120]) or +inf
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < kDsPerLane; ++j) w[j / 4] |= static_cast<uint32_t>(fp8::encode_e4m3_sat(scaled(x[j], s, inv_ok, inv))) << (8 * (j % 4));
  store_bytes<16>(dst + ds_mla::kLatentOffset + kDsPerLane * lane, w);
  if (lane % 8 == 0) {
    const uint32_t sw[1] = {fp8::f32_bits(s)};
    store_bytes<4>(dst + ds_mla::kScaleOffset + 4 * (lane / 8), sw);
  }
  if (lane < ds_mla::kRopeDim / 8) {  // 8 lanes x 8 k_pe values (zeros for R = 0)
    uint32_t r[4] = {0u, 0u, 0u, 0u};
    if (p.R > 0) {
      const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
      if (p.in_type == ElemType::kBF16) {  // the bits themselves
        if (aligned_to(pe, 16)) {
          const vec::U32x4 v = vec::load_plain<16>(pe + 16 * lane);
          r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) r[j / 2] |= static_cast<uint32_t>(vec::load_plain<2>(pe + 16 * lane + 2 * j)) << (16 * (j % 2));
        }
      } else {
        float v[8];
        load8(pe, p.in_type, 8 * lane, aligned_to(pe, 16), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j / 2] |= static_cast<uint32_t>(fp8::f32_to_bf16_bits(v[j])) << (16 * (j % 2));
      }
    }
    store_bytes<16>(dst + ds_mla::kRopeOffset + 16 * lane, r);
  }
}

// ---------------------------------------------------------------------------
// nvfp4_ds_mla

MLA_HOST_DEVICE inline void nvfp4_lane(const WriteParams& p, int64_t t, uint8_t* dst, int lane) {
  namespace nv = nvfp4_ds_mla;
  static_assert(nv::kNumBlocks == kLanes && nv::kBlockSize == 16, "one latent block per lane");
  const uint8_t* kv = p.kv_c + t * p.kv_c_row_stride;
  const bool kv16 = aligned_to(kv, 16);
  float x[nv::kBlockSize];
  load8(kv, p.in_type, nv::kBlockSize * lane, kv16, x);
  load8(kv, p.in_type, nv::kBlockSize * lane + 8, kv16, x + 8);
  uint32_t w[2];
  const uint8_t sb = nv::encode_block(x, w);
  store_bytes<8>(dst + nv::kLatentOffset + (nv::kBlockSize / 2) * lane, w);
  vec::store<1>(dst + nv::kScaleOffset + nv::scale_byte(lane), sb);
  if (lane < nv::kRopeDim / 8) {
    const uint8_t* pe = p.k_pe + t * p.k_pe_row_stride;
    float v[8];
    load8(pe, p.in_type, 8 * lane, aligned_to(pe, 16), v);
    uint32_t r[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j / 4] |= static_cast<uint32_t>(fp8::encode_e4m3_sat(v[j])) << (8 * (j % 4));
    store_bytes<8>(dst + nv::kRopeOffset + 8 * lane, r);
  }
}

// ---------------------------------------------------------------------------
// kv-scale amax

// Work items of the amax: (token, segment, chunk of kAmaxChunk columns), the
// segments being the kv_c row (L columns) and the k_pe row (R columns). One
// 64-bit division per item (thousands of values), none per value.
constexpr int64_t kAmaxChunk = 4096;

MLA_HOST_DEVICE inline int64_t amax_chunks(int64_t n) { return (n + kAmaxChunk - 1) / kAmaxChunk; }

MLA_HOST_DEVICE inline int64_t amax_items(const KvScaleParams& p) {
  return static_cast<int64_t>(p.num_tokens) * (amax_chunks(p.L) + amax_chunks(p.R));
}

// The lane's amax of |finite values| in work item `item` (the CPU kernel
// ignores infinities and NaN too).
MLA_HOST_DEVICE inline float amax_lane(const KvScaleParams& p, int64_t item, int lane) {
  const int64_t ckv = amax_chunks(p.L), per_token = ckv + amax_chunks(p.R);
  const int64_t t = item / per_token;
  int64_t c = item - t * per_token;
  const bool is_kv = c < ckv;
  if (!is_kv) c -= ckv;
  const uint8_t* row = is_kv ? p.kv_c + t * p.kv_c_row_stride : p.k_pe + t * p.k_pe_row_stride;
  const int64_t n = is_kv ? p.L : p.R;
  const int64_t c0 = c * kAmaxChunk, c1 = c0 + kAmaxChunk < n ? c0 + kAmaxChunk : n;
  const bool v16 = aligned_to(row, 16);  // c0 is a multiple of 8: groups stay 16-byte aligned
  float amax = 0.0f;
  const int64_t g1 = c0 + (c1 - c0) / 8 * 8;  // whole groups of 8, then the tail element by element
  for (int64_t i = c0 + 8 * lane; i < g1; i += 8 * kLanes) {
    float x[8];
    load8(row, p.in_type, i, v16, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = x[j] < 0.0f ? -x[j] : x[j];
      if (a <= 3.40282347e38f) amax = a > amax ? a : amax;  // false for inf and NaN
    }
  }
  for (int64_t i = g1 + lane; i < c1; i += kLanes) {
    const float x = load_value(row, p.in_type, i);
    const float a = x < 0.0f ? -x : x;
    if (a <= 3.40282347e38f) amax = a > amax ? a : amax;
  }
  return amax;
}

}  // namespace wl
}  // namespace cache
}  // namespace mla_ext
