"""Varlen flash attention with LSE for MLA shapes, as a Triton kernel.

The QK head dim is read in up to two segments, each from its own key tensor:
q[..., :D1]·k1 + q[..., D1:]·k2. That serves MLA's split keys directly
(k1 = k_nope [Tk, N, P], k2 = k_rope [Tk, R] with head stride 0: the keys
[Tk, N, P+R] are never built), and it is also how one key tensor of a width
that is not a power of two is read: 192 = 128 + 64, so no lane is padding
(one padded 256-wide tile would waste a third of the QK work). Each segment
and the V head dim are padded to a power of two (>= 16) with masked loads
(padding lanes load 0, add nothing to q·k and are never stored).

One program computes BLOCK_M query rows of one request and one head, with an
online softmax over BLOCK_N-key tiles in base 2 (scores pre-multiplied by
scale·log2(e)); the LSE is converted back to the natural log on store.
Causal masking is bottom-right aligned (see reference.py). A row without any
visible key stores o = 0 and lse = -inf; no -inf - -inf is ever evaluated.

Interpreter (TRITON_INTERPRET=1) rules: bf16 arithmetic and bf16 tl.dot are
silently wrong there, so operands are converted to fp32 right after loading
and dots run in fp32. On a GPU 16-bit operands go to tl.dot as they are
(fp32 accumulation); fp32 inputs use IEEE fp32 dots, not TF32.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mla_ext.triton_fp8 import launch_guard

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LOG2E = 1.4426950408889634


# register budget: 255
@triton.jit(do_not_specialize=["lse_sh"])  # batch-varying: no re-compile
def _attn_fwd_kernel(
    q_ptr, k1_ptr, k2_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    qk_scale_log2,
    q_st, q_sh, k1_st, k1_sh, k2_st, k2_sh, v_st, v_sh, o_st, o_sh, lse_sh,
    D1, D2, DV,
    CAUSAL: tl.constexpr, LOWP_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # BLOCK_D2 == 0: one QK segment (k2_ptr is not read).
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q0 = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int64) - q0
    k0 = tl.load(cu_k_ptr + b).to(tl.int64)
    k_len = tl.load(cu_k_ptr + b + 1).to(tl.int64) - k0
    m_start = pid_m * BLOCK_M
    if m_start >= q_len:
        return

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < q_len
    d1_mask = offs_d1 < D1
    dv_mask = offs_dv < DV

    q_rows = q_ptr + (q0 + offs_m)[:, None] * q_st + h * q_sh
    q1 = tl.load(q_rows + offs_d1[None, :], mask=m_mask[:, None] & d1_mask[None, :], other=0.0)
    if not LOWP_DOT:
        q1 = q1.to(tl.float32)
    if BLOCK_D2 > 0:
        offs_d2 = tl.arange(0, BLOCK_D2)
        d2_mask = offs_d2 < D2
        q2 = tl.load(q_rows + D1 + offs_d2[None, :], mask=m_mask[:, None] & d2_mask[None, :], other=0.0)
        if not LOWP_DOT:
            q2 = q2.to(tl.float32)

    # Bottom-right causal: row i sees keys j <= i + (k_len - q_len).
    diag = k_len - q_len
    end_n = k_len
    if CAUSAL:
        end_n = tl.minimum(k_len, m_start + BLOCK_M + diag)
        end_n = tl.maximum(end_n, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        n_mask = cols < k_len
        k1 = tl.load(
            k1_ptr + (k0 + cols)[None, :] * k1_st + h * k1_sh + offs_d1[:, None],
            mask=n_mask[None, :] & d1_mask[:, None], other=0.0,
        )  # [BLOCK_D1, BLOCK_N]
        if not LOWP_DOT:
            k1 = k1.to(tl.float32)
        if IEEE_FP32:
            s = tl.dot(q1, k1, input_precision="ieee")
        else:
            s = tl.dot(q1, k1)
        if BLOCK_D2 > 0:
            k2 = tl.load(
                k2_ptr + (k0 + cols)[None, :] * k2_st + h * k2_sh + offs_d2[:, None],
                mask=n_mask[None, :] & d2_mask[:, None], other=0.0,
            )  # [BLOCK_D2, BLOCK_N]
            if not LOWP_DOT:
                k2 = k2.to(tl.float32)
            if IEEE_FP32:
                s += tl.dot(q2, k2, input_precision="ieee")
            else:
                s += tl.dot(q2, k2)
        s = s * qk_scale_log2
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet keep m = -inf; subtract 0 instead so
        # exp2 gives 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        v = tl.load(
            v_ptr + (k0 + cols)[:, None] * v_st + h * v_sh + offs_dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )
        if LOWP_DOT:
            acc += tl.dot(p.to(v.dtype), v)
        else:
            v = v.to(tl.float32)
            if IEEE_FP32:
                acc += tl.dot(p, v, input_precision="ieee")
            else:
                acc += tl.dot(p, v)
        m_i = m_new

    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(
        o_ptr + (q0 + offs_m)[:, None] * o_st + h * o_sh + offs_dv[None, :],
        o.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :],
    )
    tl.store(lse_ptr + h * lse_sh + q0 + offs_m, lse, mask=m_mask)


def _launch_config(dqk_pad: int, dv_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); dqk_pad = BLOCK_D1 + BLOCK_D2.

    Interpreter cost is per program, so it gets big tiles. On a GPU the tiles
    must fit shared memory on sm_86 (99 KB per block) as well as sm_90, and
    should not spill. Measured by compiling ahead of time (triton 3.8, ptxas
    -v for sm_90a and sm_86; tests/attention/test_attention_varlen.py checks the shared
    memory): 16-bit 64x64 tiles with QK 128+64 / V 128 need 40-48 KB and
    spill ~1 KB per thread on 4 warps, nothing on 8 warps (QK 256 / V 128:
    64 KB, no spills on 8 warps); V 256 takes 64x32 tiles (40-53 KB). fp32:
    16x16 tiles, 4 warps, two stages: no spills for QK 128+64 / V 128 and QK
    256 / V 256, causal or not, sm_86 and sm_90 (109-146 registers, 34-50 KB);
    the earlier 32x32 / one stage spilled 1.1-1.3 KB per thread (issue 19).
    """
    if _INTERPRET:
        return 64, 64, 4, 1
    if dtype == torch.float32:
        return 16, 16, 4, 2
    if dv_pad >= 256:
        return 64, 32, 8, 2
    return 64, 64, 8, 2


