// Vector loads/stores and small-float conversions of the vectorised cache
// kernels (csrc/cache/paged_gather.h, csrc/cache/write_lanes.h).
//
// Everything here compiles both as CUDA device code and as plain host C++, so
// the kernels' row logic can run on the CPU as well (the paged-gather and
// writer emulators that tests/test_cache_paged_gather.py builds with g++):
// device-only instructions sit behind `#if defined(__CUDA_ARCH__)`, next to a
// portable branch with the same results, bit for bit (NaN payloads excepted:
// a device conversion returns the canonical NaN).
//
//   * load<N>/store<N>: N = 16, 8, 4, 2, 1 bytes at an N-aligned address
//     (ld.global.nc.v4 / st.global.v4 for N = 16 on the device).
//   * e4m3x4_to_f32 / e5m2x4_to_f32: four fp8 bytes (one 32-bit word) to their
//     exact fp32 values. sm_89+: cvt.rn.f16x2.e4m3x2 / e5m2x2 (two values per
//     instruction; f16 holds every fp8 value exactly) and cvt.f32.f16.
//     sm_86 and the host: integer bit moves, no table (see the functions).
//   * pack2<Out>: two fp32 -> two bf16/fp16 (round to nearest even: one
//     cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 on the device) or two fp32.
//   * e2m1x8_mul: eight e2m1 codes times a (bf16 or fp16) scale, exactly,
//     with a byte-permute table held in two registers.
//
// Torch-free.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/cache_layout.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {
namespace vec {

struct alignas(16) U32x4 {
  uint32_t x, y, z, w;
};
struct alignas(8) U32x2 {
  uint32_t x, y;
};

template <int N>
struct Bytes;
template <>
struct Bytes<16> {
  using T = U32x4;
};
template <>
struct Bytes<8> {
  using T = U32x2;
};
template <>
struct Bytes<4> {
  using T = uint32_t;
};
template <>
struct Bytes<2> {
  using T = uint16_t;
};
template <>
struct Bytes<1> {
  using T = uint8_t;
};

// N bytes from an N-aligned global address the kernel never writes (the
// bindings refuse an output that overlaps an input): the read-only path.
template <int N>
MLA_HOST_DEVICE inline typename Bytes<N>::T load(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if constexpr (N == 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    return U32x4{v.x, v.y, v.z, v.w};
  } else if constexpr (N == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    return U32x2{v.x, v.y};
  } else {
    return __ldg(reinterpret_cast<const typename Bytes<N>::T*>(p));
  }
#else
  typename Bytes<N>::T v;
  std::memcpy(&v, p, N);
  return v;
#endif
}

// A load through the ordinary (coherent) path, for inputs the caller may also
// write elsewhere (the cache writer's kv_c / k_pe rows).
template <int N>
MLA_HOST_DEVICE inline typename Bytes<N>::T load_plain(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if constexpr (N == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    return U32x4{v.x, v.y, v.z, v.w};
  } else if constexpr (N == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return U32x2{v.x, v.y};
  } else {
    return *reinterpret_cast<const typename Bytes<N>::T*>(p);
  }
#else
  typename Bytes<N>::T v;
  std::memcpy(&v, p, N);
  return v;
#endif
}

template <int N>
MLA_HOST_DEVICE inline void store(uint8_t* p, const typename Bytes<N>::T& v) {
#if defined(__CUDA_ARCH__)
  if constexpr (N == 16) {
    *reinterpret_cast<uint4*>(p) = make_uint4(v.x, v.y, v.z, v.w);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(v.x, v.y);
  } else {
    *reinterpret_cast<typename Bytes<N>::T*>(p) = v;
  }
#else
  std::memcpy(p, &v, N);
#endif
}

template <int N>
MLA_HOST_DEVICE inline typename Bytes<N>::T zeros() {
  return typename Bytes<N>::T{};
}

// Stores `n` bytes of words[] (n a multiple of 4, at most 64) at a
// min(16, n)-aligned address, 16 bytes per store while they last.
template <int NBYTES>
MLA_HOST_DEVICE inline void store_words(uint8_t* d, const uint32_t* w) {
  static_assert(NBYTES % 4 == 0 && NBYTES <= 64, "whole words");
  if constexpr (NBYTES >= 16) {
#pragma unroll
    for (int i = 0; i < NBYTES / 16; ++i) store<16>(d + 16 * i, U32x4{w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]});
  } else if constexpr (NBYTES == 8) {
    store<8>(d, U32x2{w[0], w[1]});
  } else {
    store<4>(d, w[0]);
  }
}

