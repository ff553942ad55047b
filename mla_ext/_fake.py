"""Fake (meta) kernels for every tensor op in csrc/bindings.cpp.

torch.compile traces ops through these: they compute output shapes/dtypes and
never touch data. Ops that only mutate their arguments return None.
"""
from __future__ import annotations

import torch  # noqa: F401

# Per-stage sections are added as ops arrive; the foundation ops take no tensors.

# === Stage: cache ===

# === Stage: kv_b_proj ===

# === Stage: attention ===


@torch.library.register_fake("mla_ext::merge_attn_states")
def _merge_attn_states_fake(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse):
    # Mutates `output` (and `output_lse` when given) in place; returns nothing.
    return None
