// The only translation unit with torch headers: op schemas (TORCH_LIBRARY),
// CPU/CUDA kernel registration and argument checks. Kernels live in torch-free
// files under csrc/<stage>/ and are called through plain C++ launchers; fake
// (meta) kernels are registered in Python (mla_ext/_fake.py) so torch.compile
// can trace every op.
//
// Sections are per pipeline stage; keep each stage's checks next to its
// registration so a reader finds the contract of an op in one place.
#include <Python.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/cache_layout.h"

#ifdef MLA_EXT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#ifndef MLA_EXT_CUDA_ARCH_LIST
#define MLA_EXT_CUDA_ARCH_LIST ""
#endif
#ifndef MLA_EXT_CUDA_PTX
#define MLA_EXT_CUDA_PTX ""
#endif

// An importable (empty) Python module: loading it runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "mla_ext compiled ops", -1,
                               nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}

namespace mla_ext {
namespace {

// ---------------------------------------------------------------------------
// Common helpers
// ---------------------------------------------------------------------------

CacheFormat parse_format_or_throw(const std::string& name, const char* arg) {
  CacheFormat f;
  std::string known;
  for (int i = 0; i < kNumFormatNames; ++i) {
    known += (i ? ", " : "");
    known += kFormatNames[i].name;
  }
  TORCH_CHECK_VALUE(parse_cache_format(name.c_str(), &f), arg, ": unknown KV-cache format '",
                    name, "'; expected one of: ", known);
  return f;
}

// -- Memory overlap ---------------------------------------------------------
// An op must not write memory it also reads through another argument (nor
// write one location twice). The rules are exact for the layouts the ops take
// and conservative otherwise (mla_ext/cache/checks.py has the same rules for
// the Python API): every stride is >= 0 (torch has no negative strides).

// True unless the elements of `t` provably occupy distinct addresses: the
// dims of size > 1, by increasing stride, must each step past everything the
// smaller ones reach (an expand()ed dim has stride 0 and always fails).
bool may_self_overlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest element offset reached so far
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;  // stride 0 included
    reach += (size - 1) * stride;
  }
  return false;
}

// True unless `a` and `b` provably share no byte. Disjoint byte spans never
// overlap. Otherwise each tensor is a set of runs (its unit-stride last dim,
// or single elements) placed at multiples of its other strides; with P the
// gcd of all those strides (bytes) of both tensors, every byte of `a` sits at
// a residue in [a0, a0 + run_a) mod P and every byte of `b` in
// [b0, b0 + run_b) mod P, so disjoint residue ranges mean disjoint tensors:
// exact for column slices of one buffer and for interleaved rows.
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  int64_t period = 0;
  const auto span_and_run = [&period](const at::Tensor& t, int64_t* lo, int64_t* hi) {
    const int64_t e = t.element_size();
    const int64_t last = t.dim() - 1;
    const bool inner = last >= 0 && t.size(last) > 1 && t.stride(last) == 1;
    int64_t reach = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) <= 1) continue;
      reach += (t.size(d) - 1) * t.stride(d);
      if (!(inner && d == last)) period = std::gcd(period, t.stride(d) * e);
    }
    *lo = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
    *hi = *lo + (reach + 1) * e;
    return inner ? t.size(last) * e : e;
  };
  int64_t a_lo, a_hi, b_lo, b_hi;
  const int64_t run_a = span_and_run(a, &a_lo, &a_hi);
  const int64_t run_b = span_and_run(b, &b_lo, &b_hi);
  if (a_hi <= b_lo || b_hi <= a_lo) return false;
  if (period == 0) return true;  // two single runs whose spans intersect
  const int64_t d = ((b_lo - a_lo) % period + period) % period;
  return !(run_a <= d && d + run_b <= period);
}

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

void check_no_self_overlap(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(!may_self_overlap(t), arg, ": its elements overlap in memory (sizes ", t.sizes(),
                    ", strides ", t.strides(), "); expected a tensor whose elements are distinct, ",
                    "not an expand()ed or self-overlapping view");
}

// `written` (an output) against `read` (an input); `in_place`: the very same
// view is allowed (the kernel reads each row before writing it).
void check_no_overlap(const at::Tensor& written, const char* w_arg, const at::Tensor& read,
                      const char* r_arg, bool in_place = false) {
  if (in_place && same_view(written, read)) return;
  TORCH_CHECK_VALUE(!may_overlap(written, read), w_arg, " and ", r_arg,
                    ": share memory (the op writes ", w_arg, " while it reads ", r_arg,
                    "); expected separate memory", in_place ? std::string(" or exactly the same view") : "");
}

