// Small-float conversions shared by the CPU and CUDA cache kernels.
//
// fp8 e4m3fn / e5m2 encode (round-to-nearest-even, SATURATING to the largest
// finite value; NaN stays NaN) and decode, plus fp32 -> bf16 / fp16 rounding.
// Bit-exact with torch's own conversions after a clamp to +-max (what
// mla_ext/cache/reference.py does); tests/test_cache_fp8.py proves it over all
// 256 bytes and random floats. Torch-free: kernels include it directly.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef MLA_HOST_DEVICE
#if defined(__CUDACC__)
#define MLA_HOST_DEVICE __host__ __device__
#else
#define MLA_HOST_DEVICE
#endif
#endif

namespace mla_ext {
namespace fp8 {

MLA_HOST_DEVICE inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MLA_HOST_DEVICE inline float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// e4m3fn: bias 7, no infinities, 0x7F/0xFF are NaN, max 448 (0x7E).
MLA_HOST_DEVICE inline uint8_t encode_e4m3_sat(float x) {
  uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return sign | 0x7F;  // NaN
  if (u >= 0x43E00000u) return sign | 0x7E;  // >= 448 (incl. inf): saturate
  if (u < (121u << 23)) {
    // Below 2^-6 the result is a subnormal k * 2^-9: adding 2^14 (whose ulp
    // is 2^-9) lets the FPU do the round-to-nearest-even for us.
    const float big = bits_f32(141u << 23);
    return sign | static_cast<uint8_t>(f32_bits(bits_f32(u) + big) - (141u << 23));
  }
  const uint32_t odd = (u >> 20) & 1u;  // RNE: ties go to the even mantissa
  u -= (120u << 23);                     // rebias exponent 127 -> 7
  u += 0x7FFFFu + odd;
  return sign | static_cast<uint8_t>(u >> 20);
}

// e5m2: bias 15 (the top byte of an fp16), max finite 57344 (0x7B).
MLA_HOST_DEVICE inline uint8_t encode_e5m2_sat(float x) {
  uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return sign | 0x7F;  // NaN
  if (u >= 0x47600000u) return sign | 0x7B;  // >= 57344 (incl. inf): saturate
  if (u < (113u << 23)) {
    // Below 2^-14: subnormal k * 2^-16; 2^7 has an ulp of 2^-16.
    const float big = bits_f32(134u << 23);
    return sign | static_cast<uint8_t>(f32_bits(bits_f32(u) + big) - (134u << 23));
  }
  const uint32_t odd = (u >> 21) & 1u;
  u -= (112u << 23);  // rebias exponent 127 -> 15
  u += 0xFFFFFu + odd;
  return sign | static_cast<uint8_t>(u >> 21);
}

MLA_HOST_DEVICE inline float decode_e4m3(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
  if (e == 0xFu && m == 0x7u) return bits_f32(sign | 0x7FC00000u);  // NaN
  if (e == 0) return bits_f32(sign | f32_bits(static_cast<float>(m) * (1.0f / 512.0f)));
  return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

MLA_HOST_DEVICE inline float decode_e5m2(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 2) & 0x1Fu, m = b & 0x3u;
  if (e == 0x1Fu) return bits_f32(sign | (m ? 0x7FC00000u : 0x7F800000u));  // NaN / inf
  if (e == 0) return bits_f32(sign | f32_bits(static_cast<float>(m) * (1.0f / 65536.0f)));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 21));
}

// fp32 -> bf16 bits, round to nearest even; every NaN becomes 0x7FC0 (as torch).
MLA_HOST_DEVICE inline uint16_t f32_to_bf16_bits(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

MLA_HOST_DEVICE inline float bf16_bits_to_f32(uint16_t h) {
  return bits_f32(static_cast<uint32_t>(h) << 16);
}

// fp32 -> fp16 bits, round to nearest even, overflow to inf (IEEE, as torch).
MLA_HOST_DEVICE inline uint16_t f32_to_f16_bits(float x) {
  uint32_t u = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return sign | 0x7E00;        // NaN
  if (u >= 0x477FF000u) return sign | 0x7C00;       // rounds to >= 65536: inf
  if (u < (113u << 23)) {
    // Below 2^-14: subnormal k * 2^-24; 0.5 has an ulp of 2^-24.
    const float big = bits_f32(126u << 23);
    return sign | static_cast<uint16_t>(f32_bits(bits_f32(u) + big) - (126u << 23));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u -= (112u << 23);
  u += 0xFFFu + odd;
  return sign | static_cast<uint16_t>(u >> 13);
}

MLA_HOST_DEVICE inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) return bits_f32(sign | f32_bits(static_cast<float>(m) * (1.0f / 16777216.0f)));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// Power-of-two fp8_ds_mla tile scale 2^ceil(log2(max(amax / 448, 1e-4))),
// with ceil(log2) taken exactly from the bits (see reference._ds_tile_scales).
MLA_HOST_DEVICE inline float ds_mla_tile_scale(float amax, float e4m3_max, float min_scale) {
  float s = amax / e4m3_max;
  if (!(s >= min_scale)) s = min_scale;  // also maps NaN to the floor
  const uint32_t u = f32_bits(s);
  if ((u & 0x7FFFFFu) == 0) return s;  // already a power of two
  return bits_f32(((u >> 23) + 1u) << 23);
}

}  // namespace fp8
}  // namespace mla_ext
