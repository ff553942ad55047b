// The packed-layout CPU reference GEMM: reads qweight with the same index math
// and bit-shift dequant as the CUDA kernels (marlin_fp8.h) and computes
// C = A · (W · scale)^T in fp32, applying each group's scale to that group's
// partial sum and adding split-K slices in slice order exactly as the CUDA
// kernel does (p.slice_tiles from plan_gemm). It is the
// proof of the packing on the CPU, not a fast path.
#include <vector>

#include "kv_b_proj/marlin_fp8.h"

namespace mla_ext {
namespace marlin_fp8 {

void marlin_fp8_gemm_cpu(const GemmParams& p) {
  const int64_t gk = p.group_size > 0 ? p.group_size : p.K;
  const int64_t k_tiles = p.K / kTileK;
  // Split-K as the CUDA kernel slices it: slice s covers k-tiles
  // [s * slice_tiles, (s + 1) * slice_tiles); inside a slice every scale group's
  // part gets its own fp32 partial times the group scale; the slices' sums are
  // added in slice order (slice_tiles <= 0: one slice).
  const int64_t slice_k = (p.slice_tiles > 0 && p.slice_tiles < k_tiles ? p.slice_tiles : k_tiles) * kTileK;
  float* c_out = static_cast<float*>(p.c);
  // Activations decoded once (row-strided source, lda >= K).
  std::vector<float> a(static_cast<size_t>(p.M * p.K));
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) a[m * p.K + k] = act_bits_to_float(p.a[m * p.lda + k], p.act);

  for_each_decoded_column(p.qweight, p.scales, p.N, p.K, p.group_size, p.act,
                          [&](int64_t n, const float* w, const float* s) {
    for (int64_t m = 0; m < p.M; ++m) {
      const float* am = a.data() + m * p.K;
      float out = 0.0f;
      for (int64_t k0 = 0; k0 < p.K; k0 += slice_k) {
        const int64_t k1 = k0 + slice_k < p.K ? k0 + slice_k : p.K;
        float acc = 0.0f;
        for (int64_t ks = k0; ks < k1;) {  // the slice's part of group ks / gk
          const int64_t ke = (ks / gk + 1) * gk < k1 ? (ks / gk + 1) * gk : k1;
          float part = 0.0f;
          for (int64_t k = ks; k < ke; ++k) part += am[k] * w[k];
          acc += part * s[ks / gk];
          ks = ke;
        }
        out += acc;
      }
      c_out[m * p.ldc + n] = out;
    }
  });
}

}  // namespace marlin_fp8
}  // namespace mla_ext
