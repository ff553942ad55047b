"""Prints, as JSON, what mla_ext's vLLM plugin registers for DSA on a platform stating a GPU
capability (argv[1], e.g. "8.6"; "none" for a platform without one).

Run in a subprocess by tests/clients/test_vllm_sparse_plugin.py with vLLM 0.33's client tree on
PYTHONPATH. Plumbing only: the platform is vLLM's UnspecifiedPlatform with tensors on the CPU and
the stated capability; vLLM's own plugin loader then calls mla_ext's register()."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_PLUGINS", "mla_ext")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # vLLM keeps real Triton (in the interpreter) rather than its placeholder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stated_platform import install_stated_platform  # noqa: E402

install_stated_platform(sys.argv[1])

from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from mla_ext.vllm import sparse_plugin  # noqa: E402

load_general_plugins()
load_general_plugins()  # vLLM may load plugins more than once per process: idempotent


def path(member: str):
    m = AttentionBackendEnum[member]
    return m.get_path() if m.is_overridden() else None


before = sorted(sparse_plugin._finder.waiting)
import vllm._custom_ops as vllm_ops  # noqa: E402  (a routed module imported after the plugin loaded)



def pack_check() -> dict:
    """The indexer's fp8 query padding as vLLM's DSA indexer module now calls it (vLLM's kernel in
    Triton's interpreter), and the fp8 JIT-warmup registration of that kernel."""
    import torch
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.v1.attention.ops import common

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 2, 8, generator=g) * 3).to(torch.float8_e4m3fn)
    lengths = torch.tensor([2, 3], dtype=torch.int32)
    packed = sai.pack_seq_triton(x, lengths)
    b = packed.view(torch.uint8)
    rows_equal = (packed.dtype == x.dtype and tuple(packed.shape) == (2, 3, 2, 8)
                  and torch.equal(b[0, :2], x[:2].view(torch.uint8)) and torch.equal(b[1], x[2:].view(torch.uint8)))
    registry = JitWarmupRegistry(None)
    with registry.activate():
        common._PACK_SEQ_TRITON_KERNEL.register_warmup(dtype=torch.float8_e4m3fn, pad_value=-float("inf"))
    return {"fn": f"{sai.pack_seq_triton.__module__}.{sai.pack_seq_triton.__name__}", "rows_equal": bool(rows_equal),
            "warmup": [[type(k).__name__, str(kw.get("dtype")), kw.get("pad_value")]
                       for k, regs in registry._registrations.items() for _, kw in regs]}


def canonical_check() -> dict:
    """What vLLM's MLA layer makes of a kv-cache dtype for a sparse backend: for mla_ext's, "fp8"
    means fp8_ds_mla (as vLLM decides for FLASHMLA_SPARSE); other backends keep vLLM's answer."""
    from vllm.model_executor.layers.attention import mla_attention

    from mla_ext.vllm.sparse_backend import MlaExtSparseMLABackend

    class OtherBackend:
        @staticmethod
        def get_name():
            return "FLASH_ATTN_MLA_SPARSE"

    canon = mla_attention._canonicalize_sparse_mla_kv_cache_dtype
    return {"ours": {d: canon(MlaExtSparseMLABackend, d) for d in ("fp8", "fp8_e4m3", "auto", "fp8_ds_mla")},
            "other_fp8": canon(OtherBackend, "fp8")}


print(json.dumps({
    "canonical": canonical_check(),
    "pack_seq": pack_check(),
    "flashmla_sparse": path("FLASHMLA_SPARSE"), "custom": path("CUSTOM"),
    "flash_attn_mla_sparse": path("FLASH_ATTN_MLA_SPARSE"),
    "waiting_before_import": before,
    "top_k_per_row_prefill": f"{vllm_ops.top_k_per_row_prefill.__module__}.{vllm_ops.top_k_per_row_prefill.__name__}",
    "routed": sorted(sparse_plugin.routed()),
}))
