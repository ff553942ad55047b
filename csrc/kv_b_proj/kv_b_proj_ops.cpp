// Torch binding of the kv_b_proj stage's Marlin FP8 ops (repack, dequantize, GEMM):
// argument checks and the torch-free parameter blocks of marlin_fp8.h.
// Schemas: csrc/registration.cpp.
#include "common/torch_checks.h"

#include <cmath>
#include <optional>
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
    check_launch(mf::marlin_fp8_repack_cuda(p, c10::cuda::getCurrentCUDAStream().stream()),
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
    check_launch(mf::marlin_fp8_dequantize_cuda(p, c10::cuda::getCurrentCUDAStream().stream()),
                        "marlin_fp8_dequantize");
#else
    TORCH_CHECK_VALUE(false, "qweight: expected a CPU tensor (built without CUDA), got ", qweight.device());
#endif
  }
  return out;
}

// C[M, N] = a[M, K] · dequant(W)^T. `a` may be a row-strided view (stride(0) >= K,
// stride(1) == 1). CPU: the packed-layout reference; CUDA: the split-K mma.sync
// kernel (marlin_fp8_gemm.cu; split_k 0 = chosen from the shapes and the SM
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
  TORCH_CHECK_VALUE(split_k >= 0 && split_k <= mf::kMaxSplit, "split_k: expected 0 (automatic) to ",
                    mf::kMaxSplit, ", got ", split_k);
  const int64_t M = a.size(0);
  mf::GemmParams p{};
  p.a = reinterpret_cast<const uint16_t*>(a.data_ptr());
  p.lda = M > 1 ? a.stride(0) : K;
  p.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  p.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  p.M = M, p.N = N, p.K = K, p.group_size = group_size, p.act = act;
  if (a.is_cpu()) {
    // No SM count on the CPU: split_k 0 is one slice.
    p.slice_tiles = mf::plan_gemm(M, N, K, group_size, 0, split_k).slice_tiles;
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
  const mf::GemmPlan plan =
      mf::plan_gemm(M, N, K, group_size, mf::marlin_fp8_device_sm_count(a.device().index()), split_k);
  p.slice_tiles = plan.slice_tiles;
  at::Tensor workspace, counters;  // split-K partials and per-tile tickets (graph-safe: allocator + memset)
  if (plan.split > 1 && M > 0) {
    workspace = at::empty({plan.workspace_floats}, a.options().dtype(at::kFloat));
    counters = at::zeros({plan.counters}, a.options().dtype(at::kInt));
    p.workspace = workspace.data_ptr<float>();
    p.counters = counters.data_ptr<int32_t>();
  }
  check_launch(mf::marlin_fp8_gemm_cuda(p, plan, stream), "marlin_fp8_gemm");
  return c;
#else
  TORCH_CHECK_VALUE(false, "a: expected a CPU tensor (built without CUDA), got ", a.device());
#endif
}

}  // namespace
}  // namespace mla_ext

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