// ---------------------------------------------------------------------------
// Build facts and the format registry (foundation)
// ---------------------------------------------------------------------------

// [format_id, bytes_per_token, quant_mode, scale_kind, storage_elem_bytes,
//  entry_elems]; bytes_per_token is -1 when the format cannot hold (L, R).
// L and R stay int64 (a cast to int once made L = 2^32 + 512 look like 512);
// beyond +-2^40 the int64 byte counts could overflow, so those are refused.
std::vector<int64_t> format_info(const std::string& kv_cache_dtype, int64_t L, int64_t R,
                                 int64_t model_elem_bytes) {
  constexpr int64_t kMaxDim = int64_t{1} << 40;
  TORCH_CHECK_VALUE(model_elem_bytes == 2 || model_elem_bytes == 4,
                    "model_elem_bytes: expected 2 or 4, got ", model_elem_bytes);
  TORCH_CHECK_VALUE(L >= -kMaxDim && L <= kMaxDim, "L: expected a value in [-2^40, 2^40], got ", L);
  TORCH_CHECK_VALUE(R >= -kMaxDim && R <= kMaxDim, "R: expected a value in [-2^40, 2^40], got ", R);
  const CacheFormat f = parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype");
  const int e = static_cast<int>(model_elem_bytes);
  return {static_cast<int64_t>(f),
          bytes_per_token(f, L, R, e),
          static_cast<int64_t>(quant_mode(f)),
          static_cast<int64_t>(scale_kind(f)),
          storage_elem_bytes(f, e),
          entry_elems(f, L, R, e)};
}

// fp8_ds_mla byte offsets as the kernels see them.
std::vector<int64_t> ds_mla_layout() {
  return {ds_mla::kLatentDim, ds_mla::kRopeDim,     ds_mla::kTileSize,  ds_mla::kNumTiles,
          ds_mla::kLatentOffset, ds_mla::kScaleOffset, ds_mla::kRopeOffset, ds_mla::kEntryBytes};
}

std::string build_info() {
#ifdef MLA_EXT_WITH_CUDA
  return std::string("cuda=1|archs=") + MLA_EXT_CUDA_ARCH_LIST + "|ptx=" + MLA_EXT_CUDA_PTX;
#else
  return "cuda=0|archs=";
#endif
}

}  // namespace
}  // namespace mla_ext

// Each stage registers its schemas with its own TORCH_LIBRARY_FRAGMENT and its
// kernels with TORCH_LIBRARY_IMPL blocks in its section below, so stages can
// be added without touching each other.
TORCH_LIBRARY(mla_ext, m) {
  // --- foundation ---
  m.def("format_info(str kv_cache_dtype, int L, int R, int model_elem_bytes) -> int[]",
        &mla_ext::format_info);
  m.def("ds_mla_layout() -> int[]", &mla_ext::ds_mla_layout);
  m.def("build_info() -> str", &mla_ext::build_info);
}

// ===========================================================================
// Stage: cache (write / gather / cp_gather / compute_kv_scale)
// ===========================================================================

#include "cache/cache_kernels.h"

namespace mla_ext {
namespace {

// Checks of the cache ops, shared by the CPU and CUDA registrations; they
// fill the torch-free parameter blocks of csrc/cache/cache_kernels.h. They
// never read tensor data (no host sync); range checks of ids are the Python
// wrapper's `validate=True`.
cache::ElemType cache_elem_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return cache::ElemType::kBF16;
    case at::kHalf: return cache::ElemType::kF16;
    case at::kFloat: return cache::ElemType::kF32;
    default: return cache::ElemType::kU8;  // uint8 / float8 bytes
  }
}

bool is_native_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), arg, ": expected device ", ref.device(), ", got ",
                    t.device());
}