def _pad(d: int) -> int:
    """A segment's tile width: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(d)) if d > 0 else 0


def qk_segments(dqk: int, split_at: int | None = None) -> tuple[int, int, int, int]:
    """(D1, BLOCK_D1, D2, BLOCK_D2): how a QK head dim of `dqk` is read.

    `split_at` (split keys: P of k_nope [.., P] + k_rope [.., dqk - P]) fixes
    the split. Otherwise one key tensor is read in two segments when that pads
    less than one power-of-two tile: 192 -> 128 + 64 (no padding; one tile
    would be 256), 40 -> 32 + 8 (padded 48, not 64); 128 or 24 stay whole.
    """
    if split_at is not None:
        d2 = dqk - split_at
        return split_at, _pad(split_at), d2, _pad(d2)
    whole = _pad(dqk)
    d1 = whole // 2
    if dqk <= 16 or whole == dqk or d1 + _pad(dqk - d1) >= whole:
        return dqk, whole, 0, 0
    return d1, d1, dqk - d1, _pad(dqk - d1)


def split_keys_pad_less(p: int, r: int) -> bool:
    """Whether reading split keys (k_nope [.., p], k_rope [.., r]) as they are
    pads no more than reading one assembled key tensor of width p + r would
    (P = 128, R = 64: 192 either way; P = 192, R = 64: 256 + 64 = 320 > 256)."""
    _, b1, _, b2 = qk_segments(p + r, p)
    _, w1, _, w2 = qk_segments(p + r)
    return b1 + b2 <= w1 + w2


def varlen_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    k_rope: torch.Tensor | None = None,
) -> None:
    """Fills out [Tq,N,Dv] and lse [N,Tq] (fp32). Inputs are validated by api.py.

    k [Tk, N, Dqk]; or split keys: k = k_nope [Tk, N, P] and k_rope
    [Tk, N, R] (any head stride, 0 for a rope part shared by the heads), with
    P + R = Dqk, read as they are (the full keys are never built).
    Rows of q outside every request are not written. `max_seqlen_q` must be
    >= every request's query length (it sizes the grid; no device sync).
    """
    tq, n, dqk = q.shape
    dv = v.shape[-1]
    batch = cu_seqlens_q.numel() - 1
    if tq == 0 or n == 0 or batch == 0 or max_seqlen_q == 0:
        return
    if k_rope is not None and k_rope.shape[-1] == 0:
        k_rope = None
    if k_rope is not None:
        d1, block_d1, d2, block_d2 = qk_segments(dqk, k.shape[-1])
        k1, k2 = k, k_rope
    else:
        d1, block_d1, d2, block_d2 = qk_segments(dqk)
        k1, k2 = k, (k[..., d1:] if d2 else k)
    block_dv = _pad(dv)
    block_m, block_n, warps, stages = _launch_config(block_d1 + block_d2, block_dv, q.dtype)
    lowp = (not _INTERPRET) and q.dtype in (torch.bfloat16, torch.float16)
    ieee = q.dtype == torch.float32
    grid = (triton.cdiv(max_seqlen_q, block_m), batch, n)
    with launch_guard(q):
        _attn_fwd_kernel[grid](
            q, k1, k2, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            softmax_scale * LOG2E,
            q.stride(0), q.stride(1), k1.stride(0), k1.stride(1), k2.stride(0), k2.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
            d1, d2, dv,
            CAUSAL=causal, LOWP_DOT=lowp, IEEE_FP32=ieee,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_dv,
            num_warps=warps, num_stages=stages,
        )
