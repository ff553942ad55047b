// Host emulator of the vectorised CUDA cache kernels, for tests on machines
// without a GPU (tests/cache/test_cache_paged_gather.py builds it with g++,
// -I csrc, into a small shared library under pytest's tmp dir and calls it
// through ctypes). It lives under tests/, outside the product tree, and is
// never part of the extension (setup.py and CMake compile csrc/ only).
//
// It runs exactly the code the kernels run (csrc/cache/paged_gather.h,
// csrc/cache/write_lanes.h, csrc/cache/vec.h) with each CUDA thread executed
// in turn and the kernels' two phases (mapping / streaming, and the writer's
// load / tile-amax exchange / store) separated as __syncthreads and the warp
// shuffles separate them; only the few device instructions behind
// `__CUDA_ARCH__` (sm_89+ fp8 conversion, cvt packs, byte_perm, 16-bit
// multiplies) are replaced by their portable equivalents, which vec.h defines
// with the same results. The tests compare its output with the CPU kernel's,
// bit for bit.
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache/cache_kernels.h"
#include "cache/paged_gather.h"
#include "cache/write_lanes.h"

namespace {

using mla_ext::cache::GatherKind;
using mla_ext::cache::GatherParams;
using mla_ext::cache::ElemType;
namespace paged = mla_ext::cache::paged;

template <class T>
const char* type_name() {
  return __PRETTY_FUNCTION__;
}

// The input-row fields WriteParams and KvScaleParams share.
template <class P>
void set_inputs(P& p, const uint8_t* kv_c, int64_t kv_c_row_stride, const uint8_t* k_pe, int64_t k_pe_row_stride,
                int32_t in_type, int32_t num_tokens, int64_t L, int64_t R) {
  p.kv_c = kv_c;
  p.kv_c_row_stride = kv_c_row_stride;
  p.k_pe = k_pe;
  p.k_pe_row_stride = k_pe_row_stride;
  p.in_type = static_cast<ElemType>(in_type);
  p.num_tokens = num_tokens;
  p.L = L;
  p.R = R;
}

void copy_name(const char* s, char* out, int cap) {
  if (!out || cap <= 0) return;
  std::strncpy(out, s, static_cast<size_t>(cap) - 1);
  out[cap - 1] = '\0';
}

}  // namespace

extern "C" {

// Emulates gather_cuda (one launch). `rounds` as MLA_EXT_PAGED_GATHER_ROUNDS
// (0: the default). Writes the chosen decoder's name to `op_name` and the
// window height to *rows_per_cta. Returns 0.
int mla_emulate_paged_gather(const uint8_t* cache, int64_t block_stride, int64_t entry_stride, int32_t num_blocks,
                             int32_t block_size, int64_t row_bytes, uint8_t* dst, int64_t dst_row_stride,
                             int32_t dst_rows, int64_t width, int32_t dst_type, int32_t kind,
                             const int32_t* block_table, int64_t bt_row_stride, int32_t bt_width,
                             const int32_t* cu_seq_lens, const int32_t* seq_starts, int32_t num_reqs,
                             const float* k_scale, int32_t rounds, char* op_name, int32_t op_name_cap,
                             int32_t* rows_per_cta) {
  GatherParams p{};
  p.cache = cache;
  p.block_stride = block_stride;
  p.entry_stride = entry_stride;
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.row_bytes = row_bytes;
  p.dst = dst;
  p.dst_row_stride = dst_row_stride;
  p.dst_rows = dst_rows;
  p.width = width;
  p.dst_type = static_cast<ElemType>(dst_type);
  p.kind = static_cast<GatherKind>(kind);
  p.block_table = block_table;
  p.bt_row_stride = bt_row_stride;
  p.bt_width = bt_width;
  p.cu_seq_lens = cu_seq_lens;
  p.seq_starts = seq_starts;
  p.num_reqs = num_reqs;
  p.k_scale = k_scale;
  if (p.num_reqs <= 0 || p.dst_rows <= 0) return 0;
  const int r = rounds >= 1 && rounds <= 8 ? rounds : paged::kDefaultRounds;
  paged::with_paged_op(p, [&]<class Op, class I>() {
    copy_name(type_name<Op>(), op_name, op_name_cap);
    const int32_t rows = paged::paged_rows_per_cta(Op::units_of(p), p.dst_rows, r);
    if (rows_per_cta) *rows_per_cta = rows;
    const int64_t grid = (static_cast<int64_t>(p.dst_rows) + rows - 1) / rows;
    std::vector<int64_t> src_off(paged::kMaxRows);
    for (int64_t block = 0; block < grid; ++block) {
      const paged::Rows w = paged::window_rows(p, block, rows);
      if (w.n == 0) continue;
      bool walk = true;  // __syncthreads_and over the threads' shares
      for (int tid = 0; tid < paged::kThreads; ++tid) walk = paged::cu_monotone_part(p, tid) && walk;
      for (int tid = 0; tid < paged::kThreads; ++tid) paged::map_rows(p, w, src_off.data(), tid, walk);
      // __syncthreads()
      for (int tid = 0; tid < paged::kThreads; ++tid) {
        const Op op(p);
        paged::stream_rows<Op, I>(op, p, src_off.data(), w, tid);
      }
    }
  });
  return 0;
}

}  // extern "C"

