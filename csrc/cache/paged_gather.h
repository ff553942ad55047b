// The page-granular gather (backend "cuda_paged"): its row mapping, its
// per-format row decoders and the per-thread streaming loop, shared by the
// CUDA kernel (csrc/cache/gather_paged.cu) and the host emulator
// (tests/cache/emulator/paged_gather_emulator.cpp, built by the tests), so that the
// whole kernel logic except a handful of device instructions (csrc/cache/vec.h)
// is checked bit-exactly against the CPU kernel on machines without a GPU.
//
// Work split. A CTA of kThreads threads owns a window of `rows` consecutive
// dst rows (rows * units-per-row ~ kUnroll * kThreads * rounds, see
// paged_rows_per_cta); the grid is ceil(dst.size(0) / rows) CTAs, from shapes
// only (no host sync, CUDA-graph capturable); windows past
// cu_seq_lens[num_reqs] return after two loads.
//
//  1. Mapping, once per CTA, resolved once per page: the threads first check
//     together that cu_seq_lens is non-decreasing (cu_monotone_part, a
//     __syncthreads_and; num_reqs <= kMaxWalkReqs). If so, the first warp
//     walks the window, each lane a contiguous segment of ceil(rows / 32)
//     rows (walk_segment): one binary search over cu_seq_lens for the
//     segment's first row, then row by row it moves to the next request when a
//     row reaches cu[r + 1] (loading seq_starts[r] and dividing once per
//     request) and advances the slot by one, loading a block-table entry only
//     when a row enters a new request or page, and writes each row's cache
//     byte offset into shared memory. (One thread walking the whole window
//     chained up to a few hundred rows of dependent loads while the other 255
//     waited; 32 lanes cut that latency to one search plus <= 8 rows.) Otherwise (a decreasing cu_seq_lens, whose
//     binary search a walk would not reproduce, or very many requests) thread
//     i < rows resolves row t0 + i by itself (source_offset: a search, a
//     32-bit division, one block-table load). Either way the result is the
//     CPU kernel's gather_source_row, bit for bit (-1 = a zero row: a block id
//     out of range, a logical block past the table, a token before 0).
//  2. Streaming: the window is rows x U units (a unit = 16 source bytes on
//     the vector paths); thread k takes units k, k + kThreads, ... in batches
//     of kUnroll: all kUnroll loads of a batch are issued before the first
//     store. Consecutive threads take consecutive units of a row, so a warp
//     reads and writes contiguous bytes of a page.
//
// Row decoders (Op): units per row, load(unit), store(unit), zero(unit).
//   RawOp<N>            N-byte units (N = 16, 8, 4, 2, 1: the largest that
//                       divides the row size, the cache strides and dst).
//   PerTensorOp<Out, E5M2, N>   N fp8 bytes -> N values x k_scale (N = 16, 4, 1).
//   DsMlaOp<Out>        fp8_ds_mla: units 0..31 = 16 e4m3 values of tile
//                       unit / 8 (+ the tile's fp32 scale, a 4-byte load),
//                       units 32..39 = 8 bf16 k_pe values (absent for width 512).
//   Nvfp4Op<Out>        nvfp4_ds_mla: units 0..15 = 32 e2m1 values (two
//                       16-value blocks, + their two permuted scale bytes),
//                       units 16..19 = 16 e4m3 k_pe values.
//   DsMlaScalarOp / Nvfp4ScalarOp   one value per unit, any alignment.
//
// Rounding: every value is the CPU kernel's Out::from(decode(byte) * scale)
// (fp32 product, then round to nearest even), nvfp4 products are exact.
// Torch-free.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cache/cache_kernels.h"
#include "cache/nvfp4_ds_mla.h"
#include "cache/vec.h"
#include "common/cache_layout.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {
namespace paged {

constexpr int kThreads = 256;
constexpr int kMaxRows = kThreads;  // one mapping thread per window row
constexpr int kUnroll = 4;          // loads in flight per thread before its first store
constexpr int kDefaultRounds = 2;   // unit batches per thread and window (tunable, see gather_paged.cu)

// ---------------------------------------------------------------------------
// mapping

struct Rows {
  int64_t t0;  // first dst row of the window that some request owns
  int32_t n;   // rows [t0, t0 + n); 0: nothing to do
};

// dst rows of window `block` (rows per window `per_cta`) that requests own:
// [block * per_cta, (block + 1) * per_cta) clipped to [max(cu[0], 0), min(cu[R], dst_rows)).
MLA_HOST_DEVICE inline Rows window_rows(const GatherParams& p, int64_t block, int32_t per_cta) {
  const int64_t lo = p.cu_seq_lens[0] > 0 ? p.cu_seq_lens[0] : 0;
  const int64_t end = p.cu_seq_lens[p.num_reqs];
  const int64_t hi = end < p.dst_rows ? end : p.dst_rows;
  const int64_t a0 = block * per_cta, b0 = a0 + per_cta;
  const int64_t a = a0 > lo ? a0 : lo, b = b0 < hi ? b0 : hi;
  return Rows{a, b > a ? static_cast<int32_t>(b - a) : 0};
}

// (logical block, slot) of context position tok >= 0: a 32-bit division
// whenever tok fits (always, in practice).
MLA_HOST_DEVICE inline void split_token(const GatherParams& p, int64_t tok, int64_t& lb, int64_t& slot) {
  if (tok <= 0x7FFFFFFF) {
    const uint32_t u = static_cast<uint32_t>(tok), b = static_cast<uint32_t>(p.block_size);
    const uint32_t q = u / b;
    lb = q;
    slot = u - q * b;
  } else {
    lb = tok / p.block_size;
    slot = tok - lb * p.block_size;
  }
}

// Byte offset (from p.cache) of the first entry of logical block lb of
// request r, or -1 when lb is past the table or its block id is out of range.
MLA_HOST_DEVICE inline int64_t page_offset(const GatherParams& p, int r, int64_t lb) {
  if (lb >= p.bt_width) return -1;
  const int32_t pb = p.block_table[static_cast<int64_t>(r) * p.bt_row_stride + lb];
  if (pb < 0 || pb >= p.num_blocks) return -1;
  return static_cast<int64_t>(pb) * p.block_stride;
}

// Byte offset (from p.cache) of the cache row feeding dst row t, or -1 when
// the row is written as zeros; the same row as gather_source_row. The
// per-row mapping (one binary search per row), used when the walk below is
// not allowed.
MLA_HOST_DEVICE inline int64_t source_offset(const GatherParams& p, int64_t t) {
  const int r = find_request(p.cu_seq_lens, p.num_reqs, t);
  const int64_t tok = (p.seq_starts ? static_cast<int64_t>(p.seq_starts[r]) : 0) + (t - p.cu_seq_lens[r]);
  if (tok < 0) return -1;
  int64_t lb, slot;
  split_token(p, tok, lb, slot);
  const int64_t base = page_offset(p, r, lb);
  return base < 0 ? -1 : base + slot * p.entry_stride;
}

// Requests up to which a window checks that cu_seq_lens is non-decreasing
// (ceil(kMaxWalkReqs / kThreads) loads per thread); above it every window
// takes the per-row mapping.
constexpr int kMaxWalkReqs = 8 * kThreads;

// Thread tid's share of the check that cu_seq_lens[0..num_reqs] is
// non-decreasing (pairs tid, tid + kThreads, ...); the window may walk when
// every thread answers true (__syncthreads_and). Only then is find_request the
// largest r with cu[r] <= t, so that a walk reproduces it row by row.
MLA_HOST_DEVICE inline bool cu_monotone_part(const GatherParams& p, int tid) {
  if (p.num_reqs > kMaxWalkReqs) return false;
  bool ok = true;
  for (int i = tid; i < p.num_reqs; i += kThreads) ok = ok && p.cu_seq_lens[i] <= p.cu_seq_lens[i + 1];
  return ok;
}

// The mapping of window rows [i0, i1) by one thread, for a non-decreasing
// cu_seq_lens: one binary search for row i0's request, then a walk over the
// rows that advances the request when a row reaches cu[r + 1] and the slot by
// one per row, with a block-table load (and a division) only when a row
// enters a new request or a new page. src_off[i] = source_offset(p, rows.t0 +
// i) for every i in [i0, i1): a segment's walk starts from scratch, so
// segments can be walked in parallel.
MLA_HOST_DEVICE inline void walk_segment(const GatherParams& p, Rows rows, int32_t i0, int32_t i1,
                                         int64_t* src_off) {
  const int32_t* cu = p.cu_seq_lens;
  int r = find_request(cu, p.num_reqs, rows.t0 + i0);
  int64_t next = r + 1 < p.num_reqs ? cu[r + 1] : INT64_MAX;  // first row of the next request
  bool enter = true;  // recompute the page from the token (new request, or tok was < 0)
  int64_t base = -1, lb = 0, slot = 0, tok_base = 0;  // tok = tok_base + t
  for (int32_t i = i0; i < i1; ++i) {
    const int64_t t = rows.t0 + i;
    if (t >= next) {
      do {
        ++r;
        next = r + 1 < p.num_reqs ? cu[r + 1] : INT64_MAX;
      } while (t >= next);
      enter = true;
    }
    if (enter) {
      tok_base = (p.seq_starts ? static_cast<int64_t>(p.seq_starts[r]) : 0) - cu[r];
      const int64_t tok = tok_base + t;
      if (tok < 0) {
        src_off[i] = -1;  // stays `enter`: the page is found once tok reaches 0
        continue;
      }
      split_token(p, tok, lb, slot);
      base = page_offset(p, r, lb);
      enter = false;
    } else if (++slot == p.block_size) {  // the next page of the same request
      slot = 0;
      base = page_offset(p, r, ++lb);
    }
    src_off[i] = base < 0 ? -1 : base + slot * p.entry_stride;
  }
}

constexpr int kWalkLanes = 32;  // one warp maps a window

// The mapping stage of window `rows` for thread tid (the kernel's first
// phase; a __syncthreads follows): when `walk` (cu_seq_lens non-decreasing)
// lane tid < 32 of the first warp walks its segment of ceil(rows.n / 32)
// rows, else thread i < rows.n searches row t0 + i.
MLA_HOST_DEVICE inline void map_rows(const GatherParams& p, Rows rows, int64_t* src_off, int tid, bool walk) {
  if (walk) {
    const int32_t seg = (rows.n + kWalkLanes - 1) / kWalkLanes;
    const int32_t i0 = tid * seg;
    const int32_t i1 = i0 + seg < rows.n ? i0 + seg : rows.n;
    if (tid < kWalkLanes && i0 < i1) walk_segment(p, rows, i0, i1, src_off);
  } else if (tid < rows.n) {
    src_off[tid] = source_offset(p, rows.t0 + tid);
  }
}

// ---------------------------------------------------------------------------
// row decoders

// NW words of fp8 bytes -> 4 NW values x scale, stored as Out at o (8 values
// per store group: 16-byte stores for bf16/fp16, two for fp32).
template <class Out, bool E5M2, int NW>
MLA_HOST_DEVICE inline void fp8_words_to_out(const uint32_t* words, float scale, uint8_t* o) {
  constexpr int G = NW >= 2 ? 2 : 1;  // words per group
#pragma unroll
  for (int g = 0; g < NW / G; ++g) {
    float f[4 * G];
#pragma unroll
    for (int i = 0; i < G; ++i) vec::fp8x4_to_f32<E5M2>(words[G * g + i], f + 4 * i);
#pragma unroll
    for (int j = 0; j < 4 * G; ++j) f[j] = vec::mul_rn(f[j], scale);
    uint32_t w[4 * G];
    vec::pack_values<Out, 4 * G>(f, w);
    vec::store_words<4 * G * Out::kBytes>(o + 4 * G * Out::kBytes * g, w);
  }
}

template <int N>
struct RawOp {
  using Vec = typename vec::Bytes<N>::T;
  int64_t units_;
  MLA_HOST_DEVICE static int64_t units_of(const GatherParams& p) { return p.row_bytes / N; }
  MLA_HOST_DEVICE explicit RawOp(const GatherParams& p) : units_(units_of(p)) {}
  MLA_HOST_DEVICE int64_t units() const { return units_; }
  MLA_HOST_DEVICE Vec load(const uint8_t* src, int64_t c) const { return vec::load<N>(src + c * N); }
  MLA_HOST_DEVICE void store(uint8_t* d, int64_t c, const Vec& v) const { vec::store<N>(d + c * N, v); }
  MLA_HOST_DEVICE void zero(uint8_t* d, int64_t c) const { vec::store<N>(d + c * N, vec::zeros<N>()); }
};

// Per-tensor fp8: N bytes per unit (16 or 4: whole words; 1: one byte).
template <class Out, bool E5M2, int N>
struct PerTensorOp {
  using Vec = typename vec::Bytes<N>::T;
  static constexpr int kOutBytes = N * Out::kBytes;
  int64_t units_;
  float scale_;
  MLA_HOST_DEVICE static int64_t units_of(const GatherParams& p) { return p.width / N; }
  // Reads k_scale: device code only (the host launcher calls units_of).
  MLA_HOST_DEVICE explicit PerTensorOp(const GatherParams& p)
      : units_(units_of(p)), scale_(checked_k_scale(*p.k_scale)) {}  // NaN rows for an invalid scale
  MLA_HOST_DEVICE int64_t units() const { return units_; }
  MLA_HOST_DEVICE Vec load(const uint8_t* src, int64_t c) const { return vec::load<N>(src + c * N); }
  MLA_HOST_DEVICE void store(uint8_t* d, int64_t c, const Vec& q) const {
    uint8_t* o = d + c * kOutBytes;
    if constexpr (N == 1) {
      vec::store_value<Out>(o, vec::mul_rn(vec::fp8_to_f32<E5M2>(q), scale_));
    } else {
      if constexpr (N == 16) {
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
        fp8_words_to_out<Out, E5M2, 4>(words, scale_, o);
      } else {
        const uint32_t words[1] = {q};
        fp8_words_to_out<Out, E5M2, 1>(words, scale_, o);
      }
    }
  }
  MLA_HOST_DEVICE void zero(uint8_t* d, int64_t c) const {
    if constexpr (kOutBytes >= 16) {
      vec::store_zero_bytes<kOutBytes>(d + c * kOutBytes);
    } else {
      vec::store<kOutBytes>(d + c * kOutBytes, vec::zeros<kOutBytes>());
    }
  }
};

// fp8_ds_mla, 16-byte aligned rows (src and dst).
template <class Out>
struct DsMlaOp {
  struct Vec {
    vec::U32x4 q;
    float s;
  };
  static constexpr int kLatentUnits = ds_mla::kLatentDim / 16;  // 32
  static constexpr int kUnitsPerTile = ds_mla::kTileSize / 16;  // 8
  int32_t units_;
  MLA_HOST_DEVICE static int64_t units_of(const GatherParams& p) {
    return kLatentUnits + (p.width - ds_mla::kLatentDim) / 8;  // 40 or 32 (width 576 or 512)
  }
  MLA_HOST_DEVICE explicit DsMlaOp(const GatherParams& p) : units_(static_cast<int32_t>(units_of(p))) {}
  MLA_HOST_DEVICE int64_t units() const { return units_; }
  MLA_HOST_DEVICE Vec load(const uint8_t* src, int64_t c) const {
    Vec v;
    if (c < kLatentUnits) {
      v.q = vec::load<16>(src + ds_mla::kLatentOffset + 16 * c);
      v.s = fp8::bits_f32(vec::load<4>(src + ds_mla::kScaleOffset + 4 * (c / kUnitsPerTile)));
    } else {
      v.q = vec::load<16>(src + ds_mla::kRopeOffset + 16 * (c - kLatentUnits));
      v.s = 0.0f;
    }
    return v;
  }
  MLA_HOST_DEVICE void store(uint8_t* d, int64_t c, const Vec& v) const {
    const uint32_t words[4] = {v.q.x, v.q.y, v.q.z, v.q.w};
    if (c < kLatentUnits) {
      fp8_words_to_out<Out, false, 4>(words, v.s, d + 16 * Out::kBytes * c);
    } else {
      uint8_t* o = d + Out::kBytes * (ds_mla::kLatentDim + 8 * (c - kLatentUnits));
      if constexpr (std::is_same_v<Out, vec::OutBF16>) {
        vec::store<16>(o, v.q);  // bf16 k_pe into bf16: the bits themselves
      } else {
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) vec::widen2<false>(words[i], f + 2 * i);
        uint32_t w[8];
        vec::pack_values<Out, 8>(f, w);
        vec::store_words<8 * Out::kBytes>(o, w);
      }
    }
  }
  MLA_HOST_DEVICE void zero(uint8_t* d, int64_t c) const {
    if (c < kLatentUnits) {
      vec::store_zero_bytes<16 * Out::kBytes>(d + 16 * Out::kBytes * c);
    } else {
      vec::store_zero_bytes<8 * Out::kBytes>(d + Out::kBytes * (ds_mla::kLatentDim + 8 * (c - kLatentUnits)));
    }
  }
};

