"""vLLM 0.33's DSA indexer-cache ops over mla_ext.sparse.index_cache (same names, argument order and
in-place outputs; torch ops in the ``mla_ext_vllm`` namespace with fake kernels). Re-exported by
``mla_ext.vllm._custom_ops``.

indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)
    Writes k [T, D] into the fp8 index cache [num_blocks, B, D + 4*D/Q] in vLLM's page layout.
    vLLM passes its scale format in the last argument: "ue8m0" rounds each scale up to a power
    of two; "" / "fp8" / "fp8_e4m3" / "auto" / "fp32" keep amax/448. Slot -1 is skipped.
cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    The raw e4m3 bytes dst_k uint8 [T, D] and the scales as bytes dst_scale uint8 [T, 4*D/Q] of
    tokens 0.. of every request (rows cu_seq_lens[r] ..).
"""
from torch import Tensor
import torch

from mla_ext.sparse import index_cache as ic

NAMESPACE = "mla_ext_vllm"
PLAIN_SCALES = ("", "fp8", "fp8_e4m3", "auto", "fp32")


def _check(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_write(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype) -> None:
    _check(k.dim() == 2, f"k: expected [num_tokens, head_dim], got {tuple(k.shape)}")
    _check(kv_cache.dim() == 3 and kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn),
           f"kv_cache: expected a 3-D uint8 (or float8_e4m3fn) index cache, got {kv_cache.dtype} "
           f"{tuple(kv_cache.shape)}")
    _check(isinstance(quant_block_size, int) and quant_block_size > 0 and k.shape[1] % quant_block_size == 0,
           f"quant_block_size: expected a positive divisor of head_dim={k.shape[1]}, got {quant_block_size!r}")
    _check(kv_cache.shape[2] == k.shape[1] + 4 * (k.shape[1] // quant_block_size),
           f"kv_cache: expected rows of {k.shape[1] + 4 * (k.shape[1] // quant_block_size)} bytes "
           f"(head_dim + 4 * head_dim / quant_block_size), got {kv_cache.shape[2]}")
    _check(kv_cache_dtype == "ue8m0" or kv_cache_dtype in PLAIN_SCALES,
           f"kv_cache_dtype: expected 'ue8m0' or one of {PLAIN_SCALES} (the scale format), got {kv_cache_dtype!r}")
    _check(slot_mapping.dim() == 1 and slot_mapping.shape[0] <= k.shape[0],
           f"slot_mapping: expected 1-D with at most {k.shape[0]} entries, got {tuple(slot_mapping.shape)}")
    _check(k.device == kv_cache.device == slot_mapping.device,
           f"k / kv_cache / slot_mapping: expected one device, got {k.device}, {kv_cache.device}, "
           f"{slot_mapping.device}")


@torch.library.custom_op(f"{NAMESPACE}::indexer_k_quant_and_cache", mutates_args=("kv_cache",))
def indexer_k_quant_and_cache(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, quant_block_size: int,
                              kv_cache_dtype: str) -> None:
    _check_write(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)
    n = slot_mapping.shape[0]  # vLLM: k may be padded past the slots
    ic.write_index_cache(k[:n], kv_cache.view(torch.uint8), slot_mapping, "fp8", quant_block_size=quant_block_size,
                         scale_fmt="ue8m0" if kv_cache_dtype == "ue8m0" else None)


@indexer_k_quant_and_cache.register_fake
def _(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype):
    _check_write(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype)


def _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens) -> None:
    _check(kv_cache.dim() == 3 and kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn),
           f"kv_cache: expected a 3-D uint8 (or float8_e4m3fn) index cache, got {kv_cache.dtype}")
    _check(dst_k.dim() == 2 and dst_k.element_size() == 1,
           f"dst_k: expected a 1-byte [num_tokens, head_dim] tensor, got {dst_k.dtype} {tuple(dst_k.shape)}")
    S = (kv_cache.shape[2] - dst_k.shape[1]) // 4
    _check(S >= 1 and kv_cache.shape[2] == dst_k.shape[1] + 4 * S,
           f"dst_k: head_dim {dst_k.shape[1]} does not fit the cache's {kv_cache.shape[2]}-byte rows")
    _check(dst_scale.dim() == 2 and dst_scale.shape[0] == dst_k.shape[0]
           and dst_scale.shape[1] * dst_scale.element_size() == 4 * S,
           f"dst_scale: expected [{dst_k.shape[0]}, {4 * S}] bytes (or [{dst_k.shape[0]}, {S}] fp32), got "
           f"{dst_scale.dtype} {tuple(dst_scale.shape)}")
    _check(block_table.dim() == 2 and block_table.dtype == torch.int32,
           f"block_table: expected int32 [num_reqs, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    _check(cu_seq_lens.dim() == 1 and cu_seq_lens.dtype == torch.int32,
           f"cu_seq_lens: expected int32 [num_reqs + 1], got {cu_seq_lens.dtype} {tuple(cu_seq_lens.shape)}")


@torch.library.custom_op(f"{NAMESPACE}::cp_gather_indexer_k_quant_cache", mutates_args=("dst_k", "dst_scale"))
def cp_gather_indexer_k_quant_cache(kv_cache: Tensor, dst_k: Tensor, dst_scale: Tensor, block_table: Tensor,
                                    cu_seq_lens: Tensor) -> None:
    _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
    ic.cp_gather_indexer_k_quant_cache(kv_cache.view(torch.uint8), dst_k.view(torch.uint8),
                                       dst_scale.view(torch.uint8), block_table, cu_seq_lens)


@cp_gather_indexer_k_quant_cache.register_fake
def _(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)


OPS = (indexer_k_quant_and_cache, cp_gather_indexer_k_quant_cache)