extern "C" {

// Emulates write_vec_kernel (concat_and_cache_mla). Returns 0.
int mla_emulate_write(const uint8_t* kv_c, int64_t kv_c_row_stride, const uint8_t* k_pe, int64_t k_pe_row_stride,
                      int32_t in_type, int32_t num_tokens, int64_t L, int64_t R, uint8_t* cache,
                      int64_t block_stride, int64_t entry_stride, int32_t num_blocks, int32_t block_size,
                      const void* slots, int32_t slots_i32, int32_t format, const float* k_scale) {
  namespace wl = mla_ext::cache::wl;
  using mla_ext::QuantMode;
  mla_ext::cache::WriteParams p{};
  set_inputs(p, kv_c, kv_c_row_stride, k_pe, k_pe_row_stride, in_type, num_tokens, L, R);
  p.cache = cache;
  p.block_stride = block_stride;
  p.entry_stride = entry_stride;
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.slots = slots;
  p.slots_i32 = slots_i32 != 0;
  p.format = static_cast<mla_ext::CacheFormat>(format);
  p.k_scale = k_scale;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    uint8_t* dst = mla_ext::cache::write_dest_row(p, t);
    if (!dst) continue;
    switch (mla_ext::quant_mode(p.format)) {
      case QuantMode::kNone:
        for (int lane = 0; lane < wl::kLanes; ++lane) wl::copy_lane(p, t, dst, lane);
        break;
      case QuantMode::kFp8PerTensor: {
        const float scale = mla_ext::cache::checked_k_scale(*p.k_scale);
        for (int lane = 0; lane < wl::kLanes; ++lane) wl::per_tensor_lane(p, t, dst, lane, scale);
        break;
      }
      case QuantMode::kFp8PerTile: {
        float x[wl::kLanes][wl::kDsPerLane];
        float amax[wl::kLanes];
        for (int lane = 0; lane < wl::kLanes; ++lane) amax[lane] = wl::ds_load(p, t, lane, x[lane]);
        // The kernel's xor-shuffle reduction over lanes 8k..8k+7: their max.
        float tile[wl::kLanes / 8];
        for (int k = 0; k < wl::kLanes / 8; ++k) {
          tile[k] = 0.0f;
          for (int j = 0; j < 8; ++j) tile[k] = amax[8 * k + j] > tile[k] ? amax[8 * k + j] : tile[k];
        }
        for (int lane = 0; lane < wl::kLanes; ++lane) wl::ds_store(p, t, dst, lane, x[lane], tile[lane / 8]);
        break;
      }
      case QuantMode::kNvfp4PerBlock:
        for (int lane = 0; lane < wl::kLanes; ++lane) wl::nvfp4_lane(p, t, dst, lane);
        break;
    }
  }
  return 0;
}

// Emulates compute_kv_scale (amax_rows_kernel, then
// finalize_scale_kernel); returns the scale.
float mla_emulate_kv_scale(const uint8_t* kv_c, int64_t kv_c_row_stride, const uint8_t* k_pe, int64_t k_pe_row_stride,
                           int32_t in_type, int32_t num_tokens, int64_t L, int64_t R, float fp8_max) {
  namespace wl = mla_ext::cache::wl;
  mla_ext::cache::KvScaleParams p{};
  set_inputs(p, kv_c, kv_c_row_stride, k_pe, k_pe_row_stride, in_type, num_tokens, L, R);
  p.fp8_max = fp8_max;
  float amax = 0.0f;
  const int64_t items = wl::amax_items(p);
  for (int64_t it = 0; it < items; ++it) {
    for (int lane = 0; lane < wl::kLanes; ++lane) {
      const float a = wl::amax_lane(p, it, lane);
      amax = a > amax ? a : amax;
    }
  }
  const float s = amax / fp8_max;
  return s > mla_ext::cache::kMinKvScale ? s : mla_ext::cache::kMinKvScale;
}

// pow2_reciprocal + the scaled division of write_lanes.h on n values, for the
// proof test: out[i] = scaled(x[i], s) and ok = whether the multiply was used.
int mla_scaled_division(const float* x, float s, float* out, int64_t n) {
  namespace wl = mla_ext::cache::wl;
  float inv = 0.0f;
  const bool ok = wl::pow2_reciprocal(s, &inv);
  for (int64_t i = 0; i < n; ++i) out[i] = wl::scaled(x[i], s, ok, inv);
  return ok ? 1 : 0;
}

}  // extern "C"