// fp8_ds_mla, any alignment: one value per unit.
template <class Out>
struct DsMlaScalarOp {
  struct Vec {
    uint32_t a, b;  // latent: the byte and the scale bits; rope: the bf16 bits
  };
  int64_t units_;
  MLA_HOST_DEVICE static int64_t units_of(const GatherParams& p) { return p.width; }
  MLA_HOST_DEVICE explicit DsMlaScalarOp(const GatherParams& p) : units_(units_of(p)) {}
  MLA_HOST_DEVICE int64_t units() const { return units_; }
  MLA_HOST_DEVICE Vec load(const uint8_t* src, int64_t c) const {
    if (c < ds_mla::kLatentDim) {
      const uint8_t* sc = src + ds_mla::kScaleOffset + 4 * (c / ds_mla::kTileSize);
      const uint32_t bits = vec::load<1>(sc) | (vec::load<1>(sc + 1) << 8) | (vec::load<1>(sc + 2) << 16) |
                            (static_cast<uint32_t>(vec::load<1>(sc + 3)) << 24);
      return Vec{vec::load<1>(src + ds_mla::kLatentOffset + c), bits};
    }
    const uint8_t* pe = src + ds_mla::kRopeOffset + 2 * (c - ds_mla::kLatentDim);
    return Vec{static_cast<uint32_t>(vec::load<1>(pe) | (vec::load<1>(pe + 1) << 8)), 0u};
  }
  MLA_HOST_DEVICE void store(uint8_t* d, int64_t c, const Vec& v) const {
    const float x = c < ds_mla::kLatentDim ? vec::mul_rn(fp8::decode_e4m3(static_cast<uint8_t>(v.a)), fp8::bits_f32(v.b))
                                           : fp8::bf16_bits_to_f32(static_cast<uint16_t>(v.a));
    vec::store_value<Out>(d + Out::kBytes * c, x);
  }
  MLA_HOST_DEVICE void zero(uint8_t* d, int64_t c) const { vec::store_value<Out>(d + Out::kBytes * c, 0.0f); }
};

