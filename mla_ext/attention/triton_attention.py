"""Varlen flash attention with LSE for MLA shapes, as a Triton kernel.

QK head dim (P+R, e.g. 192) and V head dim (e.g. 128) differ and need not be
powers of two: both are padded to the next power of two with masked loads
(padding lanes load 0, so they add nothing to q·k and are never stored).

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


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    qk_scale_log2,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh, lse_sh,
    DQK, DV,
    CAUSAL: tl.constexpr, LOWP_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
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
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < q_len
    dqk_mask = offs_dqk < DQK
    dv_mask = offs_dv < DV

    q = tl.load(
        q_ptr + (q0 + offs_m)[:, None] * q_st + h * q_sh + offs_dqk[None, :],
        mask=m_mask[:, None] & dqk_mask[None, :], other=0.0,
    )
    if not LOWP_DOT:
        q = q.to(tl.float32)

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
        k = tl.load(
            k_ptr + (k0 + cols)[None, :] * k_st + h * k_sh + offs_dqk[:, None],
            mask=n_mask[None, :] & dqk_mask[:, None], other=0.0,
        )  # [BLOCK_DQK, BLOCK_N]
        if not LOWP_DOT:
            k = k.to(tl.float32)
        if IEEE_FP32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
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
    """(BLOCK_M, BLOCK_N, num_warps, num_stages).

    Interpreter cost is per program, so it gets big tiles. On a GPU the tiles
    must fit shared memory on sm_86 (99 KB per block) as well as sm_90; sizes
    measured by compiling ahead of time for both targets: 16-bit 64x64 with
    Dqk 256 / Dv 128 needs 64 KB; fp32 needs 32x32 tiles and one stage
    (64-70 KB; 64x64 fp32 would need 272 KB and fail to launch).
    """
    if _INTERPRET:
        return 64, 64, 4, 1
    if dtype == torch.float32:
        return 32, 32, 4, 1
    if max(dqk_pad, dv_pad) >= 256 and dv_pad >= 256:
        return 64, 32, 8, 2
    return 64, 64, 4, 2


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
) -> None:
    """Fills out [Tq,N,Dv] and lse [N,Tq] (fp32). Inputs are validated by api.py.

    Rows of q outside every request are not written. `max_seqlen_q` must be
    >= every request's query length (it sizes the grid; no device sync).
    """
    tq, n, dqk = q.shape
    dv = v.shape[-1]
    batch = cu_seqlens_q.numel() - 1
    if tq == 0 or n == 0 or batch == 0 or max_seqlen_q == 0:
        return
    block_dqk = triton.next_power_of_2(dqk)
    block_dv = triton.next_power_of_2(dv)
    block_m, block_n, warps, stages = _launch_config(block_dqk, block_dv, q.dtype)
    lowp = (not _INTERPRET) and q.dtype in (torch.bfloat16, torch.float16)
    ieee = q.dtype == torch.float32
    grid = (triton.cdiv(max_seqlen_q, block_m), batch, n)
    with launch_guard(q):
        _attn_fwd_kernel[grid](
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            softmax_scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            dqk, dv,
            CAUSAL=causal, LOWP_DOT=lowp, IEEE_FP32=ieee,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
            num_warps=warps, num_stages=stages,
        )

