// Torch binding of the cache stage (concat_and_cache_mla, gather_and_maybe_dequant_cache,
// cp_gather_cache, compute_kv_scale): the argument checks, shared by the CPU and
// CUDA registrations, fill the torch-free parameter blocks of cache_kernels.h;
// range checks of ids are the Python wrapper's `validate=True`. Schemas:
// csrc/registration.cpp.
#include "common/torch_checks.h"

#include <cfloat>
#include <optional>
#include <string>

#include "cache/cache_kernels.h"

namespace mla_ext {
namespace {

cache::ElemType cache_elem_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return cache::ElemType::kBF16;
    case at::kHalf: return cache::ElemType::kF16;
    case at::kFloat: return cache::ElemType::kF32;
    default: return cache::ElemType::kU8;  // uint8 / float8 bytes
  }
}

// The cache dtype a format needs: native formats a bf16/fp16/fp32 cache
// (bfloat16/float16 exactly that), fp8 formats uint8 (or the matching float8
// view for per-tensor formats).
void check_cache_dtype(const at::Tensor& c, CacheFormat f, const char* arg) {
  const auto t = c.scalar_type();
  switch (f) {
    case CacheFormat::kAuto:
      TORCH_CHECK_VALUE(is_native_dtype(t), arg, ": format 'auto' needs a bf16/fp16/fp32 cache, got ", t);
      break;
    case CacheFormat::kBFloat16:
      TORCH_CHECK_VALUE(t == at::kBFloat16, arg, ": format 'bfloat16' needs a bfloat16 cache, got ", t);
      break;
    case CacheFormat::kFloat16:
      TORCH_CHECK_VALUE(t == at::kHalf, arg, ": format 'float16' needs a float16 cache, got ", t);
      break;
    case CacheFormat::kFp8E4M3:
      TORCH_CHECK_VALUE(t == at::kByte || t == at::kFloat8_e4m3fn, arg,
                        ": format 'fp8' needs a uint8 or float8_e4m3fn cache, got ", t);
      break;
    case CacheFormat::kFp8E5M2:
      TORCH_CHECK_VALUE(t == at::kByte || t == at::kFloat8_e5m2, arg,
                        ": format 'fp8_e5m2' needs a uint8 or float8_e5m2 cache, got ", t);
      break;
    case CacheFormat::kFp8DsMla:
      TORCH_CHECK_VALUE(t == at::kByte, arg, ": format 'fp8_ds_mla' needs a uint8 cache, got ", t);
      TORCH_CHECK_VALUE(c.size(2) == ds_mla::kEntryBytes, arg, ": fp8_ds_mla entries are ",
                        ds_mla::kEntryBytes, " bytes, got ", c.size(2));
      break;
    case CacheFormat::kNvfp4DsMla:
      TORCH_CHECK_VALUE(t == at::kByte, arg, ": format 'nvfp4_ds_mla' needs a uint8 cache, got ", t);
      TORCH_CHECK_VALUE(c.size(2) == nvfp4_ds_mla::kEntryBytes, arg, ": nvfp4_ds_mla entries are ",
                        nvfp4_ds_mla::kEntryBytes, " bytes, got ", c.size(2));
      break;
  }
}

// k_scale is on the cache's device for every format (all tensor arguments of
// an op share one device, even one the format ignores). Its value must be
// finite and > 0 (SPEC §2): a CPU scale is read and checked here; a device
// scale is not (reading it would sync the host, and the ops never do), and
// the kernels turn an invalid one into NaN output (cache_kernels.h). The
// public API checks a device scale with validate=True.
const float* k_scale_ptr(const at::Tensor& k_scale, CacheFormat f, const at::Tensor& cache) {
  check_same_device(k_scale, cache, "k_scale");
  if (quant_mode(f) != QuantMode::kFp8PerTensor) return nullptr;
  TORCH_CHECK_VALUE(k_scale.scalar_type() == at::kFloat && k_scale.numel() == 1,
                    "k_scale: expected a float32 tensor with 1 element, got ", k_scale.scalar_type(),
                    " of shape ", k_scale.sizes());
  if (k_scale.is_cpu()) {
    const float v = *k_scale.data_ptr<float>();
    TORCH_CHECK_VALUE(v > 0.0f && v <= FLT_MAX, "k_scale: expected a finite value > 0, got ", v,
                      " (a CPU scale is checked here; a device scale is not read on the host, and an "
                      "invalid one makes every dequantized or stored value NaN)");
  }
  return k_scale.data_ptr<float>();
}

