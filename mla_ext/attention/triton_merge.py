"""merge_attn_states as a Triton kernel (SPEC §7); see reference.py for the math.

One program merges BLOCK_R (token, head) rows over the whole (padded) head
dim. Loads are converted to fp32 immediately: under TRITON_INTERPRET=1 bf16
arithmetic is silently wrong. Every row's LSEs are loaded before its outputs
are stored and rows never span programs, so in-place merging is safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_ext.compat import interpreting
from mla_ext.triton_fp8 import launch_guard


# register budget: 128
@triton.jit(do_not_specialize=["num_rows", "ol_sh", "pl_sh", "sl_sh"])  # batch-varying: no re-compile
def _merge_kernel(
    out_ptr, out_lse_ptr, p_ptr, p_lse_ptr, s_ptr, s_lse_ptr,
    num_rows, num_heads, head_size,
    o_st, o_sh, p_st, p_sh, s_st, s_sh,
    ol_sh, ol_st, pl_sh, pl_st, sl_sh, sl_st,
    HAS_OUT_LSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Rows (token x head) and columns in int32; only each row's base offset is
    # int64 (a [BLOCK_R] vector), so no per-element int64 pointer math: the
    # [BLOCK_R, BLOCK_D] tiles add an int32 column to a per-row pointer.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < num_rows
    t = (rows // num_heads).to(tl.int64)
    h = (rows % num_heads).to(tl.int64)
    a = tl.load(p_lse_ptr + h * pl_sh + t * pl_st, mask=rmask, other=float("-inf"))
    b = tl.load(s_lse_ptr + h * sl_sh + t * sl_st, mask=rmask, other=float("-inf"))
    a = tl.where(a == float("inf"), float("-inf"), a)
    b = tl.where(b == float("inf"), float("-inf"), b)
    m = tl.maximum(a, b)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    w1 = tl.exp(a - m_safe)
    w2 = tl.exp(b - m_safe)
    denom = tl.where(empty, 1.0, w1 + w2)
    s1 = w1 / denom
    s2 = w2 / denom

    d = tl.arange(0, BLOCK_D)
    dmask = d < head_size
    # An empty side is never loaded (masked off), so garbage in its o cannot leak.
    m1 = rmask[:, None] & dmask[None, :] & (s1 > 0)[:, None]
    m2 = rmask[:, None] & dmask[None, :] & (s2 > 0)[:, None]
    p_row = p_ptr + (t * p_st + h * p_sh)
    s_row = s_ptr + (t * s_st + h * s_sh)
    o_row = out_ptr + (t * o_st + h * o_sh)
    x1 = tl.load(p_row[:, None] + d[None, :], mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(s_row[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
    o = s1[:, None] * x1 + s2[:, None] * x2
    omask = rmask[:, None] & dmask[None, :]
    tl.store(o_row[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=omask)
    if HAS_OUT_LSE:
        lse = tl.where(empty, float("-inf"), m_safe + tl.log(denom))
        tl.store(out_lse_ptr + h * ol_sh + t * ol_st, lse, mask=rmask)


def merge_attn_states_triton(
    out: torch.Tensor,
    out_lse: torch.Tensor | None,
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
) -> None:
    """Writes the merge of (o1, lse1) and (o2, lse2) into out / out_lse.

    Arguments are validated by the caller (api.py); strides are taken as they are.
    """
    t, n, d = out.shape
    rows = t * n
    if rows == 0:
        return
    block_d = triton.next_power_of_2(max(d, 1))
    # ~4K elements per program: large tiles keep the interpreter fast and
    # give a GPU enough bytes in flight per program. On a GPU the tile does not
    # shrink with the batch (each size would be another compiled variant).
    block_r = max(1, 4096 // block_d)
    if interpreting():
        block_r = min(block_r, triton.next_power_of_2(rows))
    ol = out_lse if out_lse is not None else lse1  # never written when HAS_OUT_LSE is False
    grid = (triton.cdiv(rows, block_r),)
    with launch_guard(out):
        _merge_kernel[grid](
            out, ol, o1, lse1, o2, lse2,
            rows, n, d,
            out.stride(0), out.stride(1), o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1),
            ol.stride(0), ol.stride(1), lse1.stride(0), lse1.stride(1), lse2.stride(0), lse2.stride(1),
            HAS_OUT_LSE=out_lse is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        )
