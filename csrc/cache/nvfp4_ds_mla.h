// nvfp4_ds_mla encode / decode of one cache row's pieces, shared by the CPU and
// CUDA kernels (bit-identical by construction: the same functions run on both).
// The row layout and the quantisation rules are in common/cache_layout.h
// (namespace nvfp4_ds_mla); mla_ext/cache/reference.py is the Python oracle.
// Torch-free.
#pragma once

#include <cstdint>

#include "common/cache_layout.h"
#include "common/fp8.h"

namespace mla_ext {
namespace nvfp4_ds_mla {

// e2m1 code (4 bits: sign in bit 3) -> float. Magnitude index m = (e << 1) | f:
// e = 0 gives f * 0.5 (0 or the subnormal 0.5), else (1 + f / 2) * 2^(e - 1).
// Code 8 is -0.0.
MLA_HOST_DEVICE inline float decode_e2m1(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, f = code & 1u;
  const uint32_t mag = e ? (((e + 126u) << 23) | (f << 22)) : (f ? 0x3F000000u : 0u);  // 0x3F000000 = 0.5f
  return fp8::bits_f32(mag | ((code & 8u) << 28));
}

// |q| -> e2m1 magnitude index 0..7, round to nearest, ties to the even index
// (the grid is 0, .5, 1, 1.5, 2, 3, 4, 6; midpoints .25, .75, 1.25, 1.75,
// 2.5, 3.5, 5 go to 0, 1.0, 1.0, 2, 2, 4, 4), saturating at 6. Branch-free:
// the index counts the thresholds below |q| (strict where the lower
// neighbour is the even one, inclusive where the upper one is).
MLA_HOST_DEVICE inline uint32_t e2m1_magnitude_index(float a) {
  return static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) +
         static_cast<uint32_t>(a > 1.25f) + static_cast<uint32_t>(a >= 1.75f) +
         static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
         static_cast<uint32_t>(a > 5.0f);
}

// Finite x -> e2m1 code of x * inv_scale; the sign bit is x's own (so -0.0
// and small negatives that round to zero give code 8, as a hardware cvt does).
// inv_scale is the IEEE-rounded 1 / scale, not the division x / scale: vLLM's
// writer multiplies by the reciprocal, and at e2m1 rounding ties the two
// differ (byte compatibility with vLLM's caches is the contract).
MLA_HOST_DEVICE inline uint32_t encode_e2m1(float x, float inv_scale) {
  const float q = x * inv_scale;
  const uint32_t sign = (fp8::f32_bits(q) >> 28) & 8u;
  return sign | e2m1_magnitude_index(q < 0.0f ? -q : q);
}

// The e4m3 byte of a block scale: e4m3(max(amax / 6, 2^-9)), RNE, saturating
// at 448. `finite` is false when the block holds a NaN or an infinity: the
// NaN byte, so the block decodes to NaN.
MLA_HOST_DEVICE inline uint8_t block_scale_byte(float amax, bool finite) {
  if (!finite) return kNanScaleByte;
  float s = amax / kE2M1Max;
  if (!(s >= kMinScale)) s = kMinScale;
  return fp8::encode_e4m3_sat(s);
}

// Encodes the 16 values of one latent block. Returns the block's scale byte
// and sets words[0..1] to its codes, element j in bits [4 j, 4 j + 4) of the
// 64-bit little-endian pair, i.e. exactly the block's 8 row bytes (element
// 2 k in the low nibble of byte k) when the words are stored little-endian
// (x86 and CUDA devices are). No arrays, so the CUDA kernel keeps every value
// in registers.
MLA_HOST_DEVICE inline uint8_t encode_block(const float* x, uint32_t* words) {
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < kBlockSize; ++j) {
    const float a = x[j] < 0.0f ? -x[j] : x[j];
    finite = finite && (a <= 3.40282347e38f);  // false for NaN and +-inf
    amax = a > amax ? a : amax;
  }
  const uint8_t sb = block_scale_byte(amax, finite);
  // Exact IEEE reciprocal (no fast math in this project's flags) of a
  // positive e4m3 value, then a multiply per element, as vLLM's writer.
  const float inv = 1.0f / fp8::decode_e4m3(sb);
  uint32_t w0 = 0, w1 = 0;
  for (int j = 0; j < 8; ++j) {
    w0 |= encode_e2m1(x[j], inv) << (4 * j);
    w1 |= encode_e2m1(x[8 + j], inv) << (4 * j);
  }
  words[0] = finite ? w0 : 0u;  // a NaN-scale block keeps all-zero codes
  words[1] = finite ? w1 : 0u;
  return sb;
}

}  // namespace nvfp4_ds_mla
}  // namespace mla_ext
