"""NVFP4 W4A16 GEMM: e2m1 weights are decoded inside the kernel (sm_80+).

out[m, n] = global * sum_k x[m, k] * e2m1(w[n, k]) * e4m3(s[n, k // 16])

Layout (SPEC §5): w uint8 [N, K/2], low nibble = even k; s e4m3 [N, K/16];
global fp32 [1] (read on the device, so no host synchronisation). Each K tile
reads every byte twice (once per nibble) from L1 rather than interleaving
registers, which keeps the kernel simple and the interpreter exact.
Under TRITON_INTERPRET bf16 arithmetic and bf16 `tl.dot` are wrong, so there
everything is fp32 (DOT_FP32); on a GPU the decoded tile is cast to the
activation dtype for a 16-bit tensor-core dot with fp32 accumulation.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mla_ext.kv_b_proj import reference as ref
from mla_ext.triton_fp8 import e4m3_to_f32, launch_guard


@triton.jit
def _w4a16_kernel(a_ptr, b_ptr, s_ptr, g_ptr, c_ptr, M, N, K,
                  stride_am, stride_bn, stride_sn, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 before any stride product (int32 row offsets wrapped past 2^31).
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        byte = tl.load(b_ptr + offs_n[None, :] * stride_bn + (k // 2)[:, None], mask=wmask, other=0).to(tl.int32)
        nib = (byte >> ((k % 2) * 4)[:, None]) & 0xF
        e = (nib >> 1) & 3
        mb = (nib & 1).to(tl.float32)
        pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
        mag = tl.where(e == 0, mb * 0.5, (1.0 + mb * 0.5) * pow2)
        val = tl.where((nib >> 3) == 1, -mag, mag)
        # e4m3 block scales arrive as raw bytes: no fp8 type on sm_86.
        sbyte = tl.load(s_ptr + offs_n[None, :] * stride_sn + (k // 16)[:, None], mask=wmask, other=0)
        sc = e4m3_to_f32(sbyte.to(tl.int32))
        w = val * sc  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w)
        else:
            acc += tl.dot(a, w.to(a.dtype))
    acc = acc * tl.load(g_ptr)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _config(m: int) -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=1, DOT_FP32=True)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT_FP32=False)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT_FP32=False)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, DOT_FP32=False)


def nvfp4_w4a16_matmul(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, global_scale: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16 (unit K stride, any row stride) -> [M, N] in x.dtype."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16 [M, K], got {x.dtype} shape {tuple(x.shape)}")
    m, k = x.shape
    n = w_packed.shape[0]
    if w_packed.dtype != torch.uint8 or tuple(w_packed.shape) != (n, k // 2) or k % ref.NVFP4_BLOCK:
        raise ValueError(f"w_packed must be uint8 [N, K/2] with K={k} a multiple of 16, got "
                         f"{w_packed.dtype} {tuple(w_packed.shape)}")
    if w_scale.dtype != torch.float8_e4m3fn or tuple(w_scale.shape) != (n, k // ref.NVFP4_BLOCK):
        raise ValueError(f"w_scale must be float8_e4m3fn [{n}, {k // ref.NVFP4_BLOCK}], got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError(f"global_scale must be fp32 with one element, got {global_scale.dtype} "
                         f"{tuple(global_scale.shape)}")
    if (k > 1 and x.stride(1) != 1) or w_packed.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("x, w_packed and w_scale must have unit stride along K")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with unit column stride")
    if m == 0 or n == 0:
        return out
    cfg = _config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    with launch_guard(out):
        _w4a16_kernel[grid](x, w_packed, w_scale.view(torch.uint8), global_scale, out, m, n, k,
                            x.stride(0), w_packed.stride(0), w_scale.stride(0), out.stride(0), **cfg)
    return out