void check_cache_tensor(const at::Tensor& c, const char* arg) {
  TORCH_CHECK_VALUE(c.dim() == 3, arg, ": expected [num_blocks, block_size, entry], got shape ", c.sizes());
  TORCH_CHECK_VALUE(c.size(2) <= 1 || c.stride(2) == 1, arg,
                    ": the last dim must be contiguous (stride 1), got strides ", c.strides());
  TORCH_CHECK_VALUE(c.stride(0) >= 0 && c.stride(1) >= 0, arg, ": negative strides are not supported");
  TORCH_CHECK_VALUE(c.size(1) >= 1, arg, ": block_size must be >= 1");
  TORCH_CHECK_VALUE(c.size(0) < INT32_MAX && c.size(1) < INT32_MAX, arg, ": too many blocks");
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

void check_index_tensor(const at::Tensor& t, const at::Tensor& cache, int64_t dims, const char* arg) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, arg, ": expected int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, arg, ": expected ", dims, " dims, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, arg, ": the last dim must be contiguous");
  check_same_device(t, cache, arg);
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
  p.kv_c = static_cast<const uint8_t*>(kv_c.data_ptr());
  p.kv_c_row_stride = kv_c.stride(0) * kv_c.element_size();
  p.k_pe = static_cast<const uint8_t*>(k_pe.data_ptr());
  p.k_pe_row_stride = k_pe.stride(0) * k_pe.element_size();
  p.in_type = cache_elem_type(kv_c);
  p.num_tokens = static_cast<int32_t>(kv_c.size(0));
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
  p.kv_c = static_cast<const uint8_t*>(kv_c.data_ptr());
  p.kv_c_row_stride = kv_c.stride(0) * kv_c.element_size();
  p.k_pe = static_cast<const uint8_t*>(k_pe.data_ptr());
  p.k_pe_row_stride = k_pe.stride(0) * k_pe.element_size();
  p.in_type = cache_elem_type(kv_c);
  p.num_tokens = static_cast<int32_t>(kv_c.size(0));
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
void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, op, ": CUDA kernel launch failed with cudaError_t ", err);
}

void* cache_stream(const at::Tensor& t) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}

void concat_and_cache_mla_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                               const at::Tensor& k_scale) {
  const cache::WriteParams p = write_params(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale);
  c10::cuda::CUDAGuard guard(kv_cache.device());
  if (p.num_tokens > 0) check_launch(cache::write_cuda(p, cache_stream(kv_cache)), "concat_and_cache_mla");
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
    check_launch(cache::gather_cuda(p, cache_stream(src_cache)), "gather_and_maybe_dequant_cache");
}

void cp_gather_cache_cuda(const at::Tensor& src_cache, const at::Tensor& dst, const at::Tensor& block_table,
                          const at::Tensor& cu_seq_lens, int64_t num_reqs,
                          const std::optional<at::Tensor>& seq_starts) {
  const cache::GatherParams p = cp_gather_params(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts);
  c10::cuda::CUDAGuard guard(src_cache.device());
  if (p.num_reqs > 0 && p.dst_rows > 0) check_launch(cache::gather_cuda(p, cache_stream(src_cache)), "cp_gather_cache");
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
  check_launch(cache::kv_scale_cuda(p, cache_stream(kv_c)), "compute_kv_scale");
  return out;
}
#endif

}  // namespace
}  // namespace mla_ext

TORCH_LIBRARY_FRAGMENT(mla_ext, m) {
  // Argument order follows the upstream engine's ops of the same names.
  m.def("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "str kv_cache_dtype, Tensor k_scale) -> ()");
  m.def("gather_and_maybe_dequant_cache(Tensor src_cache, Tensor(a!) dst, Tensor block_table, "
        "Tensor cu_seq_lens, int num_reqs, str kv_cache_dtype, Tensor k_scale, "
        "Tensor? seq_starts=None) -> ()");
  m.def("cp_gather_cache(Tensor src_cache, Tensor(a!) dst, Tensor block_table, Tensor cu_seq_lens, "
        "int num_reqs, Tensor? seq_starts=None) -> ()");
  m.def("compute_kv_scale(Tensor kv_c, Tensor k_pe, str kv_cache_dtype) -> Tensor");
}

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

// ===========================================================================
// Stage: kv_b_proj (Marlin FP8 repack / GEMM)
// ===========================================================================

#include <cmath>
#include <tuple>

#include "kv_b_proj/marlin_fp8.h"

