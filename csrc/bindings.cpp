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

#include <string>
#include <vector>

#include "common/cache_layout.h"

#ifdef MLA_EXT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#ifndef MLA_EXT_CUDA_ARCH_LIST
#define MLA_EXT_CUDA_ARCH_LIST ""
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

// ---------------------------------------------------------------------------
// Build facts and the format registry (foundation)
// ---------------------------------------------------------------------------

// [format_id, bytes_per_token, quant_mode, scale_kind, storage_elem_bytes,
//  entry_elems]; bytes_per_token is -1 when the format cannot hold (L, R).
std::vector<int64_t> format_info(const std::string& kv_cache_dtype, int64_t L, int64_t R,
                                 int64_t model_elem_bytes) {
  TORCH_CHECK_VALUE(model_elem_bytes == 2 || model_elem_bytes == 4,
                    "model_elem_bytes: expected 2 or 4, got ", model_elem_bytes);
  const CacheFormat f = parse_format_or_throw(kv_cache_dtype, "kv_cache_dtype");
  const int l = static_cast<int>(L), r = static_cast<int>(R), e = static_cast<int>(model_elem_bytes);
  return {static_cast<int64_t>(f),
          bytes_per_token(f, l, r, e),
          static_cast<int64_t>(quant_mode(f)),
          static_cast<int64_t>(scale_kind(f)),
          storage_elem_bytes(f, e),
          entry_elems(f, l, r, e)};
}

// fp8_ds_mla byte offsets as the kernels see them.
std::vector<int64_t> ds_mla_layout() {
  return {ds_mla::kLatentDim, ds_mla::kRopeDim,     ds_mla::kTileSize,  ds_mla::kNumTiles,
          ds_mla::kLatentOffset, ds_mla::kScaleOffset, ds_mla::kRopeOffset, ds_mla::kEntryBytes};
}

std::string build_info() {
#ifdef MLA_EXT_WITH_CUDA
  return std::string("cuda=1|archs=") + MLA_EXT_CUDA_ARCH_LIST;
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

// ===========================================================================
// Stage: kv_b_proj (Marlin FP8 repack / GEMM)
// ===========================================================================

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
  merge_attn_states_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
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