template <int NBYTES>
MLA_HOST_DEVICE inline void store_zero_bytes(uint8_t* d) {
  if constexpr (NBYTES >= 16) {
#pragma unroll
    for (int i = 0; i < NBYTES / 16; ++i) store<16>(d + 16 * i, zeros<16>());
  } else {
    store<NBYTES>(d, zeros<NBYTES>());
  }
}

MLA_HOST_DEVICE inline uint32_t byte_of(uint32_t w, int j) { return (w >> (8 * j)) & 0xFFu; }

// The 4-byte permute of {b:a} (bytes 0-3 from a, 4-7 from b) with selector
// nibbles 0..7 (bit 3 of every nibble must be clear: callers mask with 0x7777).
MLA_HOST_DEVICE inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t both = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<uint32_t>((both >> (8 * ((sel >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
#endif
}

// ---------------------------------------------------------------------------
// scalar helpers

// a * b rounded once (never contracted into an FMA with a later add).
MLA_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MLA_HOST_DEVICE inline float f16_to_f32(uint32_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(h & 0xFFFFu)));
  return f;
#else
  return fp8::f16_bits_to_f32(static_cast<uint16_t>(h & 0xFFFFu));
#endif
}

// ---------------------------------------------------------------------------
// fp8 -> fp32

// Four e4m3 bytes -> their exact values.
//
// Portable path: an e4m3 byte s.eeee.mmm placed at fp32 bits s << 31 |
// eeeemmm << 20 reads as 2^-120 times its value for every finite encoding
// (normals: the exponent field is e, i.e. 2^(e - 127) vs 2^(e - 7); subnormals
// (e = 0): m * 2^-129 as an fp32 subnormal vs m * 2^-9), so one exact multiply
// by 2^120 finishes it. This needs subnormals kept (no -ftz, no fast math:
// the default of nvcc and of every host compiler). The only other encodings,
// 0x7F / 0xFF, are NaN: one SWAR test per word finds them (a low-7-bit pattern
// of 0x7F is the only one that carries into bit 7 when 1 is added).
MLA_HOST_DEVICE inline void e4m3x4_to_f32(uint32_t w, float* f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t lo, hi;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(static_cast<unsigned short>(w & 0xFFFFu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(static_cast<unsigned short>(w >> 16)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f[0]) : "h"(static_cast<unsigned short>(lo & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f[1]) : "h"(static_cast<unsigned short>(lo >> 16)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f[2]) : "h"(static_cast<unsigned short>(hi & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f[3]) : "h"(static_cast<unsigned short>(hi >> 16)));
#else
  constexpr float k2p120 = 1.329227995784915872903807060280344576e36f;  // 2^120
  const uint32_t nan = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;  // bit 7 of each NaN byte
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t b = byte_of(w, j);
    const float v = fp8::bits_f32(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)) * k2p120;
    f[j] = (nan >> (8 * j)) & 0x80u ? fp8::bits_f32(((b & 0x80u) << 24) | 0x7FC00000u) : v;
  }
#endif
}

// Four e5m2 bytes -> their exact values. An e5m2 byte is the high byte of the
// fp16 with the same value (infinities and NaN included); the device converts
// that fp16 with one cvt on every architecture.
MLA_HOST_DEVICE inline void e5m2x4_to_f32(uint32_t w, float* f) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#if defined(__CUDA_ARCH__)
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[j]) : "h"(static_cast<unsigned short>(byte_of(w, j) << 8)));
#else
    f[j] = fp8::decode_e5m2(static_cast<uint8_t>(byte_of(w, j)));
#endif
  }
}

