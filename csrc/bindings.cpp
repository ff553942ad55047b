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