// Fields common to both gathers; `kind`, `dst_type` and `row_bytes` are the caller's.
cache::GatherParams gather_params(const at::Tensor& src_cache, const at::Tensor& dst,
                                  const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
                                  int64_t num_reqs, const std::optional<at::Tensor>& seq_starts) {
  check_cache_tensor(src_cache, "src_cache");
  check_index_tensor(block_table, src_cache, 2, "block_table");
  check_index_tensor(cu_seq_lens, src_cache, 1, "cu_seq_lens");
  TORCH_CHECK_VALUE(num_reqs >= 0 && num_reqs <= cu_seq_lens.numel() - 1,
                    "num_reqs: expected 0 <= num_reqs <= cu_seq_lens.numel() - 1 = ",
                    cu_seq_lens.numel() - 1, ", got ", num_reqs);
  TORCH_CHECK_VALUE(block_table.size(0) >= num_reqs, "block_table: expected at least num_reqs=",
                    num_reqs, " rows, got ", block_table.size(0));
  if (seq_starts.has_value()) {
    check_index_tensor(*seq_starts, src_cache, 1, "seq_starts");
    TORCH_CHECK_VALUE(seq_starts->numel() >= num_reqs, "seq_starts: expected at least num_reqs=",
                      num_reqs, " entries, got ", seq_starts->numel());
  }
  TORCH_CHECK_VALUE(dst.dim() == 2, "dst: expected a 2-D [T, E] tensor, got shape ", dst.sizes());
  TORCH_CHECK_VALUE(dst.size(1) <= 1 || dst.stride(1) == 1,
                    "dst: the last dim must be contiguous (stride 1), got strides ", dst.strides());
  TORCH_CHECK_VALUE(dst.stride(0) >= 0, "dst: negative strides are not supported");
  TORCH_CHECK_VALUE(dst.size(0) < INT32_MAX, "dst: too many rows");
  check_same_device(dst, src_cache, "dst");
  check_no_self_overlap(dst, "dst");
  check_no_overlap(dst, "dst", src_cache, "src_cache");
  check_no_overlap(dst, "dst", block_table, "block_table");
  check_no_overlap(dst, "dst", cu_seq_lens, "cu_seq_lens");
  if (seq_starts.has_value()) check_no_overlap(dst, "dst", *seq_starts, "seq_starts");

  cache::GatherParams p{};
  p.cache = static_cast<const uint8_t*>(src_cache.data_ptr());
  p.block_stride = src_cache.stride(0) * src_cache.element_size();
  p.entry_stride = src_cache.stride(1) * src_cache.element_size();
  p.num_blocks = static_cast<int32_t>(src_cache.size(0));
  p.block_size = static_cast<int32_t>(src_cache.size(1));
  p.dst = static_cast<uint8_t*>(dst.data_ptr());
  p.dst_row_stride = dst.stride(0) * dst.element_size();
  p.dst_rows = static_cast<int32_t>(dst.size(0));
  p.width = dst.size(1);
  p.dst_type = cache_elem_type(dst);
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_row_stride = block_table.stride(0);
  p.bt_width = static_cast<int32_t>(block_table.size(1));
  p.cu_seq_lens = cu_seq_lens.data_ptr<int32_t>();
  p.seq_starts = seq_starts.has_value() ? seq_starts->data_ptr<int32_t>() : nullptr;
  p.num_reqs = static_cast<int32_t>(num_reqs);
  p.row_bytes = dst.size(1) * dst.element_size();
  return p;
}

