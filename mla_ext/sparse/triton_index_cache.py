"""Triton writer and gather for the DSA index-key cache (formats: mla_ext/sparse/index_cache.py).

The fp8 format stores e4m3 bytes; Triton's fp8 type exists only on sm_89+ and its fp32 -> fp8
cast is wrong under the interpreter (toolchain notes), so the writer encodes e4m3 with integer
operations (`f32_to_e4m3`, round to nearest even, saturating at 448: what torch's cast gives for
the clamped values the writer produces), exactly on every architecture and in the interpreter;
the gather decodes with mla_ext.triton_fp8.e4m3_to_f32. The ue8m0 scale rounding (up to a
power of two) is done on the scale's bits, exactly.

One program: BLOCK_T tokens x the whole head (D <= 256). Writer: slot < 0 skips the token
(vLLM's padding rule), and so does a slot past the cache (never a write outside it; no host
check, which would sync). Gather: rows of
cu_seq_lens / seq_starts as mla_ext.cache's gathers; block ids outside the cache read zeros.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.attention.triton_latent import _pad, interpreting
from mla_ext.sparse._triton import device_reasons, tl, triton
from mla_ext.config.index_formats import get_index_format
from mla_ext.sparse.index_cache_torch import _geometry, check_gather_offsets

if triton is not None:
    from mla_ext.triton_fp8 import e4m3_to_f32, launch_guard

    @triton.jit
    def f32_to_e4m3(x):
        """fp32 (finite) -> e4m3fn bits as int32, round to nearest even, saturating at +-448."""
        sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)
        a = tl.minimum(tl.abs(x), 448.0)
        ab = a.to(tl.int32, bitcast=True)
        # normal: keep 3 mantissa bits (RNE on the fp32 bits), rebias the exponent 127 -> 7
        r = (ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20
        normal = r - (120 << 3)
        # subnormal (a < 2^-6): a multiple of 2^-9, rounded to nearest even by the 2^23 trick
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        code = tl.where(a < 0.015625, sub, tl.minimum(normal, 0x7E))
        return code | sign

    @triton.jit
    def _index_write_kernel(k_ptr, c_ptr, c32_ptr, slot_ptr, T, block_size, num_slots, page_stride, k_s,
                            D: tl.constexpr, Q: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
        ok = (slot >= 0) & (slot < num_slots)  # a slot past the cache writes nothing (no host check: no sync)
        blk = tl.where(ok, slot // block_size, 0)
        off = tl.where(ok, slot % block_size, 0)
        d = tl.arange(0, BLOCK_D)
        m = ok[:, None] & (d < D)[None, :]
        x = tl.load(k_ptr + tl.where(ok, t, 0).to(tl.int64)[:, None] * k_s + d[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        if FP8:
            G: tl.constexpr = BLOCK_D // Q
            amax = tl.max(tl.reshape(tl.abs(x), (BLOCK_T, G, Q)), axis=2)  # [BLOCK_T, G]
            scale = tl.maximum(amax, 1e-4) / 448.0
            if UE8M0:  # up to a power of two, on the bits: exact
                sb = scale.to(tl.int32, bitcast=True)
                sb = tl.where((sb & 0x7FFFFF) != 0, (sb & 0x7F800000) + 0x800000, sb)
                scale = sb.to(tl.float32, bitcast=True)
            y = tl.reshape(tl.reshape(x, (BLOCK_T, G, Q)) / scale[:, :, None], (BLOCK_T, BLOCK_D))
            code = f32_to_e4m3(y)
            tl.store(c_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :], code.to(tl.uint8), mask=m)
            g = tl.arange(0, G)
            sidx = (blk * page_stride + block_size * D) // 4 + off * (D // Q)
            tl.store(c32_ptr + sidx[:, None] + g[None, :], scale, mask=ok[:, None] & (g < D // Q)[None, :])
        else:
            tl.store(c_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :],
                     x.to(c_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _index_gather_kernel(c_ptr, c32_ptr, bt_ptr, cu_ptr, st_ptr, out_ptr, num_reqs, block_size, num_blocks,
                             max_blocks, page_stride, bt_s, out_s,
                             D: tl.constexpr, Q: tl.constexpr, FP8: tl.constexpr, HAS_STARTS: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(1)
        row0 = tl.load(cu_ptr + r)
        n = tl.load(cu_ptr + r + 1) - row0
        i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = i < n
        start = 0
        if HAS_STARTS:
            start = tl.load(st_ptr + r)
        tok = start + i
        lblk = tl.where(live, tok // block_size, 0)
        in_table = live & (lblk < max_blocks)
        blk = tl.load(bt_ptr + r.to(tl.int64) * bt_s + lblk, mask=in_table, other=-1)
        ok = in_table & (blk >= 0) & (blk < num_blocks)
        blk = tl.where(ok, blk, 0).to(tl.int64)
        off = tl.where(ok, tok % block_size, 0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        m = ok[:, None] & (d < D)[None, :]
        if FP8:
            byte = tl.load(c_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :], mask=m, other=0)
            sidx = (blk * page_stride + block_size * D) // 4 + off * (D // Q)
            sc = tl.load(c32_ptr + sidx[:, None] + (d // Q)[None, :], mask=m, other=0.0)
            v = e4m3_to_f32(byte.to(tl.int32)) * sc
        else:
            v = tl.load(c_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :], mask=m,
                        other=0.0).to(tl.float32)
        v = tl.where(m, v, 0.0)
        rows = (row0 + i).to(tl.int64)
        tl.store(out_ptr + rows[:, None] * out_s + d[None, :], v, mask=live[:, None] & (d < D)[None, :])


not_supported_reasons = device_reasons


def _block_t() -> int:
    return 16 if interpreting() else 32


# GPU warps per launch (ptxas -v, triton 3.8, D = 128; tests/sparse/test_sparse_aot.py): the writer's
# 32-token tile spilled 24 B on sm_86 with 4 warps, none with 8; the gather's none with 4.
WRITE_WARPS, GATHER_WARPS = 8, 4


def write_index_cache_triton(k: Tensor, cache: Tensor, slot_mapping: Tensor, index_cache_dtype="bfloat16", *,
                             quant_block_size: int | None = None, scale_fmt: str | None = None) -> None:
    """As mla_ext.sparse.index_cache.write_index_cache (its checks), in one Triton launch."""
    fmt = get_index_format(index_cache_dtype)
    T, D = k.shape
    B, _, S = _geometry(cache, fmt, D)
    if scale_fmt not in (None, "", "fp32", "ue8m0"):
        raise ValueError(f"scale_fmt: expected None, 'fp32' or 'ue8m0', got {scale_fmt!r}")
    Q = quant_block_size or (D // S if S else D)
    if fmt.quantized and (_pad(D) % Q or Q * S != D):
        raise ValueError(f"quant_block_size: the Triton writer needs Q={Q} to divide the padded head "
                         f"{_pad(D)} and to be the cache's D/S = {D // max(S, 1)}")
    if T == 0:
        return
    c32 = cache.view(torch.float32) if fmt.quantized else cache
    slots = slot_mapping.to(device=cache.device, dtype=torch.int64).contiguous()
    kk = k if k.stride(-1) == 1 else k.contiguous()
    bt = _block_t()
    with launch_guard(k):
        _index_write_kernel[(triton.cdiv(T, bt),)](
            kk, cache, c32, slots, T, B, cache.shape[0] * B, cache.stride(0), kk.stride(0),
            D=D, Q=Q, FP8=fmt.quantized, UE8M0=scale_fmt == "ue8m0", BLOCK_T=bt, BLOCK_D=_pad(D),
            num_warps=4 if interpreting() else WRITE_WARPS)


def gather_index_keys_triton(cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor, index_cache_dtype="bfloat16",
                             *, seq_starts: Tensor | None = None, head_dim: int | None = None,
                             max_len: int | None = None, out: Tensor | None = None) -> Tensor:
    """As mla_ext.sparse.index_cache.gather_index_keys (float32 rows), in one Triton launch.
    `max_len`: the longest request (host int; computed from cu_seq_lens when not given)."""
    fmt = get_index_format(index_cache_dtype)
    B, D, S = _geometry(cache, fmt, head_dim)
    n = cu_seq_lens.numel() - 1
    dev = cache.device
    if dev.type == "cpu":  # the interpreter: host checks as the wrapper's (on a GPU the kernel bounds reads)
        check_gather_offsets(cache, block_table, cu_seq_lens, seq_starts, B, None if out is None else out.shape[0])
    cu = cu_seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    total = int(cu_seq_lens[-1]) if out is None else out.shape[0]
    if out is None:
        out = torch.empty(total, D, dtype=torch.float32, device=cache.device)
    if max_len is None:
        max_len = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max()) if n else 0
    if n == 0 or max_len == 0:
        return out
    c32 = cache.view(torch.float32) if fmt.quantized else cache
    bt = block_table.to(device=dev, dtype=torch.int32).contiguous()
    st = seq_starts.to(device=dev, dtype=torch.int32).contiguous() if seq_starts is not None else cu
    b = _block_t()
    with launch_guard(cache):
        _index_gather_kernel[(triton.cdiv(max_len, b), n)](
            cache, c32, bt, cu, st, out, n, B, cache.shape[0], bt.shape[1], cache.stride(0), bt.stride(0),
            out.stride(0), D=D, Q=D // S if S else D, FP8=fmt.quantized, HAS_STARTS=seq_starts is not None,
            BLOCK_T=b, BLOCK_D=_pad(D), num_warps=GATHER_WARPS)
    return out