// nvfp4_ds_mla, 16-byte aligned rows (src and dst); dst width 576.
template <class Out>
struct Nvfp4Op {
  struct Vec {
    vec::U32x4 q;
    uint32_t sb;  // latent units: the scale bytes of blocks 2c (bits 0-7) and 2c + 1 (bits 8-15)
  };
  static constexpr int kLatentUnits = nvfp4_ds_mla::kLatentBytes / 16;  // 16
  static constexpr int kRopeUnits = nvfp4_ds_mla::kRopeDim / 16;        // 4
  // fp16 outputs multiply in fp16; bf16 and fp32 outputs in bf16 (exact either way).
  static constexpr bool kF16 = std::is_same_v<Out, vec::OutF16>;
  MLA_HOST_DEVICE static int64_t units_of(const GatherParams&) { return kLatentUnits + kRopeUnits; }
  MLA_HOST_DEVICE explicit Nvfp4Op(const GatherParams&) {}
  MLA_HOST_DEVICE int64_t units() const { return kLatentUnits + kRopeUnits; }
  MLA_HOST_DEVICE Vec load(const uint8_t* src, int64_t c) const {
    namespace nv = nvfp4_ds_mla;
    Vec v;
    if (c < kLatentUnits) {
      v.q = vec::load<16>(src + nv::kLatentOffset + 16 * c);
      const int b = 2 * static_cast<int>(c);
      v.sb = vec::load<1>(src + nv::kScaleOffset + nv::scale_byte(b)) |
             (static_cast<uint32_t>(vec::load<1>(src + nv::kScaleOffset + nv::scale_byte(b + 1))) << 8);
    } else {
      v.q = vec::load<16>(src + nv::kRopeOffset + 16 * (c - kLatentUnits));
      v.sb = 0;
    }
    return v;
  }
  MLA_HOST_DEVICE void store(uint8_t* d, int64_t c, const Vec& v) const {
    namespace nv = nvfp4_ds_mla;
    const uint32_t words[4] = {v.q.x, v.q.y, v.q.z, v.q.w};
    if (c < kLatentUnits) {
      uint8_t* o = d + 32 * Out::kBytes * c;  // 32 values per unit
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        const uint32_t s2 = vec::e4m3_scale2<kF16>((v.sb >> (8 * blk)) & 0xFFu);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // 8 values per word
          uint32_t p[4];
          vec::e2m1x8_mul<kF16>(words[2 * blk + h], s2, p);
          uint8_t* o8 = o + Out::kBytes * (16 * blk + 8 * h);
          if constexpr (Out::kBytes == 2) {
            vec::store<16>(o8, vec::U32x4{p[0], p[1], p[2], p[3]});
          } else {
            float f[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) vec::widen2<false>(p[i], f + 2 * i);
            uint32_t w[8];
            vec::pack_values<Out, 8>(f, w);
            vec::store_words<32>(o8, w);
          }
        }
      }
    } else {
      // The rope's e4m3 values themselves (x 1.0: exact).
      fp8_words_to_out<Out, false, 4>(words, 1.0f, d + Out::kBytes * (nv::kLatentDim + 16 * (c - kLatentUnits)));
    }
  }
  MLA_HOST_DEVICE void zero(uint8_t* d, int64_t c) const {
    if (c < kLatentUnits) {
      vec::store_zero_bytes<32 * Out::kBytes>(d + 32 * Out::kBytes * c);
    } else {
      vec::store_zero_bytes<16 * Out::kBytes>(
          d + Out::kBytes * (nvfp4_ds_mla::kLatentDim + 16 * (c - kLatentUnits)));
    }
  }
};