namespace mla_ext {
namespace {
namespace mf = marlin_fp8;

mf::ActKind marlin_act_kind(c10::ScalarType t, const char* arg) {
  TORCH_CHECK_VALUE(t == at::kBFloat16 || t == at::kHalf, arg,
                    ": expected torch.bfloat16 or torch.float16, got ", t);
  return t == at::kHalf ? mf::ActKind::kFp16 : mf::ActKind::kBf16;
}

void marlin_check_shape(int64_t N, int64_t K, int64_t group_size) {
  TORCH_CHECK_VALUE(N > 0, "N: expected > 0, got ", N);
  TORCH_CHECK_VALUE(K > 0 && K % mf::kTileK == 0, "K: expected a positive multiple of 16, got ", K);
  TORCH_CHECK_VALUE(group_size == -1 || group_size == mf::kGroupSize,
                    "group_size: expected -1 (per-channel) or 128, got ", group_size);
  TORCH_CHECK_VALUE(group_size == -1 || K % mf::kGroupSize == 0,
                    "K: expected a multiple of 128 with group_size=128, got ", K);
}

int64_t marlin_groups(int64_t K, int64_t group_size) { return group_size > 0 ? K / group_size : 1; }

const char* marlin_act_name(c10::ScalarType t) { return t == at::kHalf ? "torch.float16" : "torch.bfloat16"; }

// A failed launch (e.g. no kernel image for this GPU) must raise, not return
// an output that was never written.
[[maybe_unused]] void marlin_check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, op, ": CUDA kernel launch failed with cudaError_t ", err);
}

void marlin_check_aligned16(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, arg,
                    ": expected a 16-byte aligned data pointer (cp.async)");
}

// The packed pair in vLLM's Marlin layout (marlin_fp8.h): qweight int32
// [K/16, 4*N_pad], scales [G, N_pad] in the activation dtype; checked before every read.
void marlin_check_packed(const at::Tensor& qweight, const at::Tensor& scales, int64_t N, int64_t K,
                         int64_t group_size, c10::ScalarType act_dtype) {
  marlin_check_shape(N, K, group_size);
  const int64_t n_pad = mf::padded_n(N), G = marlin_groups(K, group_size);
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kInt, "qweight: expected torch.int32, got ",
                    qweight.scalar_type());
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.size(0) == K / mf::kTileK && qweight.size(1) == 4 * n_pad,
                    "qweight: expected shape [K/16, 4*N_pad] = [", K / mf::kTileK, ", ", 4 * n_pad,
                    "] (vLLM's Marlin layout, N_pad = N rounded up to 64), got ", qweight.sizes());
  TORCH_CHECK_VALUE(qweight.is_contiguous(), "qweight: expected a contiguous tensor");
  TORCH_CHECK_VALUE(scales.scalar_type() == act_dtype, "scales: expected ", marlin_act_name(act_dtype),
                    " (the activation dtype, exponent bias folded), got ", scales.scalar_type());
  TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == G && scales.size(1) == n_pad,
                    "scales: expected packed shape [G, N_pad] = [", G, ", ", n_pad, "], got ", scales.sizes());
  TORCH_CHECK_VALUE(scales.is_contiguous(), "scales: expected a contiguous tensor");
  TORCH_CHECK_VALUE(scales.device() == qweight.device(), "scales: expected device ", qweight.device(),
                    " (as qweight), got ", scales.device());
}