template <bool E5M2>
MLA_HOST_DEVICE inline void fp8x4_to_f32(uint32_t w, float* f) {
  if constexpr (E5M2) {
    e5m2x4_to_f32(w, f);
  } else {
    e4m3x4_to_f32(w, f);
  }
}

template <bool E5M2>
MLA_HOST_DEVICE inline float fp8_to_f32(uint32_t b) {
  return E5M2 ? fp8::decode_e5m2(static_cast<uint8_t>(b)) : fp8::decode_e4m3(static_cast<uint8_t>(b));
}

// ---------------------------------------------------------------------------
// fp32 -> output element types

// Destination element types: storage bytes, the rounding of one value and the
// packing of two (round to nearest even, exactly as common/fp8.h).
template <bool F16>
struct Out16 {
  static constexpr int kBytes = 2;
  MLA_HOST_DEVICE static uint32_t pack2(float a, float b) {
#if defined(__CUDA_ARCH__)
    uint32_t r;
    if constexpr (F16) {
      asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(a), "f"(b));
    } else {
      asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(a), "f"(b));
    }
    return r;
#else
    const auto bits = [](float x) { return F16 ? fp8::f32_to_f16_bits(x) : fp8::f32_to_bf16_bits(x); };
    return bits(a) | (static_cast<uint32_t>(bits(b)) << 16);
#endif
  }
};
using OutBF16 = Out16<false>;
using OutF16 = Out16<true>;
struct OutF32 {
  static constexpr int kBytes = 4;
};

// n values (n even) -> their output words: n/2 words for 16-bit outputs, n for fp32.
template <class Out, int NVALS>
MLA_HOST_DEVICE inline void pack_values(const float* v, uint32_t* w) {
  if constexpr (Out::kBytes == 4) {
#pragma unroll
    for (int i = 0; i < NVALS; ++i) w[i] = fp8::f32_bits(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < NVALS / 2; ++i) w[i] = Out::pack2(v[2 * i], v[2 * i + 1]);
  }
}

// One value -> its output bits (the scalar fallbacks).
template <class Out>
MLA_HOST_DEVICE inline void store_value(uint8_t* d, float x) {
  if constexpr (Out::kBytes == 4) {
    store<4>(d, fp8::f32_bits(x));
  } else {
    store<2>(d, static_cast<uint16_t>(Out::pack2(x, 0.0f) & 0xFFFFu));
  }
}

// ---------------------------------------------------------------------------
// e2m1 (nvfp4) codes times a block scale

// Products of an e2m1 value (at most 2 significant bits, |v| <= 6) and an e4m3
// scale (at most 4 significant bits, 2^-9 <= |s| <= 448) have at most 5
// significant bits and lie in [2^-10, 2688]: exact in bf16 and in fp16, so a
// 16-bit multiply rounds nothing and equals the fp32 product the CPU kernel
// rounds (also exactly) to the output type. Every e4m3 scale is exact in both
// 16-bit types, NaN included.
//
// Magnitude index m (3 bits) -> 16-bit pattern via two byte tables held in
// registers and the byte permute: bf16 patterns 0, .5, 1, 1.5, 2, 3, 4, 6 are
// 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0; fp16 0x0000 3800 3C00 3E00 4000
// 4200 4400 4600 (low bytes all zero).
template <bool F16>
struct E2m1Table {
  static constexpr uint32_t kHi0 = F16 ? 0x3E3C3800u : 0x3F3F3F00u;  // high bytes of m = 0..3
  static constexpr uint32_t kHi1 = F16 ? 0x46444240u : 0x40404040u;  // m = 4..7
  static constexpr uint32_t kLo0 = F16 ? 0u : 0xC0800000u;
  static constexpr uint32_t kLo1 = F16 ? 0u : 0xC0804000u;
};