// nvfp4_ds_mla, any alignment: one value per unit (the CPU kernel's formula).
template <class Out>
struct Nvfp4ScalarOp {
  struct Vec {
    uint32_t a, b;  // latent: the code byte and the scale byte; rope: the e4m3 byte
  };
  MLA_HOST_DEVICE static int64_t units_of(const GatherParams&) {
    return nvfp4_ds_mla::kLatentDim + nvfp4_ds_mla::kRopeDim;
  }
  MLA_HOST_DEVICE explicit Nvfp4ScalarOp(const GatherParams&) {}
  MLA_HOST_DEVICE int64_t units() const { return nvfp4_ds_mla::kLatentDim + nvfp4_ds_mla::kRopeDim; }
  MLA_HOST_DEVICE Vec load(const uint8_t* src, int64_t c) const {
    namespace nv = nvfp4_ds_mla;
    if (c < nv::kLatentDim) {
      return Vec{vec::load<1>(src + nv::kLatentOffset + c / 2),
                 vec::load<1>(src + nv::kScaleOffset + nv::scale_byte(static_cast<int>(c / nv::kBlockSize)))};
    }
    return Vec{vec::load<1>(src + nv::kRopeOffset + (c - nv::kLatentDim)), 0u};
  }
  MLA_HOST_DEVICE void store(uint8_t* d, int64_t c, const Vec& v) const {
    namespace nv = nvfp4_ds_mla;
    const float x = c < nv::kLatentDim
                        ? nv::decode_e2m1((v.a >> (4 * (c & 1))) & 0xFu) * fp8::decode_e4m3(static_cast<uint8_t>(v.b))
                        : fp8::decode_e4m3(static_cast<uint8_t>(v.a));
    vec::store_value<Out>(d + Out::kBytes * c, x);
  }
  MLA_HOST_DEVICE void zero(uint8_t* d, int64_t c) const { vec::store_value<Out>(d + Out::kBytes * c, 0.0f); }
};

