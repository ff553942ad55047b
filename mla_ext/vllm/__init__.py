"""vLLM-compatible op surface: ``from mla_ext.vllm import _custom_ops as ops``.

`_custom_ops` mirrors the module name of vLLM 0.33's ``vllm/_custom_ops.py``
for the MLA prefill-with-context ops (same names, argument order, keyword
names, defaults, in-place outputs); each is a torch op in the
``mla_ext_vllm`` namespace with a fake kernel. See that module's docstring
for how each op is backed and where it differs from vLLM.
"""
from mla_ext.vllm import _custom_ops
from mla_ext.vllm._custom_ops import (  # noqa: F401
    NAMESPACE,
    concat_and_cache_mla,
    cp_gather_and_upconvert_fp8_kv_cache,
    cp_gather_cache,
    gather_and_maybe_dequant_cache,
    merge_attn_states,
)

__all__ = [
    "_custom_ops",
    "NAMESPACE",
    "concat_and_cache_mla",
    "cp_gather_and_upconvert_fp8_kv_cache",
    "cp_gather_cache",
    "gather_and_maybe_dequant_cache",
    "merge_attn_states",
]

# Present exactly when mla_ext.config.formats has the nvfp4_ds_mla format.
if hasattr(_custom_ops, "cp_gather_and_upconvert_nvfp4_kv_cache"):
    cp_gather_and_upconvert_nvfp4_kv_cache = _custom_ops.cp_gather_and_upconvert_nvfp4_kv_cache
    __all__.append("cp_gather_and_upconvert_nvfp4_kv_cache")
