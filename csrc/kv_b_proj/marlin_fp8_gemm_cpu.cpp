// The packed-layout CPU reference GEMM: reads qweight with the same index math
// and bit-shift dequant as the CUDA kernel (marlin_fp8.h) and computes
// C = A · (W · scale)^T in fp32, applying each group's scale to that group's
// partial sum exactly as the kernel does. It is the proof of the packing on
// the CPU, not a fast path.
#include <vector>

#include "kv_b_proj/marlin_fp8.h"

namespace mla_ext {
namespace marlin_fp8 {

void marlin_fp8_gemm_cpu(const GemmParams& p) {
  const int64_t gk = p.group_size > 0 ? p.group_size : p.K;
  const int64_t groups = p.K / gk;
  float* c_out = static_cast<float*>(p.c);
  // Activations decoded once (row-strided source, lda >= K).
  std::vector<float> a(static_cast<size_t>(p.M * p.K));
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) a[m * p.K + k] = act_bits_to_float(p.a[m * p.lda + k], p.act);

  for_each_decoded_column(p.qweight, p.scales, p.N, p.K, p.group_size, p.act,
                          [&](int64_t n, const float* w, const float* s) {
    for (int64_t m = 0; m < p.M; ++m) {
      const float* am = a.data() + m * p.K;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float part = 0.0f;
        for (int64_t k = g * gk; k < (g + 1) * gk; ++k) part += am[k] * w[k];
        acc += part * s[g];
      }
      c_out[m * p.ldc + n] = acc;
    }
  });
}

}  // namespace marlin_fp8
}  // namespace mla_ext