// ---------------------------------------------------------------------------
// streaming

// Thread `tid`'s share of the window: units tid, tid + kThreads, ... of the
// rows.n x op.units() units (row-major), kUnroll loads in flight before the
// first store. src_off[i] is the mapping of row rows.t0 + i. I: the unit
// index type, int32_t unless a row has more than kNarrowMaxUnits units
// (paged_unit_index picks it on the host).
template <class Op, class I>
MLA_HOST_DEVICE inline void stream_rows(const Op& op, const GatherParams& p, const int64_t* src_off, Rows rows,
                                        int tid) {
  const I U = static_cast<I>(op.units());
  const I N = static_cast<I>(rows.n) * U;
  // (row, col) of unit u, advanced by kThreads units per step without dividing again.
  const int32_t drow = static_cast<int32_t>(kThreads / U);
  const I dcol = kThreads - drow * U;
  int32_t row = static_cast<int32_t>(tid / U);
  I col = tid - row * U;
  for (I u0 = tid; u0 < N; u0 += kUnroll * kThreads) {
    const int32_t row0 = row;
    const I col0 = col;
    typename Op::Vec v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (u0 + k * kThreads < N) {
        const int64_t off = src_off[row];
        if (off >= 0) v[k] = op.load(p.cache + off, col);
      }
      col += dcol;
      row += drow;
      if (col >= U) col -= U, ++row;
    }
    row = row0;
    col = col0;
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (u0 + k * kThreads < N) {
        uint8_t* d = p.dst + (rows.t0 + row) * p.dst_row_stride;
        if (src_off[row] >= 0) {
          op.store(d, col, v[k]);
        } else {
          op.zero(d, col);
        }
      }
      col += dcol;
      row += drow;
      if (col >= U) col -= U, ++row;
    }
  }
}

