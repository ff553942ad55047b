// The foundation ops: build facts and the KV-cache format registry as the
// kernels see them (format_info, ds_mla_layout, build_info). Schemas:
// csrc/registration.cpp.
#include <string>
#include <vector>

#include "common/torch_checks.h"

#ifndef MLA_EXT_CUDA_ARCH_LIST
#define MLA_EXT_CUDA_ARCH_LIST ""
#endif
#ifndef MLA_EXT_CUDA_PTX
#define MLA_EXT_CUDA_PTX ""
#endif

namespace mla_ext {
namespace {

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

// No tensor arguments: CompositeImplicitAutograd kernels serve every call.
TORCH_LIBRARY_IMPL(mla_ext, CompositeImplicitAutograd, m) {
  m.impl("format_info", &mla_ext::format_info);
  m.impl("ds_mla_layout", &mla_ext::ds_mla_layout);
  m.impl("build_info", &mla_ext::build_info);
}
