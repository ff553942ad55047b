// Torch-free parameter blocks, launchers and the shared per-element encode/decode of the
// DSA indexer key cache ops (formats: common/indexer_cache_layout.h). csrc/sparse/sparse_ops.cpp
// fills the blocks after checking the tensors; index_cache_cpu.cpp and index_cache.cu
// implement the launchers with the helpers below, so both produce the same bytes.
//
// Out-of-range policy (both backends, as the Triton kernels): a written token whose slot is
// negative (vLLM's padding) or >= num_blocks * block_size is skipped; a gathered row whose
// logical block is past the table width or whose physical block id is outside
// [0, num_blocks) is written as zeros and nothing is read for it. Rows of dst outside
// [cu_seq_lens[0], cu_seq_lens[num_reqs]) and at or past dst_rows are never written.
//
// fp8 writer: per token and group of Q values, scale = max(amax, 1e-4) / 448 in fp32 (NaN
// propagates, as torch's amax / clamp_min), rounded up to a power of two on its bits for
// ue8m0, value = e4m3(x / scale) saturating: the bytes of index_cache.py's quantize_fp8_rows.
#pragma once

#include <cstdint>

#include "common/fp8.h"
#include "common/indexer_cache_layout.h"

namespace mla_ext {
namespace indexer_cache {

// Element type of the keys written (k).
enum class KeyType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

struct WriteParams {
  const void* k;             // row t at k + t * k_row_stride elements, unit stride inside
  int64_t k_row_stride;      // elements
  KeyType k_type;
  uint8_t* cache;            // page b at cache + b * block_stride bytes
  int64_t block_stride;      // bytes
  int64_t entry_stride;      // bytes between tokens of a page (bf16 / fp32; fp8 pages are packed)
  int32_t num_blocks;
  int32_t block_size;
  IndexFormat format;
  int32_t head_dim;
  int32_t quant_block_size;  // fp8 only
  bool ue8m0;                // fp8 only: power-of-two scales
  const void* slot_mapping;  // [num_tokens] int32 or int64
  bool slot_int64;
  int32_t num_tokens;
};

struct GatherParams {
  const uint8_t* cache;
  int64_t block_stride;      // bytes
  int64_t entry_stride;      // bytes (bf16 / fp32)
  int32_t num_blocks;
  int32_t block_size;
  IndexFormat format;
  int32_t head_dim;
  int32_t quant_block_size;  // fp8 only
  uint8_t* dst;              // row i at dst + i * dst_row_stride: float32 keys, or raw e4m3 bytes
  int64_t dst_row_stride;    // bytes
  uint8_t* dst_scale;        // raw mode (fp8 only) when not null: 4 * D/Q scale bytes per row
  int64_t dst_scale_row_stride;  // bytes
  int32_t dst_rows;
  const int32_t* block_table;
  int64_t bt_row_stride;     // elements
  int32_t bt_width;
  const int32_t* cu_seq_lens;  // [num_reqs + 1]
  const int32_t* seq_starts;   // [num_reqs] or nullptr (all 0)
  int32_t num_reqs;
};

MLA_HOST_DEVICE inline float load_key(const void* k, KeyType t, int64_t i) {
  if (t == KeyType::kF32) return static_cast<const float*>(k)[i];
  const uint16_t h = static_cast<const uint16_t*>(k)[i];
  return t == KeyType::kBF16 ? fp8::bf16_bits_to_f32(h) : fp8::f16_bits_to_f32(h);
}

MLA_HOST_DEVICE inline int64_t write_slot(const WriteParams& p, int32_t t) {
  return p.slot_int64 ? static_cast<const int64_t*>(p.slot_mapping)[t]
                      : static_cast<const int32_t*>(p.slot_mapping)[t];
}

// A running amax that keeps a NaN once seen (torch's amax propagates it).
MLA_HOST_DEVICE inline float amax_step(float amax, float x) {
  const float a = x < 0.0f ? -x : x;
  return (a > amax || a != a) ? a : amax;
}

// The group's scale from its amax: max(amax, 1e-4) / 448, then (ue8m0) up to a power of two.
MLA_HOST_DEVICE inline float group_scale(float amax, bool ue8m0) {
  float s = (amax < kMinScale ? kMinScale : amax) / kE4M3Max;
  if (ue8m0) {
    const uint32_t u = fp8::f32_bits(s);
    if ((u & 0x7FFFFFu) != 0 && (u & 0x7F800000u) != 0x7F800000u) s = fp8::bits_f32((u & 0x7F800000u) + 0x800000u);
  }
  return s;
}

// Units of work per written token: its D/Q scale groups (fp8) or its D elements.
MLA_HOST_DEVICE inline int write_units(const WriteParams& p) {
  return p.format == IndexFormat::kFp8 ? p.head_dim / p.quant_block_size : p.head_dim;
}

// Writes unit u (write_units) of token t, if its slot is in the cache.
MLA_HOST_DEVICE inline void write_unit(const WriteParams& p, int32_t t, int u) {
  const int64_t slot = write_slot(p, t);
  if (slot < 0 || slot >= static_cast<int64_t>(p.num_blocks) * p.block_size) return;
  const int64_t off = slot % p.block_size;
  uint8_t* page = p.cache + (slot / p.block_size) * p.block_stride;
  const int64_t k0 = t * p.k_row_stride;
  if (p.format != IndexFormat::kFp8) {
    const float x = load_key(p.k, p.k_type, k0 + u);
    uint8_t* row = page + off * p.entry_stride;
    if (p.format == IndexFormat::kFp32) reinterpret_cast<float*>(row)[u] = x;
    else reinterpret_cast<uint16_t*>(row)[u] = fp8::f32_to_bf16_bits(x);
    return;
  }
  const int Q = p.quant_block_size;
  float amax = 0.0f;
  for (int i = 0; i < Q; ++i) amax = amax_step(amax, load_key(p.k, p.k_type, k0 + u * Q + i));
  const float s = group_scale(amax, p.ue8m0);
  uint8_t* vals = page + value_offset(static_cast<int>(off), p.head_dim) + u * Q;
  for (int i = 0; i < Q; ++i) vals[i] = fp8::encode_e4m3_sat(load_key(p.k, p.k_type, k0 + u * Q + i) / s);
  const uint32_t sb = fp8::f32_bits(s);
  uint8_t* sp = page + scale_offset(static_cast<int>(off), p.block_size, p.head_dim, Q) + 4 * u;
  for (int i = 0; i < 4; ++i) sp[i] = static_cast<uint8_t>(sb >> (8 * i));  // little-endian fp32, any alignment
}

// The cache page byte offset of dst row `row` of request `r`, or -1 when out of range.
MLA_HOST_DEVICE inline int64_t gather_page(const GatherParams& p, int32_t r, int32_t row, int32_t* off) {
  const int64_t tok = static_cast<int64_t>(p.seq_starts ? p.seq_starts[r] : 0) + (row - p.cu_seq_lens[r]);
  if (tok < 0) return -1;
  const int64_t lblk = tok / p.block_size;
  if (lblk >= p.bt_width) return -1;
  const int32_t blk = p.block_table[r * p.bt_row_stride + lblk];
  if (blk < 0 || blk >= p.num_blocks) return -1;
  *off = static_cast<int32_t>(tok % p.block_size);
  return blk * p.block_stride;
}

// The request whose rows [cu[r], cu[r+1]) hold dst row `row`, or -1 (binary search: no
// per-request loop, so rows spread evenly over threads whatever the request lengths).
MLA_HOST_DEVICE inline int32_t request_of(const GatherParams& p, int32_t row) {
  if (row < p.cu_seq_lens[0] || row >= p.cu_seq_lens[p.num_reqs]) return -1;
  int32_t lo = 0, hi = p.num_reqs - 1;  // the last r with cu[r] <= row
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (p.cu_seq_lens[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return row < p.cu_seq_lens[lo + 1] ? lo : -1;
}

// The fp32 scale of group g of token `off` (fp8 pages; bytes, so any alignment).
MLA_HOST_DEVICE inline float page_scale(const GatherParams& p, const uint8_t* page, int32_t off, int g) {
  const uint8_t* sp = page + scale_offset(off, p.block_size, p.head_dim, p.quant_block_size) + 4 * g;
  return fp8::bits_f32(static_cast<uint32_t>(sp[0]) | static_cast<uint32_t>(sp[1]) << 8 |
                       static_cast<uint32_t>(sp[2]) << 16 | static_cast<uint32_t>(sp[3]) << 24);
}

// Element e of a gathered dequantized row (page byte offset `page`, token `off`).
MLA_HOST_DEVICE inline float gather_value(const GatherParams& p, int64_t page, int32_t off, int e) {
  const uint8_t* base = p.cache + page;
  if (p.format == IndexFormat::kFp8)
    return fp8::decode_e4m3(base[value_offset(off, p.head_dim) + e]) * page_scale(p, base, off, e / p.quant_block_size);
  const uint8_t* row = base + off * p.entry_stride;
  if (p.format == IndexFormat::kFp32) return reinterpret_cast<const float*>(row)[e];
  return fp8::bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(row)[e]);
}

// Raw mode: byte b of a row's D value bytes then 4*D/Q scale bytes.
MLA_HOST_DEVICE inline uint8_t gather_raw_byte(const GatherParams& p, int64_t page, int32_t off, int b) {
  const uint8_t* base = p.cache + page;
  if (b < p.head_dim) return base[value_offset(off, p.head_dim) + b];
  return base[scale_offset(off, p.block_size, p.head_dim, p.quant_block_size) + (b - p.head_dim)];
}

// Stores one value of dst row `row` (element e; raw mode: byte e of values then scales).
MLA_HOST_DEVICE inline void gather_store(const GatherParams& p, int32_t row, int e, int64_t page, int32_t off) {
  const bool ok = page >= 0;
  if (p.dst_scale == nullptr) {
    reinterpret_cast<float*>(p.dst + row * p.dst_row_stride)[e] = ok ? gather_value(p, page, off, e) : 0.0f;
  } else {
    const uint8_t v = ok ? gather_raw_byte(p, page, off, e) : 0;
    if (e < p.head_dim) p.dst[row * p.dst_row_stride + e] = v;
    else p.dst_scale[row * p.dst_scale_row_stride + (e - p.head_dim)] = v;
  }
}

// Values per gathered row: D (dequantized) or D + 4*D/Q bytes (raw).
MLA_HOST_DEVICE inline int gather_width(const GatherParams& p) {
  return p.dst_scale == nullptr ? p.head_dim : p.head_dim + 4 * (p.head_dim / p.quant_block_size);
}

void write_cpu(const WriteParams& p);
void gather_cpu(const GatherParams& p);

#ifdef MLA_EXT_WITH_CUDA
// `stream` is a cudaStream_t kept as void*; each returns the launch's cudaError_t (0 = success).
int write_cuda(const WriteParams& p, void* stream);
int gather_cuda(const GatherParams& p, void* stream);
#endif

}  // namespace indexer_cache
}  // namespace mla_ext
