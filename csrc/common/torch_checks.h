// Torch-side helpers shared by the per-stage binding files (csrc/<stage>/*_ops.cpp):
// format-name parsing, the memory-overlap rules, device / dtype / index-tensor
// checks and the CUDA launch check. Binding files only: kernel sources stay
// torch-free. They never read tensor data (no host sync).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/cache_layout.h"

#ifdef MLA_EXT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mla_ext {

inline CacheFormat parse_format_or_throw(const std::string& name, const char* arg) {
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
inline bool may_self_overlap(const at::Tensor& t) {
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
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
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

inline bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

inline void check_no_self_overlap(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(!may_self_overlap(t), arg, ": its elements overlap in memory (sizes ", t.sizes(),
                    ", strides ", t.strides(), "); expected a tensor whose elements are distinct, ",
                    "not an expand()ed or self-overlapping view");
}

// `written` (an output) against `read` (an input); `in_place`: the very same
// view is allowed (the kernel reads each row before writing it).
inline void check_no_overlap(const at::Tensor& written, const char* w_arg, const at::Tensor& read,
                      const char* r_arg, bool in_place = false) {
  if (in_place && same_view(written, read)) return;
  TORCH_CHECK_VALUE(!may_overlap(written, read), w_arg, " and ", r_arg,
                    ": share memory (the op writes ", w_arg, " while it reads ", r_arg,
                    "); expected separate memory", in_place ? std::string(" or exactly the same view") : "");
}

inline bool is_native_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* arg) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), arg, ": expected device ", ref.device(), ", got ",
                    t.device());
}

inline void check_cache_tensor(const at::Tensor& c, const char* arg) {
  TORCH_CHECK_VALUE(c.dim() == 3, arg, ": expected [num_blocks, block_size, entry], got shape ", c.sizes());
  TORCH_CHECK_VALUE(c.size(2) <= 1 || c.stride(2) == 1, arg,
                    ": the last dim must be contiguous (stride 1), got strides ", c.strides());
  TORCH_CHECK_VALUE(c.stride(0) >= 0 && c.stride(1) >= 0, arg, ": negative strides are not supported");
  TORCH_CHECK_VALUE(c.size(1) >= 1, arg, ": block_size must be >= 1");
  TORCH_CHECK_VALUE(c.size(0) < INT32_MAX && c.size(1) < INT32_MAX, arg, ": too many blocks");
}

inline void check_index_tensor(const at::Tensor& t, const at::Tensor& cache, int64_t dims, const char* arg) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, arg, ": expected int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dims, arg, ": expected ", dims, " dims, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, arg, ": the last dim must be contiguous");
  check_same_device(t, cache, arg);
}

#ifdef MLA_EXT_WITH_CUDA
// A failed launch (e.g. no kernel image for this GPU) must raise, not return
// an output that was never written.
inline void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, op, ": CUDA kernel launch failed with cudaError_t ", err);
}

inline void* current_stream(const at::Tensor& t) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}
#endif

}  // namespace mla_ext