cache::GatherParams dequant_gather_params(const at::Tensor& src_cache, const at::Tensor& dst,
                                          const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
                                          int64_t num_reqs, const std::string& kv_cache_dtype,
                                          const at::Tensor& k_scale,
                                          const std::optional<at::Tensor>& seq_starts) {
  const CacheFormat f = parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype");
  cache::GatherParams p = gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts);
  check_cache_dtype(src_cache, f, "src_cache");
  const bool raw = dst.scalar_type() == src_cache.scalar_type();
  TORCH_CHECK_VALUE(raw || is_quantized(f), "dst: a native ", src_cache.scalar_type(),
                    " cache can only be gathered into ", src_cache.scalar_type(), ", got ",
                    dst.scalar_type());
  TORCH_CHECK_VALUE(raw || is_native_dtype(dst.scalar_type()),
                    "dst: expected bf16/fp16/fp32 (dequantized) or ", src_cache.scalar_type(),
                    " (raw bytes), got ", dst.scalar_type());
  if (!raw && f == CacheFormat::kNvfp4DsMla) {
    TORCH_CHECK_VALUE(dst.size(1) == nvfp4_ds_mla::kLatentDim + nvfp4_ds_mla::kRopeDim,
                      "dst: nvfp4_ds_mla dequantizes to ", nvfp4_ds_mla::kLatentDim + nvfp4_ds_mla::kRopeDim,
                      " columns, got ", dst.size(1));
  } else if (raw || f != CacheFormat::kFp8DsMla) {
    TORCH_CHECK_VALUE(dst.size(1) == src_cache.size(2), "dst: expected ", src_cache.size(2),
                      " columns (the cache entry width), got ", dst.size(1));
  } else {
    TORCH_CHECK_VALUE(dst.size(1) == ds_mla::kLatentDim + ds_mla::kRopeDim ||
                          dst.size(1) == ds_mla::kLatentDim,
                      "dst: fp8_ds_mla dequantizes to ", ds_mla::kLatentDim + ds_mla::kRopeDim,
                      " (R=64) or ", ds_mla::kLatentDim, " (R=0) columns, got ", dst.size(1));
  }
  check_no_overlap(dst, "dst", k_scale, "k_scale");
  if (raw) {
    check_same_device(k_scale, src_cache, "k_scale");
    p.kind = cache::GatherKind::kRaw;
  } else {
    p.kind = f == CacheFormat::kFp8DsMla     ? cache::GatherKind::kFp8DsMla
             : f == CacheFormat::kNvfp4DsMla ? cache::GatherKind::kNvfp4DsMla
             : f == CacheFormat::kFp8E5M2    ? cache::GatherKind::kFp8E5M2
                                             : cache::GatherKind::kFp8E4M3;
    p.k_scale = k_scale_ptr(k_scale, f, src_cache);
  }
  return p;
}

cache::GatherParams cp_gather_params(const at::Tensor& src_cache, const at::Tensor& dst,
                                     const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
                                     int64_t num_reqs, const std::optional<at::Tensor>& seq_starts) {
  cache::GatherParams p = gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts);
  TORCH_CHECK_VALUE(dst.scalar_type() == src_cache.scalar_type(),
                    "dst: cp_gather_cache copies raw bytes, so dst must have the cache's dtype ",
                    src_cache.scalar_type(), ", got ", dst.scalar_type());
  TORCH_CHECK_VALUE(dst.size(1) == src_cache.size(2), "dst: expected ", src_cache.size(2),
                    " columns (the cache entry width), got ", dst.size(1));
  p.kind = cache::GatherKind::kRaw;
  return p;
}

// The new tokens' rows as the writer and the KV-scale kernel read them (both param structs
// name these fields alike).
template <typename Params>
void set_input_rows(Params& p, const at::Tensor& kv_c, const at::Tensor& k_pe) {
  p.kv_c = static_cast<const uint8_t*>(kv_c.data_ptr());
  p.kv_c_row_stride = kv_c.stride(0) * kv_c.element_size();
  p.k_pe = static_cast<const uint8_t*>(k_pe.data_ptr());
  p.k_pe_row_stride = k_pe.stride(0) * k_pe.element_size();
  p.in_type = cache_elem_type(kv_c);
  p.num_tokens = static_cast<int32_t>(kv_c.size(0));
}

