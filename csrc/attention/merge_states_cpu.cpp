// CPU kernel for merge_attn_states (see merge_states.h for the contract).
// One OpenMP task per (token, head) row, so a row's LSEs are read before any
// of its outputs is written, which makes in-place merging safe.
#include "attention/merge_states.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace mla_ext {
namespace {

// 16-bit float conversions without torch headers. Rounding is to nearest
// even, like torch's own casts, so CPU results match the reference bit for bit.
inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return sign;  // < 2^-25 rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24
    uint32_t half = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

template <typename T>
struct Io;
template <>
struct Io<float> {
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
};
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
template <>
struct Io<Bf16> {
  static float load(const Bf16* p) { return bf16_to_f32(p->bits); }
  static void store(Bf16* p, float v) { p->bits = f32_to_bf16(v); }
};
template <>
struct Io<F16> {
  static float load(const F16* p) { return f16_to_f32(p->bits); }
  static void store(F16* p, float v) { p->bits = f32_to_f16(v); }
};

template <typename T>
void merge_rows(const MergeParams& p) {
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t D = p.head_size;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / p.num_heads, h = r % p.num_heads;
    float a = p.prefix_lse[h * p.prefix_lse_sh + t * p.prefix_lse_st];
    float b = p.suffix_lse[h * p.suffix_lse_sh + t * p.suffix_lse_st];
    if (a == std::numeric_limits<float>::infinity()) a = kNegInf;
    if (b == std::numeric_limits<float>::infinity()) b = kNegInf;
    const float m = a > b ? a : b;
    const T* x1 = static_cast<const T*>(p.prefix_o) + t * p.prefix_st + h * p.prefix_sh;
    const T* x2 = static_cast<const T*>(p.suffix_o) + t * p.suffix_st + h * p.suffix_sh;
    T* y = static_cast<T*>(p.out) + t * p.out_st + h * p.out_sh;
    float out_lse;
    if (m == kNegInf) {  // both sides empty (also covers NaN-free -inf/-inf)
      for (int64_t d = 0; d < D; ++d) Io<T>::store(y + d, 0.0f);
      out_lse = kNegInf;
    } else {
      const float w1 = std::exp(a - m), w2 = std::exp(b - m);
      const float inv = 1.0f / (w1 + w2);
      const float s1 = w1 * inv, s2 = w2 * inv;
      // An empty side is skipped rather than multiplied by 0: its o may hold
      // anything (0 * inf = NaN).
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.0f;
        if (s1 != 0.0f) v += s1 * Io<T>::load(x1 + d);
        if (s2 != 0.0f) v += s2 * Io<T>::load(x2 + d);
        Io<T>::store(y + d, v);
      }
      out_lse = m + std::log(w1 + w2);
    }
    if (p.out_lse != nullptr) p.out_lse[h * p.out_lse_sh + t * p.out_lse_st] = out_lse;
  }
}

}  // namespace

void merge_attn_states_cpu(const MergeParams& p) {
  switch (p.dtype) {
    case MergeDType::kFloat32:
      merge_rows<float>(p);
      break;
    case MergeDType::kFloat16:
      merge_rows<F16>(p);
      break;
    case MergeDType::kBFloat16:
      merge_rows<Bf16>(p);
      break;
  }
}

}  // namespace mla_ext
