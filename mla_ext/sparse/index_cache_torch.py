"""The index cache's tensor geometry, its host-side offset checks and its torch backend
(writer and gathers): the reference the compiled and Triton backends are tested against.
Formats: mla_ext/config/index_formats.py."""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.cache.checks import check_block_ids
from mla_ext.config.index_formats import E4M3_MAX, MIN_SCALE, IndexCacheFormat


def _geometry(cache: Tensor, fmt: IndexCacheFormat, head_dim: int | None) -> tuple[int, int, int]:
    """(block_size, head_dim, scales per token) of a cache tensor, checked."""
    if cache.dim() != 3 or cache.dtype != fmt.storage_dtype:
        raise ValueError(f"index cache: expected a 3-D {fmt.storage_dtype} tensor for format {fmt.name!r}, got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    B, width = cache.shape[1], cache.shape[2]
    if not fmt.quantized:
        return B, width, 0
    if head_dim is None:
        raise ValueError("head_dim: required for the fp8 index cache (the row width holds the scales too)")
    if (width - head_dim) % 4 or width <= head_dim or head_dim % ((width - head_dim) // 4):
        raise ValueError(f"index cache: width {width} is not head_dim={head_dim} + 4 * head_dim / Q")
    if not cache[0].is_contiguous():
        raise ValueError("index cache: fp8 pages must be contiguous (values then scales)")
    return B, head_dim, (width - head_dim) // 4


def quantize_fp8_rows(k: Tensor, quant_block_size: int, scale_fmt: str | None = None) -> tuple[Tensor, Tensor]:
    """k [T, D] -> (e4m3 values as uint8 [T, D], fp32 scales [T, D/Q]) as the fp8 index cache stores them."""
    T, D = k.shape
    x = k.to(torch.float32).view(T, D // quant_block_size, quant_block_size)
    scale = x.abs().amax(dim=-1).clamp_min(MIN_SCALE) / E4M3_MAX
    if scale_fmt == "ue8m0":  # up to a power of two, exactly on the bits: torch.log2 rounds 2^k * (1 + 2^-23)
        bits = scale.view(torch.int32)  # down to k (the Triton and compiled writers do the same)
        up = ((bits & 0x7FFFFF) != 0) & ((bits & 0x7F800000) != 0x7F800000)
        scale = torch.where(up, (bits & 0x7F800000) + 0x800000, bits).view(torch.float32)
    elif scale_fmt not in (None, "", "fp32"):
        raise ValueError(f"scale_fmt: expected None, 'fp32' or 'ue8m0', got {scale_fmt!r}")
    q = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(T, D).view(torch.uint8), scale


def dequantize_fp8_rows(values: Tensor, scales: Tensor) -> Tensor:
    """(uint8 [T, D], fp32 [T, D/Q]) -> float32 [T, D]."""
    T, D = values.shape
    x = values.view(torch.float8_e4m3fn).to(torch.float32).view(T, scales.shape[1], -1)
    return (x * scales[..., None]).view(T, D)


def _page_parts(cache: Tensor, D: int, S: int) -> tuple[Tensor, Tensor]:
    """fp8 cache -> (values [nb, B, D] uint8, scales [nb, B, S] fp32) views of its pages."""
    nb, B = cache.shape[0], cache.shape[1]
    flat = cache.as_strided((nb, B * cache.shape[2]), (cache.stride(0), 1))  # pages may be strided apart
    vals = flat[:, : B * D].view(nb, B, D)
    scales = flat[:, B * D: B * D + 4 * B * S].view(torch.float32).view(nb, B, S)
    return vals, scales


def _write_torch(inp) -> None:
    """The torch writer (reference of the compiled and Triton ones): out-of-range slots skipped."""
    k, cache, fmt = inp.k, inp.cache, inp.fmt
    B = cache.shape[1]
    slots = inp.slot_mapping.to(torch.int64).cpu()
    keep = (slots >= 0) & (slots < cache.shape[0] * B)
    blk, off = (slots[keep] // B).to(cache.device), (slots[keep] % B).to(cache.device)
    rows = k[keep.to(k.device)]
    if not fmt.quantized:
        cache[blk, off] = rows.to(fmt.native_dtype)
        return
    D = k.shape[1]
    vals, scales = _page_parts(cache, D, D // inp.quant_block_size)
    qv, sc = quantize_fp8_rows(rows, inp.quant_block_size, inp.scale_fmt)
    vals[blk, off] = qv
    scales[blk, off] = sc


def _token_slots(block_table: Tensor, cu_seq_lens: Tensor, seq_starts: Tensor | None, B: int,
                 num_blocks: int) -> tuple[Tensor, Tensor]:
    """(block ids, offsets) int64 for every output row, checked against the table and the cache."""
    cu = cu_seq_lens.to(torch.int64).cpu()
    n = len(cu) - 1
    if block_table.dim() != 2 or block_table.shape[0] < n:
        raise ValueError(f"block_table: expected [>= {n}, max_blocks], got {tuple(block_table.shape)}")
    lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(n), lens)
    tok = torch.arange(int(cu[-1])) - cu[:-1][req]
    if seq_starts is not None:
        tok = tok + seq_starts.to(torch.int64).cpu()[req]
    lblk = tok // B
    if bool((lblk >= block_table.shape[1]).any()):
        raise ValueError(f"block_table: a token's logical block is past the table width {block_table.shape[1]}")
    blk = block_table.to(torch.int64).cpu()[req, lblk]
    if bool(((blk < 0) | (blk >= num_blocks)).any()):
        raise ValueError(f"block_table: block ids must be in [0, {num_blocks})")
    return blk, tok % B


def check_gather_offsets(cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor, seq_starts: Tensor | None,
                         B: int, dst_rows: int | None = None, dst_arg: str = "out") -> int:
    """The host checks of a gather on CPU tensors (mla_ext.cache.checks.check_block_ids, the latent
    gathers' checker): cu_seq_lens non-negative and non-decreasing, no request past `dst_rows`,
    seq_starts >= 0, every block a request reads inside the table and the cache. Returns the rows.
    CUDA tensors are not read (that would sync): the kernels give zero rows for anything out of range."""
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 1:
        raise ValueError(f"cu_seq_lens: expected [num_reqs + 1] offsets, got shape {tuple(cu_seq_lens.shape)}")
    n = cu_seq_lens.numel() - 1
    if seq_starts is not None and (seq_starts.dim() != 1 or seq_starts.numel() < n):
        raise ValueError(f"seq_starts: expected [>= {n}] (one per request), got shape {tuple(seq_starts.shape)}")
    return check_block_ids(block_table, cu_seq_lens, n, seq_starts, cache.shape[0], B, dst_rows, dst_arg=dst_arg)


def _gather_torch(inp) -> None:
    """The torch gather (reference of the compiled and Triton ones): float32 rows, or raw bytes + scales."""
    B, D, S = _geometry(inp.cache, inp.fmt, inp.head_dim)
    blk, off = _token_slots(inp.block_table, inp.cu_seq_lens, inp.seq_starts, B, inp.cache.shape[0])
    blk, off = blk.to(inp.cache.device), off.to(inp.cache.device)
    if inp.dst_scale is not None:
        vals, scales = _page_parts(inp.cache, D, S)
        inp.out.copy_(vals[blk, off].view(inp.out.dtype))
        inp.dst_scale.copy_(scales[blk, off].contiguous().view(torch.uint8).view(inp.dst_scale.dtype)
                            .view(inp.dst_scale.shape))
        return
    if inp.fmt.quantized:
        vals, scales = _page_parts(inp.cache, D, S)
        rows = dequantize_fp8_rows(vals[blk, off], scales[blk, off])
    else:
        rows = inp.cache[blk, off].to(torch.float32)
    inp.out.copy_(rows)
