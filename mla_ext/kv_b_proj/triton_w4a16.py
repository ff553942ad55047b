"""NVFP4 W4A16 GEMM: e2m1 weights are decoded inside the kernel (sm_80+).

out[m, n] = global * sum_k x[m, k] * e2m1(w[n, k]) * e4m3(s[n, k // 16])

Layout (SPEC §5): w uint8 [N, K/2], low nibble = even k; s e4m3 [N, K/16];
global fp32 [1] (read on the device, so no host synchronisation).

The kernel (`_w4a16_kernel`): the packed [BLOCK_N, BLOCK_K/2] tile is loaded
  as it lies in memory, contiguous along K (16-byte vector loads that Triton's
  pipeliner turns into cp.async), and unpacked in registers: low and high
  nibbles joined and reshaped into [BLOCK_N, BLOCK_K] (k = 2i, 2i+1). A nibble
  becomes an fp16 bit pattern by shifts alone (e|m to bits 9..11, sign to 15:
  the value times 2^-14, the e2m1 subnormal 0.5 included), widened to fp32 and
  multiplied by its block scale times 2^14: e2m1 x e4m3 has at most 5
  significant bits, so the product, and its cast to the activation dtype,
  are exact. Configurations keep registers under 128 on sm_86 and sm_90 with
  no spills (tests/kv_b_proj/test_kv_b_proj_triton_aot.py reports them).
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


# register budget: 128
@triton.jit(do_not_specialize=["M"])  # batch-varying: no re-compile
def _w4a16_kernel(a_ptr, b_ptr, s_ptr, g_ptr, c_ptr, M, N, K,
                  stride_am, stride_bn, stride_sn, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr):
    # EVEN_K (K % BLOCK_K == 0): no mask along K, so the loads stay 16-byte vectors.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 before any stride product (int32 row offsets wrapped past 2^31).
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_K // 2)   # packed bytes of a K tile
    offs_s = tl.arange(0, BLOCK_K // 16)  # its block scales
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_p[None, :]
    s_ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_s[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            packed = tl.load(b_ptrs, mask=n_ok[:, None], other=0)
            sbyte = tl.load(s_ptrs, mask=n_ok[:, None], other=0)
        else:
            k_left = K - kb * BLOCK_K  # K % 16 == 0: whole bytes and whole scale blocks
            a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            packed = tl.load(b_ptrs, mask=n_ok[:, None] & (offs_p[None, :] < k_left // 2), other=0)
            sbyte = tl.load(s_ptrs, mask=n_ok[:, None] & (offs_s[None, :] < k_left // 16), other=0)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.int16)
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)  # e2m1 * 2^-14 as fp16 bits
        v = bits.to(tl.float16, bitcast=True).to(tl.float32)
        sc = e4m3_to_f32(sbyte.to(tl.int32)) * 16384.0
        w = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 16)) * sc[:, :, None], (BLOCK_N, BLOCK_K))
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 16
    acc = acc * tl.load(g_ptr)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _config(m: int, n: int | None = None, sm_count: int | None = None) -> dict:
    """Launch config of the kernel for M rows (and N columns on a device
    with `sm_count` SMs: M <= 16 takes 32-column tiles when 64-column ones would
    leave SMs idle). Registers on sm_86 / sm_90 (ptxas, triton 3.8, K = 512): 52-70
    (M <= 16), 111-120 (<= 32), 82-92 (<= 64), 82-113 (larger); no spills."""
    if _interpreting():
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=1, DOT_FP32=True)
    if m <= 16:
        bn = 64 if n is None or not sm_count or triton.cdiv(n, 64) >= sm_count else 32
        return dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=64, num_warps=4, num_stages=4, DOT_FP32=False)
    if m <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, DOT_FP32=False)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, DOT_FP32=False)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=4, DOT_FP32=False)


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
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else None
    cfg = _config(m, n, sms)
    cfg["EVEN_K"] = k % cfg["BLOCK_K"] == 0
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    with launch_guard(out):
        _w4a16_kernel[grid](x, w_packed, w_scale.view(torch.uint8), global_scale, out, m, n, k,
                     x.stride(0), w_packed.stride(0), w_scale.stride(0), out.stride(0), **cfg)
    return out