// fp8 [N, K] + fp32 scales ([N] per-channel, or [K/128, N] group-128) ->
// (qweight int32 [K/16, 4*N_pad], scales [G, N_pad] in act_dtype: times 2^fold in
// fp32, rounded once, permuted) -- vLLM's Marlin layout (marlin_fp8.h).
// Validation syncs the host once; this runs at weight-load time, not per step.
std::tuple<at::Tensor, at::Tensor> marlin_fp8_repack(const at::Tensor& w, const at::Tensor& scales,
                                                     int64_t group_size, c10::ScalarType act_dtype) {
  const mf::ActKind act = marlin_act_kind(act_dtype, "act_dtype");
  TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat8_e4m3fn, "w_fp8: expected torch.float8_e4m3fn, got ",
                    w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 2, "w_fp8: expected shape [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  marlin_check_shape(N, K, group_size);
  const int64_t G = marlin_groups(K, group_size), n_pad = mf::padded_n(N);
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat, "scales: expected torch.float32, got ",
                    scales.scalar_type());
  TORCH_CHECK_VALUE(scales.device() == w.device(), "scales: expected device ", w.device(), " (as w_fp8), got ",
                    scales.device());
  if (group_size == -1) {
    TORCH_CHECK_VALUE(scales.dim() == 1 && scales.size(0) == N, "scales: expected per-channel shape [", N,
                      "] for group_size=-1, got ", scales.sizes());
  } else {
    TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == G && scales.size(1) == N,
                      "scales: expected shape [K/128, N] = [", G, ", ", N, "] for group_size=128, got ",
                      scales.sizes());
  }
  const at::Tensor wc = w.contiguous().view(at::kByte);
  const at::Tensor sc = scales.reshape({G, N}).contiguous();
  TORCH_CHECK_VALUE(!wc.bitwise_and(0x7f).eq(0x7f).any().item<bool>(), "w_fp8: contains NaN (0x7f/0xff); ",
                    "NaN weights are not supported by the Marlin fp8 path");
  TORCH_CHECK_VALUE(sc.isfinite().all().item<bool>(), "scales: expected finite values");
  // Fold in fp32 (exact: a power of two), round once to the activation dtype.
  const double fold = std::ldexp(1.0, mf::fold_log2(act));
  const at::Tensor folded = (sc * fold).to(act_dtype).contiguous();
  TORCH_CHECK_VALUE(folded.isfinite().all().item<bool>(),
                    "scales: scale * 2^", mf::fold_log2(act), " (the exponent bias folded for ",
                    marlin_act_name(act_dtype), ") overflows it; expected |scale| below about 256");

  at::Tensor qweight = at::empty({K / mf::kTileK, 4 * n_pad}, wc.options().dtype(at::kInt));
  at::Tensor sp = at::empty({G, n_pad}, folded.options());
  mf::RepackParams p{};
  p.w = wc.data_ptr<uint8_t>();
  p.ldw = K;
  p.scales = reinterpret_cast<const uint16_t*>(folded.data_ptr());
  p.N = N, p.K = K, p.G = G, p.grouped = mf::grouped_scales(K, group_size);
  p.qweight = reinterpret_cast<uint32_t*>(qweight.data_ptr<int32_t>());
  p.scales_out = reinterpret_cast<uint16_t*>(sp.data_ptr());
  if (w.is_cpu()) {
    mf::marlin_fp8_repack_cpu(p);
  } else {
#ifdef MLA_EXT_WITH_CUDA
    TORCH_CHECK_VALUE(w.is_cuda(), "w_fp8: expected a CPU or CUDA tensor, got ", w.device());
    c10::cuda::CUDAGuard guard(w.device());
    marlin_check_launch(mf::marlin_fp8_repack_cuda(p, c10::cuda::getCurrentCUDAStream().stream()),
                        "marlin_fp8_repack");
#else
    TORCH_CHECK_VALUE(false, "w_fp8: expected a CPU tensor (built without CUDA), got ", w.device());
#endif
  }
  return {qweight, sp};
}

// The packed weight decoded back to fp32 [N, K] (decode x scale), reading qweight.
at::Tensor marlin_fp8_dequantize(const at::Tensor& qweight, const at::Tensor& scales, int64_t N, int64_t K,
                                 int64_t group_size, c10::ScalarType act_dtype) {
  const mf::ActKind act = marlin_act_kind(act_dtype, "act_dtype");
  marlin_check_packed(qweight, scales, N, K, group_size, act_dtype);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  mf::DequantParams p{};
  p.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  p.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  p.N = N, p.K = K, p.group_size = group_size, p.act = act;
  p.out = out.data_ptr<float>();
  if (qweight.is_cpu()) {
    mf::marlin_fp8_dequantize_cpu(p);
  } else {
#ifdef MLA_EXT_WITH_CUDA
    TORCH_CHECK_VALUE(qweight.is_cuda(), "qweight: expected a CPU or CUDA tensor, got ", qweight.device());
    c10::cuda::CUDAGuard guard(qweight.device());
    marlin_check_launch(mf::marlin_fp8_dequantize_cuda(p, c10::cuda::getCurrentCUDAStream().stream()),
                        "marlin_fp8_dequantize");
#else
    TORCH_CHECK_VALUE(false, "qweight: expected a CPU tensor (built without CUDA), got ", qweight.device());
#endif
  }
  return out;
}