// a * b of two 16-bit pairs whose products are exact (see above).
template <bool F16>
MLA_HOST_DEVICE inline uint32_t mul2_exact(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  if constexpr (F16) {
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    // a * b + (-0.0): the sum leaves every exact product (and its sign) unchanged.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  }
  return r;
#else
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const uint16_t x = static_cast<uint16_t>(a >> (16 * h)), y = static_cast<uint16_t>(b >> (16 * h));
    const float p = F16 ? fp8::f16_bits_to_f32(x) * fp8::f16_bits_to_f32(y)
                        : fp8::bf16_bits_to_f32(x) * fp8::bf16_bits_to_f32(y);
    r |= static_cast<uint32_t>(F16 ? fp8::f32_to_f16_bits(p) : fp8::f32_to_bf16_bits(p)) << (16 * h);
  }
  return r;
#endif
}

// Eight e2m1 codes (element j in bits [4j, 4j + 4) of w) times the 16-bit
// scale s2 (the same scale in both halves) -> out[0..3], the 16-bit pairs
// (j = 2i in the low half of out[i]).
template <bool F16>
MLA_HOST_DEVICE inline void e2m1x8_mul(uint32_t w, uint32_t s2, uint32_t* out) {
  using Tab = E2m1Table<F16>;
  const uint32_t mag = w & 0x77777777u;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t sel = (half ? mag >> 16 : mag) & 0x7777u;
    const uint32_t hi = byte_perm(Tab::kHi0, Tab::kHi1, sel);  // high byte of values 4 half + 0..3
    const uint32_t lo = byte_perm(Tab::kLo0, Tab::kLo1, sel);
    // Pairs (lo0 hi0 lo1 hi1) and (lo2 hi2 lo3 hi3): bytes of {hi:lo}.
    const uint32_t p01 = byte_perm(lo, hi, 0x5140u);
    const uint32_t p23 = byte_perm(lo, hi, 0x7362u);
    // Sign bits: code bit 3 of value k sits at bit 4k + 3 of w.
    const uint32_t ws = half ? w >> 16 : w;
    const uint32_t s01 = ((ws << 12) & 0x8000u) | ((ws << 24) & 0x80000000u);  // values 0, 1
    const uint32_t s23 = ((ws << 4) & 0x8000u) | ((ws << 16) & 0x80000000u);   // values 2, 3
    out[2 * half] = mul2_exact<F16>(p01 | s01, s2);
    out[2 * half + 1] = mul2_exact<F16>(p23 | s23, s2);
  }
}

// An e4m3 byte -> the same value as a 16-bit pattern repeated in both halves.
template <bool F16>
MLA_HOST_DEVICE inline uint32_t e4m3_scale2(uint32_t b) {
  const float s = fp8::decode_e4m3(static_cast<uint8_t>(b));
  const uint32_t h = F16 ? fp8::f32_to_f16_bits(s) : (fp8::f32_bits(s) >> 16);  // exact either way
  return h | (h << 16);
}

// 16-bit pair -> two fp32 (exact widening).
template <bool F16>
MLA_HOST_DEVICE inline void widen2(uint32_t p, float* f) {
  if constexpr (F16) {
    f[0] = fp8::f16_bits_to_f32(static_cast<uint16_t>(p & 0xFFFFu));
    f[1] = fp8::f16_bits_to_f32(static_cast<uint16_t>(p >> 16));
  } else {
    f[0] = fp8::bits_f32(p << 16);
    f[1] = fp8::bits_f32(p & 0xFFFF0000u);
  }
}

}  // namespace vec
}  // namespace cache
}  // namespace mla_ext
