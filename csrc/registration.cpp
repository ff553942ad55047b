// The extension module and every op schema of the mla_ext library, in one place.
// Each stage's checks and CPU/CUDA kernels are registered (TORCH_LIBRARY_IMPL)
// beside its kernels: csrc/common/info_ops.cpp, csrc/cache/cache_ops.cpp,
// csrc/kv_b_proj/kv_b_proj_ops.cpp, csrc/attention/attention_ops.cpp,
// csrc/sparse/sparse_ops.cpp. Fake (meta) kernels: mla_ext/_fake.py.
#include <Python.h>
#include <torch/library.h>

// An importable (empty) Python module: loading it runs the registrations.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "mla_ext compiled ops", -1,
                               nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(mla_ext, m) {
  // foundation (csrc/common/info_ops.cpp)
  m.def("format_info(str kv_cache_dtype, int L, int R, int model_elem_bytes) -> int[]");
  m.def("ds_mla_layout() -> int[]");
  m.def("build_info() -> str");

  // cache (csrc/cache/cache_ops.cpp)
  // Argument order follows the upstream engine's ops of the same names.
  m.def("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "str kv_cache_dtype, Tensor k_scale) -> ()");
  m.def("gather_and_maybe_dequant_cache(Tensor src_cache, Tensor(a!) dst, Tensor block_table, "
        "Tensor cu_seq_lens, int num_reqs, str kv_cache_dtype, Tensor k_scale, "
        "Tensor? seq_starts=None) -> ()");
  m.def("cp_gather_cache(Tensor src_cache, Tensor(a!) dst, Tensor block_table, Tensor cu_seq_lens, "
        "int num_reqs, Tensor? seq_starts=None) -> ()");
  m.def("compute_kv_scale(Tensor kv_c, Tensor k_pe, str kv_cache_dtype) -> Tensor");

  // kv_b_proj (csrc/kv_b_proj/kv_b_proj_ops.cpp)
  m.def("marlin_fp8_repack(Tensor w_fp8, Tensor scales, int group_size, ScalarType act_dtype) -> (Tensor, Tensor)");
  m.def("marlin_fp8_dequantize(Tensor qweight, Tensor scales, int N, int K, int group_size, "
        "ScalarType act_dtype) -> Tensor");
  m.def("marlin_fp8_gemm(Tensor a, Tensor qweight, Tensor scales, int N, int K, int group_size, "
        "ScalarType act_dtype, ScalarType? out_dtype=None, int split_k=0) -> Tensor");

  // attention (csrc/attention/attention_ops.cpp)
  // Argument order matches the upstream engine's op of the same name.
  m.def(
      "merge_attn_states(Tensor! output, Tensor!? output_lse, Tensor prefix_output, "
      "Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse) -> ()");

  // sparse (csrc/sparse/sparse_ops.cpp)
  m.def("index_cache_format_info(str index_cache_dtype, int head_dim, int quant_block_size, int block_size) "
        "-> int[]");
  m.def("index_cache_write(Tensor k, Tensor(a!) cache, Tensor slot_mapping, str index_cache_dtype, "
        "int quant_block_size=0, str scale_fmt=\"\") -> ()");
  m.def("index_cache_gather(Tensor cache, Tensor(a!) dst, Tensor block_table, Tensor cu_seq_lens, "
        "str index_cache_dtype, int head_dim, Tensor? seq_starts=None, Tensor(b!)? dst_scale=None) -> ()");
}
