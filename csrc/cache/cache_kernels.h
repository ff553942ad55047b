// Torch-free parameter structs and launchers of the paged latent cache ops
// (SPEC §2, §6). csrc/cache/cache_ops.cpp fills these from tensors after checking
// them; cache_cpu.cpp, write.cu and gather_paged.cu implement the launchers.
//
// Out-of-range policy (every backend): a gathered row whose token is negative,
// whose logical block is past the table width or whose physical block id is
// outside [0, num_blocks) is written as zero, and nothing is read for it; a
// written token whose slot is negative or >= num_blocks * block_size is
// skipped. block_table is never read past `bt_width` columns.
//
// Sizes and offsets are 64-bit: a row may hold 2^31 or more bytes (an int32
// row size once went negative and the zero-row memset crashed). Only counts
// that the bindings bound below INT32_MAX (rows, tokens, blocks) are int32.
//
// k_scale (per-tensor formats) must be finite and > 0. The bindings check a
// CPU scale on the host; a device scale is never read on the host (the ops
// must not sync), so every kernel passes it through `checked_k_scale`: an
// invalid scale makes every dequantized (gather) or stored (write) value NaN,
// never a plausible zero, saturated or sign-flipped row.
#pragma once

#include <cstdint>

#include "common/cache_layout.h"
#include "common/fp8.h"

namespace mla_ext {
namespace cache {

// Element type of a dense tensor the kernels read or write.
enum class ElemType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2, kU8 = 3 };

MLA_HOST_DEVICE inline int elem_bytes(ElemType t) {
  return t == ElemType::kF32 ? 4 : (t == ElemType::kU8 ? 1 : 2);
}

// How a gathered row is produced.
enum class GatherKind : int32_t {
  kRaw = 0,        // bytes copied unchanged (native cache, fp8 passthrough)
  kFp8E4M3 = 1,    // per-tensor e4m3 bytes x k_scale
  kFp8E5M2 = 2,    // per-tensor e5m2 bytes x k_scale
  kFp8DsMla = 3,   // 656-byte rows, per-tile scales, bf16 rope
  kNvfp4DsMla = 4, // 352-byte rows, e2m1 pairs x permuted e4m3 block scales, e4m3 rope
};

struct GatherParams {
  const uint8_t* cache;       // element [b, t, 0] at cache + b*block_stride + t*entry_stride
  int64_t block_stride;       // bytes
  int64_t entry_stride;       // bytes
  int32_t num_blocks;
  int32_t block_size;
  int64_t row_bytes;          // raw: bytes copied per row (= width * element size)
  uint8_t* dst;               // row i at dst + i*dst_row_stride
  int64_t dst_row_stride;     // bytes
  int32_t dst_rows;           // dst.size(0): rows at or past it are never written
  int64_t width;              // dst.size(1) in elements
  ElemType dst_type;          // ignored for kRaw
  GatherKind kind;
  const int32_t* block_table;
  int64_t bt_row_stride;      // elements
  int32_t bt_width;           // columns of block_table
  const int32_t* cu_seq_lens; // [num_reqs + 1]
  const int32_t* seq_starts;  // [num_reqs] or nullptr (all 0)
  int32_t num_reqs;
  const float* k_scale;       // per-tensor kinds only (device pointer on CUDA)
};

struct WriteParams {
  const uint8_t* kv_c;        // [T, L] rows of in_type
  int64_t kv_c_row_stride;    // bytes
  const uint8_t* k_pe;        // [T, R]
  int64_t k_pe_row_stride;    // bytes
  ElemType in_type;
  int32_t num_tokens;
  int64_t L;
  int64_t R;
  uint8_t* cache;
  int64_t block_stride;       // bytes
  int64_t entry_stride;       // bytes
  int32_t num_blocks;
  int32_t block_size;
  const void* slots;          // [T] int64 or int32
  bool slots_i32;
  CacheFormat format;         // kAuto/kBFloat16/kFloat16 copy (in_type == cache type)
                              // (kNvfp4DsMla: L = 512 and R = 64, checked by the bindings)
  const float* k_scale;       // per-tensor formats only
};

struct KvScaleParams {
  const uint8_t* kv_c;
  int64_t kv_c_row_stride;    // bytes
  const uint8_t* k_pe;
  int64_t k_pe_row_stride;    // bytes
  ElemType in_type;
  int32_t num_tokens;
  int64_t L;
  int64_t R;
  float fp8_max;              // 448 (e4m3) or 57344 (e5m2)
  float* out;                 // [1]
};

// The request owning dst row t: the largest r in [0, num_reqs) with
// cu[r] <= t (num_reqs >= 1). Binary search, so no kernel needs the total row
// count on the host; for a non-monotone cu_seq_lens it still returns an r in
// range (the result is then unspecified but never out of bounds).
MLA_HOST_DEVICE inline int find_request(const int32_t* cu, int num_reqs, int64_t t) {
  int lo = 0, hi = num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Cache row feeding dst row t (cu[0] <= t < cu[num_reqs]), or nullptr when
// the token's block is out of range (the row is then written as zero).
MLA_HOST_DEVICE inline const uint8_t* gather_source_row(const GatherParams& p, int64_t t) {
  const int r = find_request(p.cu_seq_lens, p.num_reqs, t);
  const int64_t tok = (p.seq_starts ? static_cast<int64_t>(p.seq_starts[r]) : 0) + (t - p.cu_seq_lens[r]);
  if (tok < 0) return nullptr;
  const int64_t lb = tok / p.block_size;
  if (lb >= p.bt_width) return nullptr;
  const int32_t pb = p.block_table[static_cast<int64_t>(r) * p.bt_row_stride + lb];
  if (pb < 0 || pb >= p.num_blocks) return nullptr;
  return p.cache + static_cast<int64_t>(pb) * p.block_stride + (tok % p.block_size) * p.entry_stride;
}

// Cache entry of a written token, or nullptr when its slot is skipped.
MLA_HOST_DEVICE inline uint8_t* write_dest_row(const WriteParams& p, int64_t t) {
  const int64_t slot = p.slots_i32 ? static_cast<int64_t>(static_cast<const int32_t*>(p.slots)[t])
                                   : static_cast<const int64_t*>(p.slots)[t];
  if (slot < 0 || slot >= static_cast<int64_t>(p.num_blocks) * p.block_size) return nullptr;
  return p.cache + (slot / p.block_size) * p.block_stride + (slot % p.block_size) * p.entry_stride;
}

// The per-tensor scale a kernel uses: `s` when finite and > 0, else NaN.
MLA_HOST_DEVICE inline float checked_k_scale(float s) {
  return s > 0.0f && s <= 3.40282347e38f ? s : fp8::bits_f32(0x7FC00000u);
}

// compute_kv_scale never returns less than this (reference.MIN_KV_SCALE).
constexpr float kMinKvScale = 1e-12f;

void gather_cpu(const GatherParams& p);
void write_cpu(const WriteParams& p);
void kv_scale_cpu(const KvScaleParams& p);

#ifdef MLA_EXT_WITH_CUDA
// `stream` is a cudaStream_t, kept as void* so this header stays CUDA-free;
// each returns the cudaError_t of its launches (0 = success).
int gather_cuda(const GatherParams& p, void* stream);
int write_cuda(const WriteParams& p, void* stream);
int kv_scale_cuda(const KvScaleParams& p, void* stream);
#endif

}  // namespace cache
}  // namespace mla_ext