cache::WriteParams write_params(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                const at::Tensor& k_scale) {
  const CacheFormat f = parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype");
  check_cache_tensor(kv_cache, "kv_cache");
  check_cache_dtype(kv_cache, f, "kv_cache");
  TORCH_CHECK_VALUE(kv_c.dim() == 2 && k_pe.dim() == 2 && k_pe.size(0) == kv_c.size(0),
                    "kv_c, k_pe: expected [T, L] and [T, R], got ", kv_c.sizes(), " and ", k_pe.sizes());
  for (const auto* t : {&kv_c, &k_pe}) {
    const char* name = t == &kv_c ? "kv_c" : "k_pe";
    TORCH_CHECK_VALUE(is_native_dtype(t->scalar_type()), name, ": expected bf16/fp16/fp32, got ",
                      t->scalar_type());
    TORCH_CHECK_VALUE(t->size(1) <= 1 || t->stride(1) == 1, name, ": the last dim must be contiguous");
    check_same_device(*t, kv_cache, name);
  }
  TORCH_CHECK_VALUE(k_pe.scalar_type() == kv_c.scalar_type(), "k_pe: expected dtype ",
                    kv_c.scalar_type(), " (as kv_c), got ", k_pe.scalar_type());
  const int64_t L = kv_c.size(1), R = k_pe.size(1);
  TORCH_CHECK_VALUE(supports_dims(f, L, R), "kv_c, k_pe: format '", kv_cache_dtype, "' cannot hold L=", L,
                    ", R=", R);
  TORCH_CHECK_VALUE(kv_cache.size(2) == entry_elems(f, L, R, 2),
                    "kv_cache: expected entry width ", entry_elems(f, L, R, 2),
                    " for L=", L, ", R=", R, ", got ", kv_cache.size(2));
  TORCH_CHECK_VALUE(is_quantized(f) || kv_c.scalar_type() == kv_cache.scalar_type(), "kv_c: a native ",
                    kv_cache.scalar_type(), " cache takes ", kv_cache.scalar_type(), " inputs, got ",
                    kv_c.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
                    "slot_mapping: expected int64 or int32, got ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.numel() == kv_c.size(0),
                    "slot_mapping: expected [", kv_c.size(0), "], got ", slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.numel() <= 1 || slot_mapping.stride(0) == 1,
                    "slot_mapping: expected a contiguous tensor");
  check_same_device(slot_mapping, kv_cache, "slot_mapping");
  TORCH_CHECK_VALUE(kv_c.size(0) < INT32_MAX, "kv_c: too many tokens");
  check_no_self_overlap(kv_cache, "kv_cache");
  check_no_overlap(kv_cache, "kv_cache", kv_c, "kv_c");
  check_no_overlap(kv_cache, "kv_cache", k_pe, "k_pe");
  check_no_overlap(kv_cache, "kv_cache", slot_mapping, "slot_mapping");
  check_no_overlap(kv_cache, "kv_cache", k_scale, "k_scale");

  cache::WriteParams p{};
  set_input_rows(p, kv_c, k_pe);
  p.L = L;
  p.R = R;
  p.cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  p.block_stride = kv_cache.stride(0) * kv_cache.element_size();
  p.entry_stride = kv_cache.stride(1) * kv_cache.element_size();
  p.num_blocks = static_cast<int32_t>(kv_cache.size(0));
  p.block_size = static_cast<int32_t>(kv_cache.size(1));
  p.slots = slot_mapping.data_ptr();
  p.slots_i32 = slot_mapping.scalar_type() == at::kInt;
  p.format = f;
  p.k_scale = k_scale_ptr(k_scale, f, kv_cache);
  return p;
}

// Output allocated here, on the inputs' device; [1] float32.
cache::KvScaleParams kv_scale_params(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                     const std::string& kv_cache_dtype, at::Tensor* out) {
  const CacheFormat f = parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype");
  TORCH_CHECK_VALUE(is_quantized(f), "kv_cache_dtype: layer is not quantized ('", kv_cache_dtype,
                    "'); it computes no KV scale");
  TORCH_CHECK_VALUE(kv_c.dim() == 2 && k_pe.dim() == 2 && k_pe.size(0) == kv_c.size(0),
                    "kv_c, k_pe: expected [T, L] and [T, R], got ", kv_c.sizes(), " and ", k_pe.sizes());
  for (const auto* t : {&kv_c, &k_pe}) {
    const char* name = t == &kv_c ? "kv_c" : "k_pe";
    TORCH_CHECK_VALUE(is_native_dtype(t->scalar_type()) && t->scalar_type() == kv_c.scalar_type(), name,
                      ": expected bf16/fp16/fp32 (both the same), got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->size(1) <= 1 || t->stride(1) == 1, name, ": the last dim must be contiguous");
    check_same_device(*t, kv_c, name);
  }
  TORCH_CHECK_VALUE(kv_c.size(0) < INT32_MAX, "kv_c: too many tokens");
  *out = at::empty({1}, kv_c.options().dtype(at::kFloat));
  cache::KvScaleParams p{};
  set_input_rows(p, kv_c, k_pe);
  p.L = kv_c.size(1);
  p.R = k_pe.size(1);
  p.fp8_max = f == CacheFormat::kFp8E5M2 ? kE5M2Max : kE4M3Max;
  p.out = out->data_ptr<float>();
  return p;
}

void concat_and_cache_mla_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                              const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                              const at::Tensor& k_scale) {
  cache::write_cpu(write_params(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale));
}

