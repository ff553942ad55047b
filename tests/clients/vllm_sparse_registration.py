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

print(json.dumps({
    "flashmla_sparse": path("FLASHMLA_SPARSE"), "custom": path("CUSTOM"),
    "flash_attn_mla_sparse": path("FLASH_ATTN_MLA_SPARSE"),
    "waiting_before_import": before,
    "top_k_per_row_prefill": f"{vllm_ops.top_k_per_row_prefill.__module__}.{vllm_ops.top_k_per_row_prefill.__name__}",
    "routed": sorted(sparse_plugin.routed()),
}))
