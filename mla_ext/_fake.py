"""Fake (meta) kernels for every tensor op of csrc/registration.cpp.

torch.compile traces ops through these: they compute output shapes/dtypes and
never touch data. Ops that only mutate their arguments return None.
"""
from __future__ import annotations

import torch


def _one_device(op: str, **tensors) -> None:
    """Every tensor argument on one device, as the real kernels require.

    A meta tensor mixed with real ones makes the dispatcher pick these fake
    kernels (Meta outranks CPU/CUDA), so without this check such a call would
    silently compute nothing (marlin_fp8_gemm returned an unwritten meta
    tensor). Under torch.compile fake tensors report their real device, so a
    consistent call passes.
    """
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) <= 1:
        return
    # Blame the odd one out against the first real (non-meta) device.
    ref_name, ref = next(((n, d) for n, d in devices.items() if d.type != "meta"), next(iter(devices.items())))
    for name, dev in devices.items():
        if dev != ref:
            raise ValueError(
                f"{name}: expected device {ref} (as {ref_name}), got {dev}; "
                f"mla_ext::{op} takes all its tensors on one device"
            )


# Per-stage sections are added as ops arrive; the foundation ops take no tensors.

# === Stage: cache ===


@torch.library.register_fake("mla_ext::concat_and_cache_mla")
def _concat_and_cache_mla_fake(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
    _one_device("concat_and_cache_mla", kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping,
                k_scale=k_scale)
    return None  # writes kv_cache in place


@torch.library.register_fake("mla_ext::gather_and_maybe_dequant_cache")
def _gather_and_maybe_dequant_cache_fake(
    src_cache, dst, block_table, cu_seq_lens, num_reqs, kv_cache_dtype, k_scale, seq_starts=None
):
    _one_device("gather_and_maybe_dequant_cache", src_cache=src_cache, dst=dst, block_table=block_table,
                cu_seq_lens=cu_seq_lens, k_scale=k_scale, seq_starts=seq_starts)
    return None  # writes dst in place


@torch.library.register_fake("mla_ext::cp_gather_cache")
def _cp_gather_cache_fake(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts=None):
    _one_device("cp_gather_cache", src_cache=src_cache, dst=dst, block_table=block_table,
                cu_seq_lens=cu_seq_lens, seq_starts=seq_starts)
    return None  # writes dst in place


@torch.library.register_fake("mla_ext::compute_kv_scale")
def _compute_kv_scale_fake(kv_c, k_pe, kv_cache_dtype):
    _one_device("compute_kv_scale", kv_c=kv_c, k_pe=k_pe)
    return kv_c.new_empty((1,), dtype=torch.float32)


# === Stage: kv_b_proj ===


def _marlin_padded_n(n):
    return (n + 63) // 64 * 64


@torch.library.register_fake("mla_ext::marlin_fp8_repack")
def _marlin_fp8_repack_fake(w_fp8, scales, group_size, act_dtype):
    # vLLM's Marlin layout: qweight int32 [K/16, 4*N_pad], scales [G, N_pad] in act_dtype.
    _one_device("marlin_fp8_repack", w_fp8=w_fp8, scales=scales)
    n, k = w_fp8.shape
    groups = k // 128 if group_size > 0 else 1
    qweight = w_fp8.new_empty((k // 16, 4 * _marlin_padded_n(n)), dtype=torch.int32)
    return qweight, scales.new_empty((groups, _marlin_padded_n(n)), dtype=act_dtype)


@torch.library.register_fake("mla_ext::marlin_fp8_dequantize")
def _marlin_fp8_dequantize_fake(qweight, scales, N, K, group_size, act_dtype):
    _one_device("marlin_fp8_dequantize", qweight=qweight, scales=scales)
    return scales.new_empty((N, K), dtype=torch.float32)


@torch.library.register_fake("mla_ext::marlin_fp8_gemm")
def _marlin_fp8_gemm_fake(a, qweight, scales, N, K, group_size, act_dtype, out_dtype=None, split_k=0):
    # split_k picks the CUDA kernel's split-K; the output is the same.
    _one_device("marlin_fp8_gemm", a=a, qweight=qweight, scales=scales)
    return a.new_empty((a.shape[0], N), dtype=out_dtype or act_dtype)


# === Stage: attention ===


@torch.library.register_fake("mla_ext::merge_attn_states")
def _merge_attn_states_fake(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse):
    _one_device("merge_attn_states", output=output, output_lse=output_lse, prefix_output=prefix_output,
                prefix_lse=prefix_lse, suffix_output=suffix_output, suffix_lse=suffix_lse)
    # Mutates `output` (and `output_lse` when given) in place; returns nothing.
    return None


# === Stage: sparse (DSA indexer key cache) ===
# Registered only when the library has the ops: a .so built before them (not yet rebuilt after a
# merge) still loads, without these ops; tests/build/test_fake_kernels.py requires them once built.
if hasattr(torch.ops.mla_ext, "index_cache_write"):
    @torch.library.register_fake("mla_ext::index_cache_write")
    def _index_cache_write_fake(k, cache, slot_mapping, index_cache_dtype, quant_block_size=0, scale_fmt=""):
        _one_device("index_cache_write", k=k, cache=cache, slot_mapping=slot_mapping)
        return None  # writes cache in place

    @torch.library.register_fake("mla_ext::index_cache_gather")
    def _index_cache_gather_fake(cache, dst, block_table, cu_seq_lens, index_cache_dtype, head_dim, seq_starts=None,
                                 dst_scale=None):
        _one_device("index_cache_gather", cache=cache, dst=dst, block_table=block_table, cu_seq_lens=cu_seq_lens,
                    seq_starts=seq_starts, dst_scale=dst_scale)
        return None  # writes dst (and dst_scale) in place