// C[M, N] = a[M, K] · dequant(W)^T. `a` may be a row-strided view (stride(0) >= K,
// stride(1) == 1). CPU: the packed-layout reference; CUDA: the split-K mma.sync
// kernel (marlin_fp8_gemm_v2.cu; split_k 0 = chosen from the shapes and the SM
// count). On the CPU the reference reproduces the kernel's slicing (split_k 0
// there: one slice).
at::Tensor marlin_fp8_gemm(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales, int64_t N,
                           int64_t K, int64_t group_size, c10::ScalarType act_dtype,
                           std::optional<c10::ScalarType> out_dtype, int64_t split_k) {
  const mf::ActKind act = marlin_act_kind(act_dtype, "act_dtype");
  marlin_check_packed(qweight, scales, N, K, group_size, act_dtype);
  TORCH_CHECK_VALUE(a.scalar_type() == act_dtype, "a: expected dtype ", act_dtype,
                    " (the dtype the weight was packed for), got ", a.scalar_type());
  TORCH_CHECK_VALUE(a.dim() == 2 && a.size(1) == K, "a: expected shape [M, ", K, "], got ", a.sizes());
  TORCH_CHECK_VALUE(a.stride(1) == 1, "a: expected a contiguous last dim (stride 1), got stride ", a.stride(1));
  TORCH_CHECK_VALUE(a.device() == qweight.device(), "a: expected device ", qweight.device(),
                    " (as qweight), got ", a.device());
  const c10::ScalarType odt = out_dtype.value_or(act_dtype);
  TORCH_CHECK_VALUE(odt == at::kBFloat16 || odt == at::kHalf || odt == at::kFloat,
                    "out_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got ", odt);
  TORCH_CHECK_VALUE(split_k >= 0 && split_k <= mf::kV2MaxSplit, "split_k: expected 0 (automatic) to ",
                    mf::kV2MaxSplit, ", got ", split_k);
  const int64_t M = a.size(0);
  mf::GemmParams p{};
  p.a = reinterpret_cast<const uint16_t*>(a.data_ptr());
  p.lda = M > 1 ? a.stride(0) : K;
  p.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  p.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  p.M = M, p.N = N, p.K = K, p.group_size = group_size, p.act = act;
  if (a.is_cpu()) {
    // No SM count on the CPU: split_k 0 is one slice.
    p.slice_tiles = mf::plan_v2(M, N, K, group_size, 0, split_k).slice_tiles;
    at::Tensor c = at::empty({M, N}, a.options().dtype(at::kFloat));
    p.c = c.data_ptr<float>();
    p.ldc = N;
    p.out = mf::OutKind::kFp32;
    if (M > 0) mf::marlin_fp8_gemm_cpu(p);
    return c.to(odt);
  }
#ifdef MLA_EXT_WITH_CUDA
  TORCH_CHECK_VALUE(a.is_cuda(), "a: expected a CPU or CUDA tensor, got ", a.device());
  TORCH_CHECK_VALUE(M <= 1 || a.stride(0) % 8 == 0, "a: expected a row stride that is a multiple of 8 ",
                    "elements (16-byte rows for cp.async), got ", a.stride(0));
  marlin_check_aligned16(a, "a");
  marlin_check_aligned16(qweight, "qweight");
  marlin_check_aligned16(scales, "scales");
  at::Tensor c = at::empty({M, N}, a.options().dtype(odt));
  p.c = c.data_ptr();
  p.ldc = N;
  p.out = odt == at::kFloat ? mf::OutKind::kFp32 : (odt == at::kHalf ? mf::OutKind::kFp16 : mf::OutKind::kBf16);
  c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const mf::GemmV2Plan plan =
      mf::plan_v2(M, N, K, group_size, mf::marlin_fp8_device_sm_count(a.device().index()), split_k);
  p.slice_tiles = plan.slice_tiles;
  at::Tensor workspace, counters;  // split-K partials and per-tile tickets (graph-safe: allocator + memset)
  if (plan.split > 1 && M > 0) {
    workspace = at::empty({plan.workspace_floats}, a.options().dtype(at::kFloat));
    counters = at::zeros({plan.counters}, a.options().dtype(at::kInt));
    p.workspace = workspace.data_ptr<float>();
    p.counters = counters.data_ptr<int32_t>();
  }
  marlin_check_launch(mf::marlin_fp8_gemm_v2_cuda(p, plan, stream), "marlin_fp8_gemm");
  return c;
#else
  TORCH_CHECK_VALUE(false, "a: expected a CPU tensor (built without CUDA), got ", a.device());
#endif
}

}  // namespace
}  // namespace mla_ext

TORCH_LIBRARY_FRAGMENT(mla_ext, m) {
  m.def("marlin_fp8_repack(Tensor w_fp8, Tensor scales, int group_size, ScalarType act_dtype) -> (Tensor, Tensor)");
  m.def("marlin_fp8_dequantize(Tensor qweight, Tensor scales, int N, int K, int group_size, "
        "ScalarType act_dtype) -> Tensor");
  m.def("marlin_fp8_gemm(Tensor a, Tensor qweight, Tensor scales, int N, int K, int group_size, "
        "ScalarType act_dtype, ScalarType? out_dtype=None, int split_k=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(mla_ext, CPU, m) {
  m.impl("marlin_fp8_repack", &mla_ext::marlin_fp8_repack);
  m.impl("marlin_fp8_dequantize", &mla_ext::marlin_fp8_dequantize);
  m.impl("marlin_fp8_gemm", &mla_ext::marlin_fp8_gemm);
}

#ifdef MLA_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(mla_ext, CUDA, m) {
  m.impl("marlin_fp8_repack", &mla_ext::marlin_fp8_repack);
  m.impl("marlin_fp8_dequantize", &mla_ext::marlin_fp8_dequantize);
  m.impl("marlin_fp8_gemm", &mla_ext::marlin_fp8_gemm);
}
#endif