// Rows of at most this many units (bytes or elements, an upper bound of the
// units) keep every unit index of a window (<= kMaxRows rows) in 32 bits.
constexpr int64_t kNarrowMaxUnits = (int64_t{1} << 22);

// ---------------------------------------------------------------------------
// host-side choice of decoder and window height (shared by the CUDA launcher
// and the emulator)

// Largest power of two <= 16 dividing every value.
inline int pow2_alignment(std::initializer_list<uint64_t> values) {
  uint64_t acc = 16;
  for (uint64_t v : values) acc |= v;
  return static_cast<int>(acc & (~acc + 1));  // lowest set bit (<= 16)
}

// Rows per CTA: about `rounds` batches of kUnroll units per thread, at most
// kMaxRows; smaller windows when dst is short, so that at least ~256 CTAs
// share the work (two per SM on a 132-SM part).
inline int32_t paged_rows_per_cta(int64_t units, int64_t dst_rows, int rounds) {
  int64_t rows = static_cast<int64_t>(rounds) * kUnroll * kThreads / (units > 0 ? units : 1);
  rows = rows < 1 ? 1 : (rows > kMaxRows ? kMaxRows : rows);
  while (rows > 8 && (dst_rows + rows - 1) / rows < 256) rows = (rows + 1) / 2;
  return static_cast<int32_t>(rows);
}

