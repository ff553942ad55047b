"""The DSA indexer's key cache, one per layer: the writer and the gathers (formats and page size:
mla_ext/config/index_formats.py).

Each token of a layer caches one indexer key k_I [D] (D = index_head_dim, 128 in the
published configs) beside its latent row. The writer and the gathers dispatch
(index_cache_backends.py) to the compiled CUDA kernels, Triton (triton_index_cache.py), the
compiled CPU kernels (csrc/sparse/), then torch (index_cache_torch.py, the reference); on the
CPU the wrappers check slots, block ids and the offsets first (ValueError naming the
argument: cu_seq_lens negative, decreasing or past the output, seq_starts negative, an output
too short; `check_gather_offsets`, the latent gathers' checker). On CUDA nothing is read on the
host (no sync): the kernels bound every row instead (rows outside cu_seq_lens untouched, a token
outside the table or the cache gives a zero row).
Gathers follow the latent gather's conventions (SPEC §6): block_table int32
[num_reqs, max_blocks], cu_seq_lens int32 [num_reqs+1] output row offsets, optional
seq_starts int32 [num_reqs].
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.dispatch import Chosen
from mla_ext.config.index_formats import (  # noqa: F401  (re-exported: the formats by the ops)
    ALIASES, E4M3_MAX, FORMATS, MIN_SCALE, IndexCacheFormat, IndexCacheSpec, get_index_format)
from mla_ext.sparse.index_cache_backends import INDEX_GATHER, INDEX_WRITE, IndexGatherInputs, IndexWriteInputs
from mla_ext.sparse.index_cache_torch import (  # noqa: F401  (re-exported)
    check_gather_offsets, dequantize_fp8_rows, quantize_fp8_rows)
from mla_ext.sparse.index_cache_torch import _geometry


def check_index_cache(cache, index_cache_dtype, head_dim: int, block_size: int | None = None,
                      arg: str = "index_cache", kv_cache: Tensor | None = None) -> None:
    """An index cache for `index_cache_dtype` and index_head_dim `head_dim`, checked before anything
    reads it (no data read): a 3-D tensor of the format's storage dtype holding data (not meta), rows
    of head_dim values (fp8: head_dim e4m3 bytes + 4 * head_dim / Q scale bytes, Q a divisor of
    head_dim; pages contiguous) and, when given, `block_size` tokens per page. With `kv_cache` (the
    layer's latent cache: the same block ids name a latent page and an index page) also at least as
    many blocks as it and on its device. ValueError naming `arg` otherwise. One check for the format
    level (the indexer, the gathers) and the layer's plan (mla_ext.prefill.sparse.check_index_cache)."""
    fmt = get_index_format(index_cache_dtype)
    D, B = head_dim, "B" if block_size is None else block_size
    if not isinstance(cache, Tensor):
        raise ValueError(f"{arg}: expected a paged index cache tensor [num_blocks, {B}, ...] "
                         f"({fmt.name}), got {type(cache).__name__}")
    if cache.dim() != 3 or cache.dtype != fmt.storage_dtype:
        raise ValueError(f"{arg}: expected a 3-D {fmt.storage_dtype} tensor [num_blocks, {B}, ...] "
                         f"(index_cache_dtype={fmt.name!r}), got {cache.dtype} {tuple(cache.shape)}")
    if block_size is not None and cache.shape[1] != block_size:
        raise ValueError(f"{arg}: pages of {cache.shape[1]} tokens, but the latent cache's block_size is "
                         f"{block_size}; one block id names a page of each, so the index cache's page size must "
                         f"be {block_size} (else the indexer scores other tokens' keys)")
    width = cache.shape[2]
    if not fmt.quantized:
        ok, want = width == D, f"{D} (index_head_dim)"
    else:  # D e4m3 bytes then D/Q fp32 scales per token, Q a divisor of D
        extra = width - D
        ok = extra > 0 and extra % 4 == 0 and D % (extra // 4) == 0
        want = f"index_head_dim + 4 * index_head_dim / Q bytes = {D + 4} for Q = {D} (one scale per token)"
    if not ok:
        raise ValueError(f"{arg}: rows of {width} {cache.dtype} elements, expected {want} "
                         f"(index_cache_dtype={fmt.name!r}, index_head_dim={D})")
    if fmt.quantized and cache.shape[0] and not cache[0].is_contiguous():
        raise ValueError(f"{arg}: fp8 pages must be contiguous (values then scales)")
    if kv_cache is not None and cache.shape[0] < kv_cache.shape[0]:
        raise ValueError(f"{arg}: {cache.shape[0]} blocks, fewer than the latent cache's "
                         f"{kv_cache.shape[0]}; every block id of the latent cache names an index page too")
    if kv_cache is not None and cache.device != kv_cache.device:
        raise ValueError(f"{arg}: on {cache.device}, expected the latent cache's device {kv_cache.device}")
    check_no_meta(**{arg: cache})  # (after the device check: beside a latent cache, a meta one is off its device)


def write_index_cache(k: Tensor, cache: Tensor, slot_mapping: Tensor, index_cache_dtype="bfloat16", *,
                      quant_block_size: int | None = None, scale_fmt: str | None = None) -> None:
    """Store k [T, D] at slots (block * B + offset; a negative slot is skipped, as vLLM's).
    Runs the first usable backend of index_cache_backends.INDEX_WRITE (CUDA, Triton, C++ CPU, torch)."""
    fmt = get_index_format(index_cache_dtype)
    check_no_meta(k=k, cache=cache, slot_mapping=slot_mapping)
    if k.dim() != 2:
        raise ValueError(f"k: expected [T, D], got {tuple(k.shape)}")
    T, D = k.shape
    B, Dc, S = _geometry(cache, fmt, D)
    if Dc != D:
        raise ValueError(f"k: expected head_dim {Dc} (the cache's), got {D}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != T or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected int32/int64 [{T}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    Q = None
    if fmt.quantized:
        Q = quant_block_size or D // S
        if Q * S != D:
            raise ValueError(f"quant_block_size: expected {D // S} for this cache, got {quant_block_size}")
        if scale_fmt not in (None, "", "fp32", "ue8m0"):
            raise ValueError(f"scale_fmt: expected None, 'fp32' or 'ue8m0', got {scale_fmt!r}")
    if slot_mapping.device.type == "cpu":  # host check where it costs no sync; CUDA kernels skip such slots
        if bool((slot_mapping >= cache.shape[0] * B).any()):
            raise ValueError(f"slot_mapping: slots must be < num_blocks * block_size = {cache.shape[0] * B}")
    if T:
        INDEX_WRITE(IndexWriteInputs(k, cache, slot_mapping, fmt, Q, scale_fmt))


def indexer_k_quant_and_cache(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, quant_block_size: int,
                              scale_fmt: str | None) -> None:
    """vLLM's op name and arguments: fp8 index cache writer."""
    write_index_cache(k, kv_cache, slot_mapping, "fp8", quant_block_size=quant_block_size, scale_fmt=scale_fmt)


def gather_index_keys(cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor, index_cache_dtype="bfloat16", *,
                      seq_starts: Tensor | None = None, head_dim: int | None = None,
                      out: Tensor | None = None, chosen: Chosen | None = None) -> Tensor:
    """Dequantized keys float32 [cu_seq_lens[-1], D]: row cu_seq_lens[r] + i = token seq_starts[r] + i of r.
    Runs the first usable backend of index_cache_backends.INDEX_GATHER; on CUDA out-of-range block ids
    read zero rows (no host check), on the CPU they raise ValueError."""
    fmt = get_index_format(index_cache_dtype)
    check_no_meta(cache=cache, block_table=block_table, cu_seq_lens=cu_seq_lens, seq_starts=seq_starts, out=out)
    B, D, S = _geometry(cache, fmt, head_dim)
    if out is not None and (out.dim() != 2 or out.shape[1] != D):
        raise ValueError(f"out: expected [rows, {D}], got {tuple(out.shape)}")
    if cache.device.type == "cpu":  # raises when out of range
        rows = check_gather_offsets(cache, block_table, cu_seq_lens, seq_starts, B,
                                    None if out is None else out.shape[0])
        if out is not None and out.shape[0] != rows:
            raise ValueError(f"out: expected {rows} rows (cu_seq_lens[-1]), got {out.shape[0]}")
    if out is None:
        out = torch.empty(int(cu_seq_lens[-1]), D, dtype=torch.float32, device=cache.device)
    INDEX_GATHER.run(IndexGatherInputs(cache, block_table, cu_seq_lens, fmt, seq_starts, D, out), chosen)
    return out


def cp_gather_indexer_k_quant_cache(kv_cache: Tensor, dst_k: Tensor, dst_scale: Tensor, block_table: Tensor,
                                    cu_seq_lens: Tensor) -> None:
    """vLLM's op name and arguments: raw e4m3 bytes dst_k uint8 [T, D] and their scales as bytes
    dst_scale uint8 [T, 4*D/Q] of the fp8 index cache, tokens 0.. of each request."""
    check_no_meta(kv_cache=kv_cache, dst_k=dst_k, dst_scale=dst_scale, block_table=block_table,
                  cu_seq_lens=cu_seq_lens)
    if dst_k.dim() != 2 or dst_scale.dim() != 2 or dst_scale.shape[0] != dst_k.shape[0]:
        raise ValueError(f"dst_k / dst_scale: expected [T, D] / [T, 4*D/Q] with one T, got {tuple(dst_k.shape)} / "
                         f"{tuple(dst_scale.shape)}")
    B, D, S = _geometry(kv_cache, FORMATS["fp8"], dst_k.shape[1])
    if kv_cache.device.type == "cpu":  # raises when out of range, or when dst_k is too short
        check_gather_offsets(kv_cache, block_table, cu_seq_lens, None, B, dst_k.shape[0], "dst_k")
    INDEX_GATHER(IndexGatherInputs(kv_cache, block_table, cu_seq_lens, FORMATS["fp8"], None, D, dst_k, dst_scale))


