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
