"""Triton kernels of the DSA indexer logits in DeepGEMM's two forms (contracts:
mla_ext/sparse/indexer_ops_reference.py), for GPUs without DeepGEMM's SM90+ kernels:

    logit[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]

fp8 (e4m3) operands are loaded as bytes and decoded with integer operations into fp16 (every
e4m3 value is an fp16 value, subnormals included: `e4m3_to_f16`), so no fp8 type reaches the PTX
(sm_80/86 have none) and the interpreter decodes exactly; the dots are fp16 x fp16 with fp32
accumulation (each product exact in fp32), the head sum and the key scale in fp32.

_mqa_logits_kernel        prefill: keys [N, D] + scales [N]; compressed rows (column c of row m
                          is key ks[m] + c). One program: BLOCK_M rows x compressed columns
                          [c0, c0 + BLOCK_N); it scores the absolute key tiles covering its rows'
                          windows (one tile when the rows share ks, as one request's rows do) and
                          stores each (row, column) it owns once.
_paged_mqa_logits_kernel  decode: keys from vLLM's paged fp8 index cache (page = B tokens' D bytes,
                          then their B fp32 scales). One program: one logits row x BLOCK_N
                          positions, the heads as the dot's M dimension ([H, D] x [D, BLOCK_N]).
Both write only valid entries; the wrappers fill the rest with -inf first.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.attention.triton_latent import _pad, interpreting
from mla_ext.sparse._triton import device_reasons, tl, triton

if triton is not None:
    from mla_ext.triton_fp8 import launch_guard

    @triton.jit
    def e4m3_to_f16(b):
        """uint8 e4m3fn bits (as int32) -> fp16, exact for every finite code (0x7F/0xFF: not
        produced by the quantizers, decoded as 480): the 7 exponent/mantissa bits at fp16 bits
        7..13 are an fp16 of value x * 2^-8, and * 256 is exact in fp16 (|x| <= 448)."""
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return h.to(tl.int16).to(tl.float16, bitcast=True) * 256.0

    @triton.jit
    def _mqa_logits_kernel(q_ptr, k_ptr, ksc_ptr, w_ptr, st_ptr, en_ptr, out_ptr,
                           M, N, W, q_sm, q_sh, k_sn, w_sm, out_sm,
                           H: tl.constexpr, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid_m = tl.program_id(0)
        c0 = tl.program_id(1) * BLOCK_N
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < M
        st = tl.load(st_ptr + rows, mask=r_mask, other=0)
        en = tl.minimum(tl.load(en_ptr + rows, mask=r_mask, other=0), N)  # keys past N: none (no read)
        live = r_mask & (en - st > c0) & (st >= 0)
        lo = tl.min(tl.where(live, st + c0, 2147483647), axis=0)
        hi = tl.max(tl.where(live, tl.minimum(st + c0 + BLOCK_N, en), 0), axis=0)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D
        rows64 = rows.to(tl.int64)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < hi
            n64 = n.to(tl.int64)
            kb = tl.load(k_ptr + n64[:, None] * k_sn + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0)
            k = e4m3_to_f16(kb.to(tl.int32))
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for h in range(H):
                qb = tl.load(q_ptr + rows64[:, None] * q_sm + h * q_sh + d[None, :],
                             mask=r_mask[:, None] & d_mask[None, :], other=0)
                s = tl.dot(e4m3_to_f16(qb.to(tl.int32)), tl.trans(k))
                wh = tl.load(w_ptr + rows64 * w_sm + h, mask=r_mask, other=0.0).to(tl.float32)
                acc += wh[:, None] * tl.maximum(s, 0.0)
            acc = acc * tl.load(ksc_ptr + n64, mask=n_mask, other=0.0)[None, :]
            c = n[None, :] - st[:, None]
            ok = (live[:, None] & (c >= c0) & (c < c0 + BLOCK_N) & (c < W) & (n[None, :] < en[:, None])
                  & n_mask[None, :])
            tl.store(out_ptr + rows64[:, None] * out_sm + c, acc, mask=ok)

    @triton.jit
    def _paged_mqa_logits_kernel(q_ptr, c_ptr, c32_ptr, w_ptr, end_ptr, bt_ptr, out_ptr,
                                 W, next_n, block_size, num_blocks, max_blocks, page_stride,
                                 q_s0, q_s1, q_sh, w_sr, bt_s, out_sr,
                                 H: tl.constexpr, D: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        end = tl.minimum(tl.load(end_ptr + r), W)
        b = r // next_n
        p_mask = pos < end
        lblk = tl.where(p_mask, pos // block_size, 0)
        in_table = p_mask & (lblk < max_blocks)
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_s + lblk, mask=in_table, other=-1)
        ok = in_table & (blk >= 0) & (blk < num_blocks)  # outside the table or the cache: a zero key
        blk = tl.where(ok, blk, 0).to(tl.int64)
        off = tl.where(ok, pos % block_size, 0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        okd = ok[:, None] & (d < D)[None, :]
        kb = tl.load(c_ptr + blk[:, None] * page_stride + off[:, None] * D + d[None, :], mask=okd, other=0)
        k = e4m3_to_f16(kb.to(tl.int32))
        sc = tl.load(c32_ptr + (blk * page_stride + block_size * D) // 4 + off, mask=ok, other=0.0)
        h = tl.arange(0, BLOCK_H)
        h_mask = h < H
        qrow = q_ptr + b.to(tl.int64) * q_s0 + (r % next_n) * q_s1
        qb = tl.load(qrow + h[:, None] * q_sh + d[None, :], mask=h_mask[:, None] & (d < D)[None, :], other=0)
        s = tl.dot(e4m3_to_f16(qb.to(tl.int32)), tl.trans(k))  # [BLOCK_H, BLOCK_N] fp32
        wv = tl.load(w_ptr + r.to(tl.int64) * w_sr + h, mask=h_mask, other=0.0).to(tl.float32)
        logit = tl.sum(wv[:, None] * tl.maximum(s, 0.0), axis=0) * sc
        tl.store(out_ptr + r.to(tl.int64) * out_sr + pos, logit, mask=p_mask)


not_supported_reasons = device_reasons


def _fits(D: int, H: int | None = None) -> list[str]:
    why = []
    if _pad(D) > 256:
        why.append(f"head_dim {D} is above the 256 the kernels' tiles are sized for")
    if H is not None and _pad(H) > 128:
        why.append(f"{H} heads: the paged kernel holds at most 128 heads per tile")
    return why


# GPU tiles and warps (ptxas -v, D = 128, H = 64: tests/sparse/test_sparse_aot.py, no spills on
# sm_80/86/89/90).
PREFILL_TILE, PREFILL_WARPS = (64, 64), 8
PAGED_BLOCK_N, PAGED_WARPS = 64, 4


def mqa_logits_triton(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor,
                      out: Tensor) -> Tensor:
    """q uint8 [M, H, D], k uint8 [N, D] (unit last strides), k_scale fp32 [N], weights [M, H],
    ks/ke int32 [M] on q's device, out fp32 [M, W] already -inf: fills each row's valid columns."""
    M, H, D = q.shape
    W = out.shape[1]
    if M == 0 or W == 0 or k.shape[0] == 0:
        return out
    bm, bn = (16, 32) if interpreting() else PREFILL_TILE
    w = weights.to(torch.float32)
    grid = (triton.cdiv(M, bm), triton.cdiv(W, bn))
    with launch_guard(q):
        _mqa_logits_kernel[grid](
            q, k, k_scale, w, ks, ke, out, M, k.shape[0], W, q.stride(0), q.stride(1), k.stride(0),
            w.stride(0), out.stride(0), H=H, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_pad(D),
            num_warps=4 if interpreting() else PREFILL_WARPS)
    return out


def paged_mqa_logits_triton(q: Tensor, cache: Tensor, weights: Tensor, row_ends: Tensor, block_tables: Tensor,
                            out: Tensor) -> Tensor:
    """q uint8 [B, next_n, H, D] (unit last stride), cache uint8 [nb, bs, D + 4] (pages contiguous),
    weights [B * next_n, H], row_ends int32 [rows], block_tables int32 [B, max_blocks] (unit last
    stride), out fp32 [rows, W] already -inf: fills each row's first row_ends[r] columns."""
    Bq, next_n, H, D = q.shape
    rows, W = out.shape
    if rows == 0 or W == 0:
        return out
    bn = 32 if interpreting() else PAGED_BLOCK_N
    w = weights.to(torch.float32)
    c32 = cache.view(torch.float32)
    grid = (rows, triton.cdiv(W, bn))
    with launch_guard(q):
        _paged_mqa_logits_kernel[grid](
            q, cache, c32, w, row_ends, block_tables, out, W, next_n, cache.shape[1], cache.shape[0],
            block_tables.shape[1], cache.stride(0), q.stride(0), q.stride(1), q.stride(2), w.stride(0),
            block_tables.stride(0), out.stride(0), H=H, D=D, BLOCK_H=max(16, _pad(H)), BLOCK_N=bn,
            BLOCK_D=_pad(D), num_warps=PAGED_WARPS)
    return out
