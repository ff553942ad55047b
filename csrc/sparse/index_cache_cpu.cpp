// CPU launchers of the DSA indexer key cache ops: loops over the shared per-unit helpers of
// index_cache_kernels.h (the CUDA kernels run the same helpers, one thread per unit).
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

void gather_cpu(const GatherParams& p) {
  const int width = gather_width(p);
#pragma omp parallel for schedule(static)
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    const int32_t end = p.cu_seq_lens[r + 1] < p.dst_rows ? p.cu_seq_lens[r + 1] : p.dst_rows;
    for (int32_t row = p.cu_seq_lens[r] < 0 ? 0 : p.cu_seq_lens[r]; row < end; ++row) {
      int32_t off = 0;
      const int64_t page = gather_page(p, r, row, &off);
      for (int e = 0; e < width; ++e) gather_store(p, row, e, page, off);
    }
  }
}

}  // namespace indexer_cache
}  // namespace mla_ext