// ===========================================================================
// Stage: attention (merge_attn_states)
// ===========================================================================

#include "attention/merge_states.h"

namespace mla_ext {
namespace {

// Argument checks shared by the CPU and CUDA registrations; fills the
// torch-free parameter block the kernels take.
MergeParams merge_params(at::Tensor& output, const std::optional<at::Tensor>& output_lse,
                         const at::Tensor& prefix_output, const at::Tensor& prefix_lse,
                         const at::Tensor& suffix_output, const at::Tensor& suffix_lse) {
  TORCH_CHECK_VALUE(output.dim() == 3, "output: expected [T, N, D], got ", output.dim(), " dims");
  const int64_t T = output.size(0), N = output.size(1), D = output.size(2);
  const auto check_o = [&](const at::Tensor& x, const char* name) {
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(0) == T && x.size(1) == N && x.size(2) == D, name,
                      ": expected shape [", T, ", ", N, ", ", D, "] (as output), got ", x.sizes());
    TORCH_CHECK_VALUE(x.scalar_type() == output.scalar_type(), name, ": expected dtype ",
                      output.scalar_type(), " (as output), got ", x.scalar_type());
    TORCH_CHECK_VALUE(D <= 1 || x.stride(2) == 1, name, ": the head dim must be contiguous (stride 1), got ",
                      x.stride(2));
    TORCH_CHECK_VALUE(x.device() == output.device(), name, ": expected device ", output.device(),
                      ", got ", x.device());
  };
  const auto check_lse = [&](const at::Tensor& x, const char* name) {
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) == N && x.size(1) == T, name, ": expected shape [", N,
                      ", ", T, "] ([num_heads, num_tokens]), got ", x.sizes());
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, name, ": expected dtype float32, got ",
                      x.scalar_type());
    TORCH_CHECK_VALUE(x.device() == output.device(), name, ": expected device ", output.device(),
                      ", got ", x.device());
  };
  check_o(output, "output");
  check_o(prefix_output, "prefix_output");
  check_o(suffix_output, "suffix_output");
  check_lse(prefix_lse, "prefix_lse");
  check_lse(suffix_lse, "suffix_lse");
  if (output_lse.has_value()) check_lse(*output_lse, "output_lse");
  // Outputs may be exactly an input of their kind (in-place merge), never a
  // shifted or partial view of any input, nor overlap each other.
  check_no_self_overlap(output, "output");
  check_no_overlap(output, "output", prefix_output, "prefix_output", /*in_place=*/true);
  check_no_overlap(output, "output", suffix_output, "suffix_output", /*in_place=*/true);
  check_no_overlap(output, "output", prefix_lse, "prefix_lse");
  check_no_overlap(output, "output", suffix_lse, "suffix_lse");
  if (output_lse.has_value()) {
    check_no_self_overlap(*output_lse, "output_lse");
    check_no_overlap(*output_lse, "output_lse", prefix_lse, "prefix_lse", /*in_place=*/true);
    check_no_overlap(*output_lse, "output_lse", suffix_lse, "suffix_lse", /*in_place=*/true);
    check_no_overlap(*output_lse, "output_lse", prefix_output, "prefix_output");
    check_no_overlap(*output_lse, "output_lse", suffix_output, "suffix_output");
    check_no_overlap(*output_lse, "output_lse", output, "output");
  }

  MergeParams p{};
  switch (output.scalar_type()) {
    case at::kFloat: p.dtype = MergeDType::kFloat32; break;
    case at::kHalf: p.dtype = MergeDType::kFloat16; break;
    case at::kBFloat16: p.dtype = MergeDType::kBFloat16; break;
    default:
      TORCH_CHECK_VALUE(false, "output: expected dtype bfloat16, float16 or float32, got ",
                        output.scalar_type());
  }
  p.out = output.data_ptr();
  p.out_lse = output_lse.has_value() ? output_lse->data_ptr<float>() : nullptr;
  p.prefix_o = prefix_output.data_ptr();
  p.prefix_lse = prefix_lse.data_ptr<float>();
  p.suffix_o = suffix_output.data_ptr();
  p.suffix_lse = suffix_lse.data_ptr<float>();
  p.num_tokens = T;
  p.num_heads = N;
  p.head_size = D;
  p.out_st = output.stride(0);
  p.out_sh = output.stride(1);
  p.prefix_st = prefix_output.stride(0);
  p.prefix_sh = prefix_output.stride(1);
  p.suffix_st = suffix_output.stride(0);
  p.suffix_sh = suffix_output.stride(1);
  if (output_lse.has_value()) {
    p.out_lse_sh = output_lse->stride(0);
    p.out_lse_st = output_lse->stride(1);
  }
  p.prefix_lse_sh = prefix_lse.stride(0);
  p.prefix_lse_st = prefix_lse.stride(1);
  p.suffix_lse_sh = suffix_lse.stride(0);
  p.suffix_lse_st = suffix_lse.stride(1);
  return p;
}

