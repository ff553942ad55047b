// The page-granular CUDA gather (backend "cuda_paged") of
// gather_and_maybe_dequant_cache and cp_gather_cache. The
// algorithm, the row decoders and their load/store widths are in
// csrc/cache/paged_gather.h (shared with the host emulator the tests run);
// this file holds the kernel and its launch.
//
// Load/store widths per format (vector paths; rows whose cache or dst
// alignment does not allow them take the N-byte or one-value fallbacks):
//   raw copy (native bf16/fp16/fp32, fp8 passthrough, cp_gather):  16 B / 16 B
//   fp8 e4m3/e5m2 per tensor -> bf16/fp16 (fp32):  16 B / 2 x 16 B (4 x 16 B)
//   fp8_ds_mla -> bf16/fp16 (fp32): latent 16 B + the 4-byte tile scale /
//       2 x 16 B (4 x 16 B); k_pe 16 B / 16 B (2 x 16 B)
//   nvfp4_ds_mla -> bf16/fp16 (fp32): latent 16 B + two scale bytes /
//       4 x 16 B (8 x 16 B); k_pe 16 B / 2 x 16 B (4 x 16 B)
// fp8 -> fp32: cvt.rn.f16x2.e4m3x2 on sm_89+ (one instruction per two
// values), exact integer moves on sm_86 (csrc/cache/vec.h); no shared-memory
// table.
#include <cuda_runtime.h>

#include <cstdlib>

#include "cache/cache_kernels.h"
#include "cache/paged_gather.h"

namespace mla_ext {
namespace cache {
namespace {

// One CTA per window of `rows_per_cta` dst rows (paged_gather.h): the rows'
// cache offsets are resolved into shared memory, once per page (thread 0
// walks the window; per row in parallel when cu_seq_lens decreases somewhere
// or has more than kMaxWalkReqs requests), then streamed.
// ptxas (CUDA 13.0), 49 instantiations x {sm_86, sm_90a}: 30-40 registers for
// the copies and the one-value fallbacks, 48 for RawOp<16>, 56-64 for the
// 16-byte dequant decoders (they take what the bound allows: capped at 48 they
// also compile without spills), no spills anywhere. The bound (4 CTAs of 256
// threads per SM) allows 64.
template <class Op, class I>
// register budget: 64
__global__ void __launch_bounds__(paged::kThreads, 4) paged_gather_kernel(const GatherParams p, int32_t rows_per_cta) {
  __shared__ int64_t src_off[paged::kMaxRows];
  const paged::Rows rows = paged::window_rows(p, blockIdx.x, rows_per_cta);
  if (rows.n == 0) return;  // uniform across the CTA
  const int tid = static_cast<int>(threadIdx.x);
  const bool walk = __syncthreads_and(paged::cu_monotone_part(p, tid)) != 0;
  paged::map_rows(p, rows, src_off, tid, walk);
  __syncthreads();
  const Op op(p);
  paged::stream_rows<Op, I>(op, p, src_off, rows, tid);
}

// Unit batches per thread and window: MLA_EXT_PAGED_GATHER_ROUNDS (1..8,
// default paged::kDefaultRounds), read once; a tuning knob for GPU runs.
int paged_rounds() {
  static const int rounds = [] {
    const char* env = std::getenv("MLA_EXT_PAGED_GATHER_ROUNDS");
    const int v = env ? std::atoi(env) : 0;
    return v >= 1 && v <= 8 ? v : paged::kDefaultRounds;
  }();
  return rounds;
}

}  // namespace

int gather_cuda(const GatherParams& p, void* stream) {
  if (p.num_reqs <= 0 || p.dst_rows <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int err = 0;
  paged::with_paged_op(p, [&]<class Op, class I>() {
    const int64_t units = Op::units_of(p);
    const int32_t rows = paged::paged_rows_per_cta(units, p.dst_rows, paged_rounds());
    const unsigned grid = static_cast<unsigned>((static_cast<int64_t>(p.dst_rows) + rows - 1) / rows);
    paged_gather_kernel<Op, I><<<grid, paged::kThreads, 0, s>>>(p, rows);
    err = static_cast<int>(cudaGetLastError());
  });
  return err;
}

}  // namespace cache
}  // namespace mla_ext
