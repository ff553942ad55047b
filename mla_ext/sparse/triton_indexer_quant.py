"""Triton kernel of the indexer q's RoPE + e4m3 quantization (vLLM 0.33's fused_indexer_q_rope_quant;
contract: mla_ext/sparse/indexer_ops_reference.py) without fp8 types: Triton's fp8e4nv exists only
from sm_89 (vLLM's own kernel fails to compile on sm_80/86), so the codes are made with integer
operations (mla_ext.sparse.triton_index_cache.f32_to_e4m3: round to nearest even, saturating, exact
on every architecture and in the interpreter) and stored as bytes. The bf16 rounding of the rotated
values and the power-of-two (ue8m0) scale are done on the bits too, exactly (the interpreter's
fp32 -> bf16 cast truncates; log2/exp2 are approximate on a GPU).

One program: one token x BLOCK_H heads x the whole head (D <= 256). RoPE on the first R dims:
pairs (i, i + R/2) when neox, (2i, 2i + 1) otherwise, each written back in its own place.
"""
from __future__ import annotations

from torch import Tensor

from mla_ext.attention.triton_latent import _pad, interpreting
from mla_ext.sparse._triton import device_reasons, tl, triton

if triton is not None:
    from mla_ext.sparse.triton_index_cache import f32_to_e4m3
    from mla_ext.triton_fp8 import launch_guard

    @triton.jit
    def _bf16_rne(x):
        """fp32 -> the nearest bf16 value (ties to even), as fp32, on the bits."""
        u = x.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
        return u.to(tl.float32, bitcast=True)

    @triton.jit
    def rope_columns(d, HALF: tl.constexpr, NEOX: tl.constexpr):
        """(rotated?, partner column, first of its pair?, cos/sin index) of each column d for a RoPE
        on the first 2 * HALF columns: pairs (i, i + HALF) when NEOX, (2i, 2i + 1) otherwise; columns
        past the rotation are their own partner, at index 0. Shared with mla_ext.vllm's DSA kernels."""
        rot = d < 2 * HALF
        if NEOX:
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            first = d < HALF
            i = d % HALF
        else:
            partner = d ^ 1
            first = (d % 2) == 0
            i = d // 2
        return rot, tl.where(rot, partner, d), first, tl.where(rot, i, 0)

    @triton.jit
    def _q_rope_quant_kernel(pos_ptr, q_ptr, cs_ptr, w_ptr, qo_ptr, wo_ptr, H, q_st, q_sh, cs_s, w_st, w_sh,
                             qo_st, qo_sh, wo_st, softmax_scale, head_scale,
                             D: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < H
        d = tl.arange(0, BLOCK_D)
        m = h_mask[:, None] & (d < D)[None, :]
        base = q_ptr + t * q_st + h[:, None] * q_sh
        x = tl.load(base + d[None, :], mask=m, other=0.0).to(tl.float32)
        HALF: tl.constexpr = R // 2
        rot, partner, first, i = rope_columns(d, HALF, NEOX)
        xp = tl.load(base + partner[None, :], mask=m & rot[None, :], other=0.0).to(tl.float32)
        p = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cs_ptr + p * cs_s + i, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(cs_ptr + p * cs_s + HALF + i, mask=rot, other=0.0).to(tl.float32)
        y = tl.where(first[None, :], x * cos[None, :] - xp * sin[None, :], x * cos[None, :] + xp * sin[None, :])
        y = tl.where(rot[None, :], _bf16_rne(y), x)
        y = tl.where(m, y, 0.0)
        amax = tl.max(tl.abs(y), axis=1)
        raw = tl.maximum(amax, 1e-10) * (1.0 / 448.0)
        sb = raw.to(tl.int32, bitcast=True)  # 2^ceil(log2(raw)), on the bits
        scale = tl.where((sb & 0x7FFFFF) != 0, (sb & 0x7F800000) + 0x800000, sb).to(tl.float32, bitcast=True)
        code = f32_to_e4m3(tl.minimum(tl.maximum(y / scale[:, None], -448.0), 448.0))
        tl.store(qo_ptr + t * qo_st + h[:, None] * qo_sh + d[None, :], code.to(tl.uint8), mask=m)
        w = tl.load(w_ptr + t * w_st + h * w_sh, mask=h_mask, other=0.0).to(tl.float32)
        tl.store(wo_ptr + t * wo_st + h, ((w * scale) * softmax_scale) * head_scale, mask=h_mask)


not_supported_reasons = device_reasons

# GPU heads per program and warps (ptxas -v, D = 128: tests/sparse/test_sparse_aot.py, no spills).
BLOCK_H, WARPS = 16, 4


def q_rope_quant_triton(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, weights: Tensor, softmax_scale: float,
                        head_scale: float, is_neox: bool, q_out: Tensor, w_out: Tensor) -> None:
    """Checked arguments (mla_ext.sparse.indexer_q_quant): q [T, H, D] (unit last stride),
    cos_sin_cache [P, R] (unit last stride), q_out uint8 [T, H, D], w_out fp32 [T, H] (contiguous)."""
    T, H, D = q.shape
    if T == 0 or H == 0:
        return
    bh = min(BLOCK_H, triton.next_power_of_2(H))
    with launch_guard(q):
        _q_rope_quant_kernel[(T, triton.cdiv(H, bh))](
            positions, q, cos_sin_cache, weights, q_out, w_out, H, q.stride(0), q.stride(1), cos_sin_cache.stride(0),
            weights.stride(0), weights.stride(1), q_out.stride(0), q_out.stride(1), w_out.stride(0),
            float(softmax_scale), float(head_scale), D=D, R=cos_sin_cache.shape[-1], NEOX=bool(is_neox),
            BLOCK_H=bh, BLOCK_D=_pad(D), num_warps=1 if interpreting() else WARPS, num_stages=1)
