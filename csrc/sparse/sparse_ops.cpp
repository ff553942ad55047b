// Torch binding of the sparse stage: the DSA indexer key cache (format facts,
// writer, gather). Argument checks fill the torch-free parameter blocks of
// index_cache_kernels.h. Schemas: csrc/registration.cpp.
#include "common/torch_checks.h"

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "sparse/index_cache_kernels.h"

namespace mla_ext {
namespace {

namespace ic = indexer_cache;

ic::IndexFormat parse_index_format_or_throw(const std::string& name) {
  std::string known;
  for (int i = 0; i < ic::kNumIndexFormatNames; ++i) {
    if (name == ic::kIndexFormatNames[i].name) return ic::kIndexFormatNames[i].format;
    known += (i ? ", " : "");
    known += ic::kIndexFormatNames[i].name;
  }
  TORCH_CHECK_VALUE(false, "index_cache_dtype: unknown index cache format '", name, "'; expected one of: ", known);
  return ic::IndexFormat::kBf16;
}

// [format id, bytes_per_token, page_bytes, value_offset(1), scale_offset(1), storage_elem_bytes,
//  e4m3 max, min scale bits]: what the kernels use, for tests/test_sparse_index_cache_cpp.py.
std::vector<int64_t> index_cache_format_info(const std::string& index_cache_dtype, int64_t head_dim,
                                             int64_t quant_block_size, int64_t block_size) {
  const ic::IndexFormat f = parse_index_format_or_throw(index_cache_dtype);
  TORCH_CHECK_VALUE(head_dim > 0 && head_dim % 4 == 0 && head_dim <= 65536,
                    "head_dim: expected a positive multiple of 4 (<= 65536), got ", head_dim);
  TORCH_CHECK_VALUE(quant_block_size > 0 && head_dim % quant_block_size == 0,
                    "quant_block_size: expected a positive divisor of head_dim=", head_dim, ", got ", quant_block_size);
  TORCH_CHECK_VALUE(block_size > 0 && block_size < INT32_MAX, "block_size: expected a positive int32, got ", block_size);
  const int D = static_cast<int>(head_dim), Q = static_cast<int>(quant_block_size), B = static_cast<int>(block_size);
  float min_scale = ic::kMinScale;
  int32_t min_bits;
  std::memcpy(&min_bits, &min_scale, 4);
  return {static_cast<int64_t>(f), ic::bytes_per_token(f, D, Q), ic::page_bytes(f, B, D, Q),
          ic::value_offset(1, D), ic::scale_offset(1, B, D, Q), ic::storage_elem_bytes(f),
          static_cast<int64_t>(ic::kE4M3Max), min_bits};
}

bool parse_ue8m0(const std::string& scale_fmt) {
  TORCH_CHECK_VALUE(scale_fmt.empty() || scale_fmt == "fp32" || scale_fmt == "ue8m0",
                    "scale_fmt: expected '', 'fp32' or 'ue8m0', got '", scale_fmt, "'");
  return scale_fmt == "ue8m0";
}

// The cache's (format, head_dim, Q) checked: dtype, 3-D, unit last stride, packed fp8 pages.
void check_index_cache(const at::Tensor& cache, ic::IndexFormat f, int64_t head_dim, int64_t* quant_block_size,
                       const char* arg) {
  check_cache_tensor(cache, arg);
  const auto want = f == ic::IndexFormat::kBf16 ? at::kBFloat16 : (f == ic::IndexFormat::kFp32 ? at::kFloat : at::kByte);
  TORCH_CHECK_VALUE(cache.scalar_type() == want, arg, ": expected a ", want, " cache for this format, got ",
                    cache.scalar_type());
  TORCH_CHECK_VALUE(head_dim > 0 && head_dim % 4 == 0 && head_dim < INT32_MAX, "head_dim: expected a positive "
                    "multiple of 4, got ", head_dim);
  if (f != ic::IndexFormat::kFp8) {
    TORCH_CHECK_VALUE(cache.size(2) == head_dim, arg, ": expected head_dim ", head_dim, " per token, got ",
                      cache.size(2));
    return;
  }
  const int64_t width = cache.size(2), extra = width - head_dim;
  TORCH_CHECK_VALUE(extra > 0 && extra % 4 == 0 && head_dim % (extra / 4) == 0, arg, ": width ", width,
                    " is not head_dim=", head_dim, " + 4 * head_dim / Q");
  const int64_t Q = head_dim / (extra / 4);
  TORCH_CHECK_VALUE(*quant_block_size == 0 || *quant_block_size == Q, "quant_block_size: expected ", Q,
                    " for this cache (or 0), got ", *quant_block_size);
  *quant_block_size = Q;
  TORCH_CHECK_VALUE(cache.size(1) <= 1 || cache.stride(1) == width, arg,
                    ": fp8 pages must be contiguous (values then scales), got strides ", cache.strides());
}

ic::WriteParams index_write_params(const at::Tensor& k, const at::Tensor& cache, const at::Tensor& slot_mapping,
                                   const std::string& index_cache_dtype, int64_t quant_block_size,
                                   const std::string& scale_fmt) {
  const ic::IndexFormat f = parse_index_format_or_throw(index_cache_dtype);
  TORCH_CHECK_VALUE(k.dim() == 2, "k: expected [T, D], got shape ", k.sizes());
  TORCH_CHECK_VALUE(is_native_dtype(k.scalar_type()), "k: expected bf16/fp16/fp32, got ", k.scalar_type());
  TORCH_CHECK_VALUE(k.size(1) <= 1 || k.stride(1) == 1, "k: the last dim must be contiguous, got strides ",
                    k.strides());
  TORCH_CHECK_VALUE(k.size(0) < INT32_MAX, "k: too many tokens");
  int64_t Q = quant_block_size;
  TORCH_CHECK_VALUE(Q >= 0, "quant_block_size: expected >= 0 (0: the cache's), got ", Q);
  check_index_cache(cache, f, k.size(1), &Q, "cache");
  const bool ue8m0 = parse_ue8m0(scale_fmt);
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "slot_mapping: expected [",
                    k.size(0), "], got shape ", slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
                    "slot_mapping: expected int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.numel() <= 1 || slot_mapping.stride(0) == 1, "slot_mapping: expected contiguous");
  check_same_device(k, cache, "k");
  check_same_device(slot_mapping, cache, "slot_mapping");
  check_no_overlap(cache, "cache", k, "k");
  check_no_overlap(cache, "cache", slot_mapping, "slot_mapping");

  ic::WriteParams p{};
  p.k = k.data_ptr();
  p.k_row_stride = k.stride(0);
  p.k_type = k.scalar_type() == at::kBFloat16 ? ic::KeyType::kBF16
             : k.scalar_type() == at::kHalf   ? ic::KeyType::kF16
                                              : ic::KeyType::kF32;
  p.cache = static_cast<uint8_t*>(cache.data_ptr());
  p.block_stride = cache.stride(0) * cache.element_size();
  p.entry_stride = cache.stride(1) * cache.element_size();
  p.num_blocks = static_cast<int32_t>(cache.size(0));
  p.block_size = static_cast<int32_t>(cache.size(1));
  p.format = f;
  p.head_dim = static_cast<int32_t>(k.size(1));
  p.quant_block_size = static_cast<int32_t>(Q == 0 ? k.size(1) : Q);
  p.ue8m0 = ue8m0;
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_int64 = slot_mapping.scalar_type() == at::kLong;
  p.num_tokens = static_cast<int32_t>(k.size(0));
  return p;
}

// dst: float32 [T, D] (dequantized keys), or with dst_scale (fp8 only) the raw e4m3 bytes uint8
// [T, D] and their scales' bytes ([T, 4*D/Q] uint8 or [T, D/Q] float32).
ic::GatherParams index_gather_params(const at::Tensor& cache, const at::Tensor& dst,
                                     const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
                                     const std::string& index_cache_dtype, int64_t head_dim,
                                     const std::optional<at::Tensor>& seq_starts,
                                     const std::optional<at::Tensor>& dst_scale) {
  const ic::IndexFormat f = parse_index_format_or_throw(index_cache_dtype);
  int64_t Q = 0;
  check_index_cache(cache, f, head_dim, &Q, "cache");
  check_index_tensor(block_table, cache, 2, "block_table");
  check_index_tensor(cu_seq_lens, cache, 1, "cu_seq_lens");
  const int64_t n = cu_seq_lens.numel() - 1;
  TORCH_CHECK_VALUE(n >= 0 && block_table.size(0) >= n, "block_table: expected at least ", n, " rows, got ",
                    block_table.size(0));
  if (seq_starts.has_value()) {
    check_index_tensor(*seq_starts, cache, 1, "seq_starts");
    TORCH_CHECK_VALUE(seq_starts->numel() >= n, "seq_starts: expected at least ", n, " entries, got ",
                      seq_starts->numel());
  }
  const bool raw = dst_scale.has_value();
  TORCH_CHECK_VALUE(!raw || f == ic::IndexFormat::kFp8, "dst_scale: only the fp8 index cache has scales");
  TORCH_CHECK_VALUE(dst.dim() == 2 && dst.size(1) == head_dim, "dst: expected [T, head_dim=", head_dim, "], got shape ",
                    dst.sizes());
  TORCH_CHECK_VALUE(dst.scalar_type() == (raw ? at::kByte : at::kFloat), "dst: expected ",
                    raw ? "uint8 (raw e4m3 bytes)" : "float32", ", got ", dst.scalar_type());
  TORCH_CHECK_VALUE(dst.size(1) <= 1 || dst.stride(1) == 1, "dst: the last dim must be contiguous");
  TORCH_CHECK_VALUE(dst.size(0) < INT32_MAX, "dst: too many rows");
  check_same_device(dst, cache, "dst");
  check_no_self_overlap(dst, "dst");
  for (const auto* read : {&cache, &block_table, &cu_seq_lens}) check_no_overlap(dst, "dst", *read, "an input");
  if (seq_starts.has_value()) check_no_overlap(dst, "dst", *seq_starts, "seq_starts");

  ic::GatherParams p{};
  if (raw) {
    const at::Tensor& s = *dst_scale;
    const int64_t scale_bytes = 4 * (head_dim / Q);
    TORCH_CHECK_VALUE(s.dim() == 2 && s.size(0) == dst.size(0) && s.size(1) * s.element_size() == scale_bytes &&
                          (s.scalar_type() == at::kByte || s.scalar_type() == at::kFloat),
                      "dst_scale: expected uint8 [", dst.size(0), ", ", scale_bytes, "] or float32 [", dst.size(0),
                      ", ", head_dim / Q, "], got ", s.scalar_type(), " ", s.sizes());
    TORCH_CHECK_VALUE(s.size(1) <= 1 || s.stride(1) == 1, "dst_scale: the last dim must be contiguous");
    check_same_device(s, cache, "dst_scale");
    check_no_self_overlap(s, "dst_scale");
    check_no_overlap(s, "dst_scale", dst, "dst");
    for (const auto* read : {&cache, &block_table, &cu_seq_lens}) check_no_overlap(s, "dst_scale", *read, "an input");
    p.dst_scale = static_cast<uint8_t*>(s.data_ptr());
    p.dst_scale_row_stride = s.stride(0) * s.element_size();
  }
  p.cache = static_cast<const uint8_t*>(cache.data_ptr());
  p.block_stride = cache.stride(0) * cache.element_size();
  p.entry_stride = cache.stride(1) * cache.element_size();
  p.num_blocks = static_cast<int32_t>(cache.size(0));
  p.block_size = static_cast<int32_t>(cache.size(1));
  p.format = f;
  p.head_dim = static_cast<int32_t>(head_dim);
  p.quant_block_size = static_cast<int32_t>(Q == 0 ? head_dim : Q);
  p.dst = static_cast<uint8_t*>(dst.data_ptr());
  p.dst_row_stride = dst.stride(0) * dst.element_size();
  p.dst_rows = static_cast<int32_t>(dst.size(0));
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_row_stride = block_table.stride(0);
  p.bt_width = static_cast<int32_t>(block_table.size(1));
  p.cu_seq_lens = cu_seq_lens.data_ptr<int32_t>();
  p.seq_starts = seq_starts.has_value() ? seq_starts->data_ptr<int32_t>() : nullptr;
  p.num_reqs = static_cast<int32_t>(n);
  return p;
}

void index_cache_write_cpu(const at::Tensor& k, const at::Tensor& cache, const at::Tensor& slot_mapping,
                           const std::string& index_cache_dtype, int64_t quant_block_size,
                           const std::string& scale_fmt) {
  ic::write_cpu(index_write_params(k, cache, slot_mapping, index_cache_dtype, quant_block_size, scale_fmt));
}

// The offsets read on the host, as mla_ext.cache.checks.check_offsets does in Python (same
// messages): free for CPU tensors. The CUDA op does not read them (that would sync): its kernel
// bounds every row instead (request_of / gather_page: rows outside cu_seq_lens are untouched,
// a token outside the table or the cache reads zeros).
void check_index_gather_offsets(const ic::GatherParams& p) {
  const int32_t* cu = p.cu_seq_lens;
  TORCH_CHECK_VALUE(p.num_reqs == 0 || cu[0] >= 0, "cu_seq_lens: entry 0 is ", cu[0], ", expected >= 0");
  for (int32_t r = 0; r < p.num_reqs; ++r) {
    TORCH_CHECK_VALUE(cu[r + 1] >= cu[r], "cu_seq_lens: request ", r, " has a negative length (", cu[r], " -> ",
                      cu[r + 1], "); expected non-decreasing offsets");
    TORCH_CHECK_VALUE(cu[r + 1] <= p.dst_rows, "cu_seq_lens: request ", r, " ends at row ", cu[r + 1],
                      " but dst has ", p.dst_rows, " rows");
    TORCH_CHECK_VALUE(p.seq_starts == nullptr || cu[r + 1] == cu[r] || p.seq_starts[r] >= 0, "seq_starts: request ",
                      r, " starts at ", p.seq_starts == nullptr ? 0 : p.seq_starts[r], ", expected >= 0");
  }
}

void index_cache_gather_cpu(const at::Tensor& cache, const at::Tensor& dst, const at::Tensor& block_table,
                            const at::Tensor& cu_seq_lens, const std::string& index_cache_dtype, int64_t head_dim,
                            const std::optional<at::Tensor>& seq_starts,
                            const std::optional<at::Tensor>& dst_scale) {
  const ic::GatherParams p = index_gather_params(cache, dst, block_table, cu_seq_lens, index_cache_dtype, head_dim,
                                                 seq_starts, dst_scale);
  check_index_gather_offsets(p);
  ic::gather_cpu(p);
}

#ifdef MLA_EXT_WITH_CUDA
void index_cache_write_cuda(const at::Tensor& k, const at::Tensor& cache, const at::Tensor& slot_mapping,
                            const std::string& index_cache_dtype, int64_t quant_block_size,
                            const std::string& scale_fmt) {
  const ic::WriteParams p = index_write_params(k, cache, slot_mapping, index_cache_dtype, quant_block_size,
                                               scale_fmt);
  c10::cuda::CUDAGuard guard(cache.device());
  check_launch(ic::write_cuda(p, current_stream(cache)), "index_cache_write");
}

void index_cache_gather_cuda(const at::Tensor& cache, const at::Tensor& dst, const at::Tensor& block_table,
                             const at::Tensor& cu_seq_lens, const std::string& index_cache_dtype, int64_t head_dim,
                             const std::optional<at::Tensor>& seq_starts,
                             const std::optional<at::Tensor>& dst_scale) {
  const ic::GatherParams p = index_gather_params(cache, dst, block_table, cu_seq_lens, index_cache_dtype,
                                                 head_dim, seq_starts, dst_scale);
  c10::cuda::CUDAGuard guard(cache.device());
  check_launch(ic::gather_cuda(p, current_stream(cache)), "index_cache_gather");
}
#endif

}  // namespace
}  // namespace mla_ext

// No tensor argument: a CompositeImplicitAutograd kernel serves every call.
TORCH_LIBRARY_IMPL(mla_ext, CompositeImplicitAutograd, m) {
  m.impl("index_cache_format_info", &mla_ext::index_cache_format_info);
}

TORCH_LIBRARY_IMPL(mla_ext, CPU, m) {
  m.impl("index_cache_write", &mla_ext::index_cache_write_cpu);
  m.impl("index_cache_gather", &mla_ext::index_cache_gather_cpu);
}

#ifdef MLA_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(mla_ext, CUDA, m) {
  m.impl("index_cache_write", &mla_ext::index_cache_write_cuda);
  m.impl("index_cache_gather", &mla_ext::index_cache_gather_cuda);
}
#endif
