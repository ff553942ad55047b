// Torch binding of the attention stage's merge_attn_states: argument checks and the
// torch-free parameter block of merge_states.h. Schema: csrc/registration.cpp.
#include "common/torch_checks.h"

#include <optional>

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
  check_launch(merge_attn_states_cuda(p, current_stream(output)), "merge_attn_states");
}
#endif

}  // namespace
}  // namespace mla_ext

TORCH_LIBRARY_IMPL(mla_ext, CPU, m) {
  m.impl("merge_attn_states", &mla_ext::merge_attn_states_cpu_op);
}

#ifdef MLA_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(mla_ext, CUDA, m) {
  m.impl("merge_attn_states", &mla_ext::merge_attn_states_cuda_op);
}
#endif
