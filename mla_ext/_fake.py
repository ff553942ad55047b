"""Fake (meta) kernels for every tensor op in csrc/bindings.cpp.

torch.compile traces ops through these: they compute output shapes/dtypes and
never touch data. Ops that only mutate their arguments return None.
"""
from __future__ import annotations

import torch  # noqa: F401

# Per-stage sections are added as ops arrive; the foundation ops take no tensors.

# === Stage: cache ===


@torch.library.register_fake("mla_ext::concat_and_cache_mla")
def _concat_and_cache_mla_fake(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
    return None  # writes kv_cache in place


@torch.library.register_fake("mla_ext::gather_and_maybe_dequant_cache")
def _gather_and_maybe_dequant_cache_fake(
    src_cache, dst, block_table, cu_seq_lens, num_reqs, kv_cache_dtype, k_scale, seq_starts=None
):
    return None  # writes dst in place


@torch.library.register_fake("mla_ext::cp_gather_cache")
def _cp_gather_cache_fake(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts=None):
    return None  # writes dst in place


@torch.library.register_fake("mla_ext::compute_kv_scale")
def _compute_kv_scale_fake(kv_c, k_pe, kv_cache_dtype):
    return kv_c.new_empty((1,), dtype=torch.float32)


# === Stage: kv_b_proj ===

# === Stage: attention ===


@torch.library.register_fake("mla_ext::merge_attn_states")
def _merge_attn_states_fake(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse):
    # Mutates `output` (and `output_lse` when given) in place; returns nothing.
    return None
