// CPU launchers of the DSA indexer key cache ops: the writer loops over the shared per-unit
// helper of index_cache_kernels.h (the CUDA kernel runs it one thread per unit); the gather
// runs the same primitives per row, rows spread over OpenMP threads.
#include <cstring>

#include "sparse/index_cache_kernels.h"

namespace mla_ext {
namespace indexer_cache {

void write_cpu(const WriteParams& p) {
  const int units = write_units(p);
  // Tokens write disjoint slots unless slot_mapping repeats one; then the last token wins,
  // as the torch writer's indexed assignment on the CPU.
  for (int32_t t = 0; t < p.num_tokens; ++t)
    for (int u = 0; u < units; ++u) write_unit(p, t, u);
}

// One dst row: the per-element helpers of the CUDA kernel, hoisted per row (format branch and
// fp8 scale once per group); the same primitives, so the same bits.
void gather_row(const GatherParams& p, int32_t row, int64_t page, int32_t off) {
  const int D = p.head_dim;
  if (p.dst_scale != nullptr) {  // raw e4m3 bytes and scale bytes (zeros for an out-of-range row)
    const int sb = gather_width(p) - D;
    uint8_t* dk = p.dst + row * p.dst_row_stride;
    uint8_t* ds = p.dst_scale + row * p.dst_scale_row_stride;
    if (page < 0) {
      std::memset(dk, 0, D);
      std::memset(ds, 0, sb);
    } else {
      std::memcpy(dk, p.cache + page + value_offset(off, D), D);
      std::memcpy(ds, p.cache + page + scale_offset(off, p.block_size, D, p.quant_block_size), sb);
    }
    return;
  }
  float* out = reinterpret_cast<float*>(p.dst + row * p.dst_row_stride);
  if (page < 0) {
    for (int e = 0; e < D; ++e) out[e] = 0.0f;
    return;
  }
  const uint8_t* base = p.cache + page;
  if (p.format == IndexFormat::kFp8) {
    const int Q = p.quant_block_size;
    const uint8_t* vals = base + value_offset(off, D);
    for (int g = 0; g < D / Q; ++g) {
      const float s = page_scale(p, base, off, g);
      for (int i = g * Q; i < (g + 1) * Q; ++i) out[i] = fp8::decode_e4m3(vals[i]) * s;
    }
  } else if (p.format == IndexFormat::kFp32) {
    std::memcpy(out, base + off * p.entry_stride, 4 * static_cast<size_t>(D));
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(base + off * p.entry_stride);
    for (int e = 0; e < D; ++e) out[e] = fp8::bf16_bits_to_f32(src[e]);
  }
}

void gather_cpu(const GatherParams& p) {
#pragma omp parallel for schedule(static)
  for (int32_t row = 0; row < p.dst_rows; ++row) {
    const int32_t r = request_of(p, row);
    if (r < 0) continue;
    int32_t off = 0;
    const int64_t page = gather_page(p, r, row, &off);
    gather_row(p, row, page, off);
  }
}

}  // namespace indexer_cache
}  // namespace mla_ext