void merge_attn_states_cpu_op(at::Tensor output, std::optional<at::Tensor> output_lse,
                              at::Tensor prefix_output, at::Tensor prefix_lse,
                              at::Tensor suffix_output, at::Tensor suffix_lse) {
  const MergeParams p =
      merge_params(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse);
  TORCH_CHECK_VALUE(output.device().is_cpu(), "output: expected a CPU tensor, got ", output.device());
  merge_attn_states_cpu(p);
}

#ifdef MLA_EXT_WITH_CUDA
void merge_attn_states_cuda_op(at::Tensor output, std::optional<at::Tensor> output_lse,
                               at::Tensor prefix_output, at::Tensor prefix_lse,
                               at::Tensor suffix_output, at::Tensor suffix_lse) {
  const MergeParams p =
      merge_params(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse);
  TORCH_CHECK_VALUE(output.is_cuda(), "output: expected a CUDA tensor, got ", output.device());
  const c10::cuda::CUDAGuard guard(output.device());
  const int err = merge_attn_states_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "merge_attn_states: CUDA kernel launch failed with cudaError_t ", err);
}
#endif

}  // namespace
}  // namespace mla_ext

TORCH_LIBRARY_FRAGMENT(mla_ext, m) {
  // Argument order matches the upstream engine's op of the same name.
  m.def(
      "merge_attn_states(Tensor! output, Tensor!? output_lse, Tensor prefix_output, "
      "Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse) -> ()");
}

TORCH_LIBRARY_IMPL(mla_ext, CPU, m) {
  m.impl("merge_attn_states", &mla_ext::merge_attn_states_cpu_op);
}

#ifdef MLA_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(mla_ext, CUDA, m) {
  m.impl("merge_attn_states", &mla_ext::merge_attn_states_cuda_op);
}
#endif

// ===========================================================================
// Stage: sparse (the DSA indexer key cache: format facts, writer, gather)
// ===========================================================================

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
  check_launch(ic::write_cuda(p, cache_stream(cache)), "index_cache_write");
}

void index_cache_gather_cuda(const at::Tensor& cache, const at::Tensor& dst, const at::Tensor& block_table,
                             const at::Tensor& cu_seq_lens, const std::string& index_cache_dtype, int64_t head_dim,
                             const std::optional<at::Tensor>& seq_starts,
                             const std::optional<at::Tensor>& dst_scale) {
  const ic::GatherParams p = index_gather_params(cache, dst, block_table, cu_seq_lens, index_cache_dtype,
                                                 head_dim, seq_starts, dst_scale);
  c10::cuda::CUDAGuard guard(cache.device());
  check_launch(ic::gather_cuda(p, cache_stream(cache)), "index_cache_gather");
}
#endif

}  // namespace
}  // namespace mla_ext

TORCH_LIBRARY_FRAGMENT(mla_ext, m) {
  m.def("index_cache_format_info(str index_cache_dtype, int head_dim, int quant_block_size, int block_size) "
        "-> int[]", &mla_ext::index_cache_format_info);
  m.def("index_cache_write(Tensor k, Tensor(a!) cache, Tensor slot_mapping, str index_cache_dtype, "
        "int quant_block_size=0, str scale_fmt=\"\") -> ()");
  m.def("index_cache_gather(Tensor cache, Tensor(a!) dst, Tensor block_table, Tensor cu_seq_lens, "
        "str index_cache_dtype, int head_dim, Tensor? seq_starts=None, Tensor(b!)? dst_scale=None) -> ()");
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
