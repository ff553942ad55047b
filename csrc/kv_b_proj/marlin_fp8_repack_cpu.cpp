// CPU repack (fp8 [N, K] -> packed words + permuted scales) and the CPU
// dequantize that reads the packed layout back. Layout: marlin_fp8.h.
#include "kv_b_proj/marlin_fp8.h"

namespace mla_ext {
namespace marlin_fp8 {

void marlin_fp8_repack_cpu(const RepackParams& p) {
  const int64_t n_pad = padded_n(p.N), n_tiles = n_pad / kTileN, k_tiles = p.K / kTileK;
#pragma omp parallel for
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    for (int64_t nt = 0; nt < n_tiles; ++nt) {
      uint32_t* tile = p.qweight + tile_word(kt, nt, n_tiles);
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < kWordsPerLane; ++j) {
          tile[lane * kWordsPerLane + j] = pack_word(p.w, p.ldw, p.N, kt, nt, lane, j);
        }
      }
    }
  }
  for (int64_t g = 0; g < p.G; ++g) {
    for (int64_t pos = 0; pos < n_pad; ++pos) {
      const int64_t n = pos / kTileN * kTileN + scale_col(static_cast<int>(pos % kTileN), p.grouped);
      p.scales_out[g * n_pad + pos] = n < p.N ? p.scales[g * p.N + n] : uint16_t{0};
    }
  }
}

void marlin_fp8_dequantize_cpu(const DequantParams& p) {
  const int64_t gk = p.group_size > 0 ? p.group_size : p.K;
  for_each_decoded_column(p.qweight, p.scales, p.N, p.K, p.group_size, p.act,
                          [&](int64_t n, const float* w, const float* s) {
                            for (int64_t k = 0; k < p.K; ++k) p.out[n * p.K + k] = w[k] * s[k / gk];
                          });
}

}  // namespace marlin_fp8
}  // namespace mla_ext
