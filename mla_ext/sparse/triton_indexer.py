"""Triton indexer scoring: a block of one request's new tokens against a range of its index
space, the context keys read straight from the paged index cache (bf16, or fp8 bytes x their
fp32 per-token scales, decoded in the loader) and the new tokens' keys from k_new.

    score[m, j] = sum_h w[m, h] * relu(q[m, h] . k[p0 + j]),  -inf where p0 + j > pos(m)

One program: BLOCK_M queries x BLOCK_N positions, all H heads (one [BLOCK_M, D] x
[D, BLOCK_N] dot per head). topk.py merges the chunks into the running top-k.
Interpreter rules: operands go to fp32 after loading; dots in IEEE fp32 there. On a
GPU, 16-bit queries make 16-bit dots with fp32 accumulation (the bf16 scoring of
transformers' indexer; DeepSeek's own reference scores in fp8).
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.attention.triton_latent import _pad, interpreting
from mla_ext.sparse._triton import device_reasons, tl, triton

if triton is not None:
    from mla_ext.triton_fp8 import e4m3_to_f32, launch_guard

    @triton.jit
    def _index_score_kernel(
        q_ptr, w_ptr, kc_ptr, kc32_ptr, kn_ptr, bt_ptr, out_ptr,
        M, p0, p1, ctx, n_new, qpos0, block_size, num_blocks, max_blocks,
        q_sm, q_sh, w_sm, kn_s, page_stride, out_sm,
        H: tl.constexpr, D: tl.constexpr, Q: tl.constexpr, FP8: tl.constexpr, LOWP_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < M
        pos = p0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = pos < p1
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D

        # -- keys [BLOCK_N, BLOCK_D] fp32: context from the paged cache, new tokens from k_new --
        in_ctx = n_mask & (pos < ctx)
        lblk = tl.where(in_ctx, pos // block_size, 0)
        in_ctx = in_ctx & (lblk < max_blocks)
        blk = tl.load(bt_ptr + lblk, mask=in_ctx, other=-1)
        ok = in_ctx & (blk >= 0) & (blk < num_blocks)  # outside the cache: a zero key
        blk = tl.where(ok, blk, 0).to(tl.int64)
        off = tl.where(ok, pos % block_size, 0).to(tl.int64)
        okd = ok[:, None] & d_mask[None, :]
        if FP8:
            # page: B tokens' e4m3 values token-major, then their fp32 scales (D/Q per token)
            byte = tl.load(kc_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :], mask=okd, other=0)
            sidx = (blk * page_stride + block_size * D) // 4 + off * (D // Q)
            sc = tl.load(kc32_ptr + sidx[:, None] + (d // Q)[None, :], mask=okd, other=0.0)
            kc = e4m3_to_f32(byte.to(tl.int32)) * sc
        else:
            kc = tl.load(kc_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :], mask=okd,
                         other=0.0).to(tl.float32)
        is_new = n_mask & (pos >= ctx) & (pos - ctx < n_new)  # past the new keys: a zero key, no read
        kn = tl.load(kn_ptr + tl.where(is_new, pos - ctx, 0).to(tl.int64)[:, None] * kn_s + d[None, :],
                     mask=is_new[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        k = tl.where(is_new[:, None], kn, tl.where(okd, kc, 0.0))

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        rows64 = rows.to(tl.int64)
        for h in range(H):
            q = tl.load(q_ptr + rows64[:, None] * q_sm + h * q_sh + d[None, :],
                        mask=r_mask[:, None] & d_mask[None, :], other=0.0)
            wh = tl.load(w_ptr + rows64 * w_sm + h, mask=r_mask, other=0.0).to(tl.float32)
            if LOWP_DOT:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            else:
                s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
            acc += wh[:, None] * tl.maximum(s, 0.0)
        qpos = qpos0 + rows
        acc = tl.where(pos[None, :] > qpos[:, None], float("-inf"), acc)
        tl.store(out_ptr + rows64[:, None] * out_sm + (pos - p0)[None, :], acc,
                 mask=r_mask[:, None] & n_mask[None, :])


def not_supported_reasons(q: Tensor) -> list[str]:
    why = device_reasons(q)
    if why:
        return why
    if _pad(q.shape[-1]) > 256:
        return [f"index_head_dim {q.shape[-1]} is above the 256 the kernel's tiles are sized for"]
    return []


def score_range_triton(q: Tensor, w: Tensor, cache: Tensor | None, fp8: bool, block_row: Tensor | None,
                       k_new: Tensor, ctx: int, p0: int, p1: int, qpos0: int, quant_block_size: int,
                       out: Tensor | None = None) -> Tensor:
    """Scores [M, p1 - p0] float32 of queries q [M, H, D] (positions qpos0..) against positions
    [p0, p1) of one request (block_row: its block-table row; k_new: its new tokens' keys)."""
    M, H, D = q.shape
    if out is None:
        out = torch.empty(M, p1 - p0, dtype=torch.float32, device=q.device)
    if M == 0 or p1 <= p0:
        return out
    if cache is None:  # no context: a dummy cache never read
        cache = torch.zeros(1, 1, D + 4 * (D // quant_block_size) if fp8 else D,
                            dtype=torch.uint8 if fp8 else torch.bfloat16, device=q.device)
        block_row = torch.zeros(1, dtype=torch.int32, device=q.device)
    page_stride = cache.stride(0)
    c32 = cache.view(torch.float32) if fp8 else cache
    if fp8 and (page_stride % 4 or cache.storage_offset() % 4):
        raise ValueError("index cache: fp8 pages must start at 4-byte multiples")
    lowp = (not interpreting()) and q.dtype in (torch.bfloat16, torch.float16)
    k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    w = w.to(torch.float32).contiguous()
    if interpreting() or q.device.type != "cuda":
        bm, bn, warps = max(16, min(64, triton.next_power_of_2(M))), 64, 4
    else:
        bm, bn, warps = 64, 64, 8  # ptxas: 4 warps spilled 336 B on sm_90a with fp8 keys (tests/sparse/test_sparse_aot.py)
    grid = (triton.cdiv(M, bm), triton.cdiv(p1 - p0, bn))
    bt = block_row.to(torch.int32).contiguous()
    with launch_guard(q):
        _index_score_kernel[grid](
            q, w, cache, c32, k_new, bt, out,
            M, p0, p1, ctx, k_new.shape[0], qpos0, cache.shape[1], cache.shape[0], max(bt.numel(), 1),
            q.stride(0), q.stride(1), w.stride(0), k_new.stride(0), page_stride, out.stride(0),
            H=H, D=D, Q=quant_block_size, FP8=fp8, LOWP_DOT=lowp,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_pad(D), num_warps=warps,
        )
    return out