// Calls f.template operator()<Op, I>() with the decoder and unit index type
// for these params. Rows longer than kNarrowMaxUnits (hardening cases of 2^31
// bytes) take 64-bit unit indices and only the 16-byte or one-element decoders.
template <class F>
inline void with_paged_op(const GatherParams& p, F&& f) {
  const int src_align = pow2_alignment({reinterpret_cast<uintptr_t>(p.cache), static_cast<uint64_t>(p.block_stride),
                                        static_cast<uint64_t>(p.entry_stride)});
  const int dst_align = pow2_alignment({reinterpret_cast<uintptr_t>(p.dst), static_cast<uint64_t>(p.dst_row_stride)});
  const bool vec16 = src_align >= 16 && dst_align >= 16;
  if (p.kind == GatherKind::kRaw) {
    const int n = src_align < dst_align ? src_align : dst_align;
    const int a = pow2_alignment({static_cast<uint64_t>(n), static_cast<uint64_t>(p.row_bytes)});
    if (p.row_bytes > kNarrowMaxUnits) {
      return a == 16 ? f.template operator()<RawOp<16>, int64_t>() : f.template operator()<RawOp<1>, int64_t>();
    }
    switch (a) {
      case 16: return f.template operator()<RawOp<16>, int32_t>();
      case 8: return f.template operator()<RawOp<8>, int32_t>();
      case 4: return f.template operator()<RawOp<4>, int32_t>();
      case 2: return f.template operator()<RawOp<2>, int32_t>();
      default: return f.template operator()<RawOp<1>, int32_t>();
    }
  }
  auto by_out = [&]<class Out>() {
    switch (p.kind) {
      case GatherKind::kFp8DsMla:
        return vec16 ? f.template operator()<DsMlaOp<Out>, int32_t>()
                     : f.template operator()<DsMlaScalarOp<Out>, int32_t>();
      case GatherKind::kNvfp4DsMla:
        return vec16 ? f.template operator()<Nvfp4Op<Out>, int32_t>()
                     : f.template operator()<Nvfp4ScalarOp<Out>, int32_t>();
      default: {
        const bool e5 = p.kind == GatherKind::kFp8E5M2;
        const bool w16 = vec16 && p.width % 16 == 0;
        if (p.width > kNarrowMaxUnits) {
          if (w16) {
            return e5 ? f.template operator()<PerTensorOp<Out, true, 16>, int64_t>()
                      : f.template operator()<PerTensorOp<Out, false, 16>, int64_t>();
          }
          return e5 ? f.template operator()<PerTensorOp<Out, true, 1>, int64_t>()
                    : f.template operator()<PerTensorOp<Out, false, 1>, int64_t>();
        }
        const int need4 = 4 * Out::kBytes < 16 ? 4 * Out::kBytes : 16;  // dst alignment of a 4-value store
        if (w16) {
          return e5 ? f.template operator()<PerTensorOp<Out, true, 16>, int32_t>()
                    : f.template operator()<PerTensorOp<Out, false, 16>, int32_t>();
        }
        if (src_align >= 4 && dst_align >= need4 && p.width % 4 == 0) {
          return e5 ? f.template operator()<PerTensorOp<Out, true, 4>, int32_t>()
                    : f.template operator()<PerTensorOp<Out, false, 4>, int32_t>();
        }
        return e5 ? f.template operator()<PerTensorOp<Out, true, 1>, int32_t>()
                  : f.template operator()<PerTensorOp<Out, false, 1>, int32_t>();
      }
    }
  };
  switch (p.dst_type) {
    case ElemType::kBF16: return by_out.template operator()<vec::OutBF16>();
    case ElemType::kF16: return by_out.template operator()<vec::OutF16>();
    default: return by_out.template operator()<vec::OutF32>();
  }
}

}  // namespace paged
}  // namespace cache
}  // namespace mla_ext
