// merge_attn_states (SPEC §7): torch-free parameter block and launchers.
//
// Merges two partial attention results (o, lse) computed over disjoint key
// sets into the result over their union:
//   m = max(lse1, lse2); w1 = exp(lse1 - m); w2 = exp(lse2 - m)
//   o = (w1*o1 + w2*o2) / (w1 + w2);  lse = m + log(w1 + w2)
// with +inf LSE treated as -inf, an empty (-inf) side contributing nothing
// (its o is not read into the result), and two empty sides giving o = 0,
// lse = -inf. Math in fp32 whatever the storage dtype.
//
// Every tensor carries its own strides (in elements) because the prefix and
// the suffix can be views with different head strides (an upstream kernel
// derived the suffix offset from the prefix stride and silently corrupted
// memory). The head dim must be contiguous. `out` may alias `prefix_o` or
// `suffix_o` exactly, and `out_lse` may alias either LSE: each (token, head)
// row is read completely before it is written.
#pragma once

#include <cstdint>

namespace mla_ext {

enum class MergeDType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct MergeParams {
  void* out;             // [T, N, D], dtype `dtype`
  float* out_lse;        // [N, T] or nullptr
  const void* prefix_o;  // [T, N, D]
  const float* prefix_lse;  // [N, T]
  const void* suffix_o;  // [T, N, D]
  const float* suffix_lse;  // [N, T]
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_size;
  // Element strides of the [T, N, D] tensors (token, head); head dim stride is 1.
  int64_t out_st, out_sh;
  int64_t prefix_st, prefix_sh;
  int64_t suffix_st, suffix_sh;
  // Element strides of the [N, T] LSE tensors (head, token).
  int64_t out_lse_sh, out_lse_st;
  int64_t prefix_lse_sh, prefix_lse_st;
  int64_t suffix_lse_sh, suffix_lse_st;
  MergeDType dtype;
};

// OpenMP over (token, head) rows; safe for any strides.
void merge_attn_states_cpu(const MergeParams& p);

#ifdef MLA_EXT_WITH_CUDA
// Enqueues on `stream` (a cudaStream_t); never synchronises the host. Uses
// 16-byte vector accesses when every pointer and row stride allows it,
// otherwise element accesses. Returns the cudaError_t of the launch (0 = success).
int merge_attn_states_cuda(const MergeParams& p, void* stream);
#endif

}  // namespace mla_ext