void gather_and_maybe_dequant_cache_cpu(const at::Tensor& src_cache, const at::Tensor& dst,
                                        const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
                                        int64_t num_reqs, const std::string& kv_cache_dtype,
                                        const at::Tensor& k_scale,
                                        const std::optional<at::Tensor>& seq_starts) {
  cache::gather_cpu(dequant_gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs,
                                          kv_cache_dtype, k_scale, seq_starts));
}

void cp_gather_cache_cpu(const at::Tensor& src_cache, const at::Tensor& dst, const at::Tensor& block_table,
                         const at::Tensor& cu_seq_lens, int64_t num_reqs,
                         const std::optional<at::Tensor>& seq_starts) {
  cache::gather_cpu(cp_gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts));
}

at::Tensor compute_kv_scale_cpu(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                const std::string& kv_cache_dtype) {
  at::Tensor out;
  const cache::KvScaleParams p = kv_scale_params(kv_c, k_pe, kv_cache_dtype, &out);
  if (scale_kind(parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype")) != ScaleKind::kPerTensor) {
    out.fill_(1.0);  // fp8_ds_mla / nvfp4_ds_mla keep their scales inside the rows
    return out;
  }
  cache::kv_scale_cpu(p);
  return out;
}

#ifdef MLA_EXT_WITH_CUDA
void concat_and_cache_mla_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                               const at::Tensor& k_scale) {
  const cache::WriteParams p = write_params(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale);
  c10::cuda::CUDAGuard guard(kv_cache.device());
  if (p.num_tokens > 0) check_launch(cache::write_cuda(p, current_stream(kv_cache)), "concat_and_cache_mla");
}

void gather_and_maybe_dequant_cache_cuda(const at::Tensor& src_cache, const at::Tensor& dst,
                                         const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
                                         int64_t num_reqs, const std::string& kv_cache_dtype,
                                         const at::Tensor& k_scale,
                                         const std::optional<at::Tensor>& seq_starts) {
  const cache::GatherParams p = dequant_gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs,
                                                      kv_cache_dtype, k_scale, seq_starts);
  c10::cuda::CUDAGuard guard(src_cache.device());
  if (p.num_reqs > 0 && p.dst_rows > 0)
    check_launch(cache::gather_cuda(p, current_stream(src_cache)), "gather_and_maybe_dequant_cache");
}

void cp_gather_cache_cuda(const at::Tensor& src_cache, const at::Tensor& dst, const at::Tensor& block_table,
                          const at::Tensor& cu_seq_lens, int64_t num_reqs,
                          const std::optional<at::Tensor>& seq_starts) {
  const cache::GatherParams p = cp_gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts);
  c10::cuda::CUDAGuard guard(src_cache.device());
  if (p.num_reqs > 0 && p.dst_rows > 0) check_launch(cache::gather_cuda(p, current_stream(src_cache)), "cp_gather_cache");
}

at::Tensor compute_kv_scale_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe,
                                 const std::string& kv_cache_dtype) {
  c10::cuda::CUDAGuard guard(kv_c.device());
  at::Tensor out;
  const cache::KvScaleParams p = kv_scale_params(kv_c, k_pe, kv_cache_dtype, &out);
  if (scale_kind(parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype")) != ScaleKind::kPerTensor) {
    out.fill_(1.0);
    return out;
  }
  check_launch(cache::kv_scale_cuda(p, current_stream(kv_c)), "compute_kv_scale");
  return out;
}
#endif

}  // namespace
}  // namespace mla_ext

TORCH_LIBRARY_IMPL(mla_ext, CPU, m) {
  m.impl("concat_and_cache_mla", &mla_ext::concat_and_cache_mla_cpu);
  m.impl("gather_and_maybe_dequant_cache", &mla_ext::gather_and_maybe_dequant_cache_cpu);
  m.impl("cp_gather_cache", &mla_ext::cp_gather_cache_cpu);
  m.impl("compute_kv_scale", &mla_ext::compute_kv_scale_cpu);
}

#ifdef MLA_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(mla_ext, CUDA, m) {
  m.impl("concat_and_cache_mla", &mla_ext::concat_and_cache_mla_cuda);
  m.impl("gather_and_maybe_dequant_cache", &mla_ext::gather_and_maybe_dequant_cache_cuda);
  m.impl("cp_gather_cache", &mla_ext::cp_gather_cache_cuda);
  m.impl("compute_kv_scale", &mla_ext::compute_kv_scale_cuda);
}
#endif
