// CUDA kernels of the DSA indexer key cache ops: one thread per unit of work, each running the
// per-unit helper of index_cache_kernels.h that the CPU launcher also runs (same bytes).
// Writer: a unit is one token's fp8 scale group (amax, scale, Q e4m3 bytes) or one element.
// Gather: a unit is one element (or raw byte) of a dst row; the row's request is found by a
// binary search over cu_seq_lens, so no host-side maximum length (no sync) is needed.
// Simple and correct first; not tuned (the Triton kernels are the tuned GPU path).
#include <cuda_runtime.h>

#include "sparse/index_cache_kernels.h"

namespace mla_ext {
namespace indexer_cache {
namespace {

constexpr int kThreads = 256;

// register budget: 48
__global__ void index_write_kernel(const WriteParams p, int64_t total) {
  const int units = write_units(p);
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads)
    write_unit(p, static_cast<int32_t>(i / units), static_cast<int>(i % units));
}

// register budget: 48
__global__ void index_gather_kernel(const GatherParams p, int64_t total) {
  const int width = gather_width(p);
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const int32_t row = static_cast<int32_t>(i / width);
    const int32_t r = request_of(p, row);
    if (r < 0) continue;
    int32_t off = 0;
    const int64_t page = gather_page(p, r, row, &off);
    gather_store(p, row, static_cast<int>(i % width), page, off);
  }
}

int grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

}  // namespace

int write_cuda(const WriteParams& p, void* stream) {
  const int64_t total = static_cast<int64_t>(p.num_tokens) * write_units(p);
  if (total == 0) return 0;
  index_write_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, total);
  return static_cast<int>(cudaGetLastError());
}

int gather_cuda(const GatherParams& p, void* stream) {
  const int64_t total = static_cast<int64_t>(p.dst_rows) * gather_width(p);
  if (total == 0 || p.num_reqs == 0) return 0;
  index_gather_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, total);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace indexer_cache
}  // namespace mla_ext
