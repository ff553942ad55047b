"""Block-scaled fp8 W8A8 GEMM (DeepSeek 128 x 128 weight blocks, 1 x 128 activation groups).

out[m, n] = sum_g (sum_{k in g} qa[m, k] * qw[n, k]) * sa[m, g] * sw[n // 128, g]

One K step is exactly one 128-wide scale group, so the fp8 x fp8 tile product
is accumulated in fp32 and scaled once per step. fp8 `tl.dot` is native on
sm_89+ only (ptxas rejects fp8 mma on sm_80/86); under TRITON_INTERPRET it is
exact, which is how the CPU tests run it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mla_ext.kv_b_proj import quant
from mla_ext.kv_b_proj import reference as ref
from mla_ext.triton_fp8 import launch_guard

BLOCK_K = ref.FP8_BLOCK


# register budget: 255
@triton.jit(do_not_specialize=["M"])  # batch-varying: no re-compile
def _fp8_block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                           stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 before any stride product: (M - 1) * stride_cm + N reaches 2^31 at
    # DeepSeek-V3 TP1 sizes (N = 32768, > 65536 rows), and int32 offsets wrapped
    # to ~4 GiB before `out`.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    n_blk = offs_n // BLOCK_K  # weight scale row (the weight block is BLOCK_K x BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sa = tl.load(as_ptr + offs_m * stride_asm + kb, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + n_blk * stride_bsn + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int) -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter's cost is per program instance: few, big tiles.
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def w8a8_block_fp8_matmul(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """a_q fp8 [M, K] (unit K stride), a_s fp32 [M, ceil(K/128)], w_q fp8 [N, K],
    w_s fp32 [ceil(N/128), ceil(K/128)] -> [M, N] out_dtype."""
    if a_q.dtype != torch.float8_e4m3fn or w_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a_q and w_q must be torch.float8_e4m3fn, got {a_q.dtype} and {w_q.dtype}")
    m, k = a_q.shape
    n = w_q.shape[0]
    g = triton.cdiv(k, BLOCK_K)
    if w_q.shape[1] != k:
        raise ValueError(f"w_q must be [N, K={k}], got {tuple(w_q.shape)}")
    if tuple(a_s.shape) != (m, g) or a_s.dtype != torch.float32:
        raise ValueError(f"a_s must be fp32 [{m}, {g}], got {a_s.dtype} {tuple(a_s.shape)}")
    if tuple(w_s.shape) != (triton.cdiv(n, BLOCK_K), g) or w_s.dtype != torch.float32:
        raise ValueError(f"w_s must be fp32 [{triton.cdiv(n, BLOCK_K)}, {g}], got {w_s.dtype} {tuple(w_s.shape)}")
    if (k > 1 and a_q.stride(1) != 1) or w_q.stride(1) != 1 or a_s.stride(1) != 1 or w_s.stride(1) != 1:
        raise ValueError("a_q, w_q, a_s and w_s must have unit stride along their last dimension")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    elif tuple(out.shape) != (m, n) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {out_dtype} [{m}, {n}] with unit column stride")
    if m == 0 or n == 0:
        return out
    cfg = _config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    with launch_guard(out):
        _fp8_block_gemm_kernel[grid](
            a_q, a_s, w_q, w_s, out, m, n, k,
            a_q.stride(0), a_s.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0),
            BLOCK_K=BLOCK_K, **cfg,
        )
    return out


def fp8_block_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, out_dtype: torch.dtype,
                     out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] in bf16/fp16/fp32 (quantized here, 1 x 128 groups) or already fp8
    (then `x_scale`, fp32 per tensor [1] or per row [M, 1], default 1, dequantizes it)."""
    if x.dtype == torch.float8_e4m3fn:
        g = triton.cdiv(x.shape[1], BLOCK_K)
        s = (torch.ones(1, 1, dtype=torch.float32, device=x.device) if x_scale is None
             else x_scale.float().reshape(-1, 1))
        a_s = s.expand(x.shape[0], g).contiguous()
        return w8a8_block_fp8_matmul(x, a_s, w_q, w_s, out_dtype, out)
    a_q, a_s = quant.per_token_group_quant_fp8(x)
    return w8a8_block_fp8_matmul(a_q, a_s, w_q, w_s, out_dtype, out)
