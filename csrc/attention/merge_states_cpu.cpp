// CPU kernel for merge_attn_states (see merge_states.h for the contract).
// One OpenMP task per (token, head) row, so a row's LSEs are read before any
// of its outputs is written, which makes in-place merging safe.
#include "attention/merge_states.h"
#include "common/fp8.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace mla_ext {
namespace {

// 16-bit float conversions without torch headers: the shared round-to-
// nearest-even ones of common/fp8.h, which match torch's casts bit for bit.
using fp8::bf16_bits_to_f32;
using fp8::f16_bits_to_f32;
using fp8::f32_to_bf16_bits;
using fp8::f32_to_f16_bits;

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
  static float load(const Bf16* p) { return bf16_bits_to_f32(p->bits); }
  static void store(Bf16* p, float v) { p->bits = f32_to_bf16_bits(v); }
};
template <>
struct Io<F16> {
  static float load(const F16* p) { return f16_bits_to_f32(p->bits); }
  static void store(F16* p, float v) { p->bits = f32_to_f16_bits(v); }
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
