"""Triton kernels of the DSA indexer logits in DeepGEMM's two forms (contracts:
mla_ext/sparse/indexer_ops_reference.py), for GPUs without DeepGEMM's SM90+ kernels:

    logit[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]

fp8 (e4m3) operands are loaded as bytes and decoded with integer operations into fp16 (every
e4m3 value is an fp16 value, subnormals included: `e4m3_to_f16`), so no fp8 type reaches the PTX
(sm_80/86 have none) and the interpreter decodes exactly; the dots are fp16 x fp16 with fp32
accumulation (each product exact in fp32), the head sum and the key scale in fp32.

_mqa_logits_kernel        prefill: keys [N, D] + scales [N]; compressed rows (column c of row m
                          is key ks[m] + c).
_paged_mqa_logits_kernel  decode: keys from vLLM's paged fp8 index cache (page = B tokens' D bytes,
                          then their B fp32 scales).
One program: one logits row x BLOCK_N columns, the heads as the dot's M dimension ([H, D] x
[D, BLOCK_N], `_head_sum`); consecutive programs are rows of one column tile, so a key tile is
read from L2 by the rows after the first. (A tile of rows x columns with the heads looped keeps
the decoded key tile in every warp's registers: 255 registers and spills on sm_80/86/89.)
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
    def _head_sum(qrow_ptr, q_sh, wrow_ptr, kb, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
        """sum_h w[h] * relu(q[h] . k[n]) for one query row (heads as the dot's M) against a tile of
        key bytes kb [BLOCK_N, BLOCK_D] -> fp32 [BLOCK_N]."""
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        qb = tl.load(qrow_ptr + h[:, None] * q_sh + d[None, :], mask=(h < H)[:, None] & (d < D)[None, :], other=0)
        s = tl.dot(e4m3_to_f16(qb.to(tl.int32)), tl.trans(e4m3_to_f16(kb.to(tl.int32))))  # [BLOCK_H, BLOCK_N]
        wv = tl.load(wrow_ptr + h, mask=h < H, other=0.0).to(tl.float32)
        return tl.sum(wv[:, None] * tl.maximum(s, 0.0), axis=0)

    @triton.jit
    def _mqa_logits_kernel(q_ptr, k_ptr, ksc_ptr, w_ptr, st_ptr, en_ptr, out_ptr,
                           N, W, q_sm, q_sh, k_sn, w_sm, out_sm,
                           H: tl.constexpr, D: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        c0 = tl.program_id(1) * BLOCK_N
        st = tl.load(st_ptr + m)
        en = tl.minimum(tl.load(en_ptr + m), N)  # keys past N: none (no read)
        if (st >= 0) & (c0 < tl.minimum(en - st, W)):
            c = c0 + tl.arange(0, BLOCK_N)
            n = st + c
            ok = (c < W) & (n < en)
            d = tl.arange(0, BLOCK_D)
            n64 = n.to(tl.int64)
            kb = tl.load(k_ptr + n64[:, None] * k_sn + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0)
            logit = _head_sum(q_ptr + m * q_sm, q_sh, w_ptr + m * w_sm, kb, H, D, BLOCK_H, BLOCK_D)
            logit = logit * tl.load(ksc_ptr + n64, mask=ok, other=0.0)
            tl.store(out_ptr + m * out_sm + c, logit, mask=ok)

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
        sc = tl.load(c32_ptr + (blk * page_stride + block_size * D) // 4 + off, mask=ok, other=0.0)
        qrow = q_ptr + b.to(tl.int64) * q_s0 + (r % next_n) * q_s1
        logit = _head_sum(qrow, q_sh, w_ptr + r.to(tl.int64) * w_sr, kb, H, D, BLOCK_H, BLOCK_D) * sc
        tl.store(out_ptr + r.to(tl.int64) * out_sr + pos, logit, mask=p_mask)


not_supported_reasons = device_reasons


def _fits(D: int, H: int) -> list[str]:
    why = []
    if _pad(D) > 256:
        why.append(f"head_dim {D} is above the 256 the kernels' tiles are sized for")
    if _pad(H) > 128:
        why.append(f"{H} heads: the kernels hold at most 128 heads per tile")
    return why


# GPU tiles and warps (ptxas -v, D = 128, H = 64: tests/sparse/test_sparse_aot.py, no spills on
# sm_80/86/89/90).
BLOCK_N = 64


def warps(block_h: int) -> int:
    return 4 if block_h <= 64 else 8  # 128 heads on 4 warps: 255 registers and spills on sm_80


def mqa_logits_triton(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor,
                      out: Tensor) -> Tensor:
    """q uint8 [M, H, D], k uint8 [N, D] (unit last strides), k_scale fp32 [N], weights [M, H],
    ks/ke int32 [M] on q's device, out fp32 [M, W] already -inf: fills each row's valid columns."""
    M, H, D = q.shape
    W = out.shape[1]
    if M == 0 or W == 0 or k.shape[0] == 0:
        return out
    bn = 32 if interpreting() else BLOCK_N
    w = weights.to(torch.float32)
    with launch_guard(q):
        _mqa_logits_kernel[(M, triton.cdiv(W, bn))](
            q, k, k_scale, w, ks, ke, out, k.shape[0], W, q.stride(0), q.stride(1), k.stride(0),
            w.stride(0), out.stride(0), H=H, D=D, BLOCK_H=max(16, _pad(H)), BLOCK_N=bn, BLOCK_D=_pad(D),
            num_warps=warps(_pad(H)), num_stages=1)
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
    bn = 32 if interpreting() else BLOCK_N
    w = weights.to(torch.float32)
    c32 = cache.view(torch.float32)
    grid = (rows, triton.cdiv(W, bn))
    with launch_guard(q):
        _paged_mqa_logits_kernel[grid](
            q, cache, c32, w, row_ends, block_tables, out, W, next_n, cache.shape[1], cache.shape[0],
            block_tables.shape[1], cache.stride(0), q.stride(0), q.stride(1), q.stride(2), w.stride(0),
            block_tables.stride(0), out.stride(0), H=H, D=D, BLOCK_H=max(16, _pad(H)), BLOCK_N=bn,
            BLOCK_D=_pad(D), num_warps=warps(_pad(H)), num_stages=1)
    return out
