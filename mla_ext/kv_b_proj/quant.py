"""Dynamic per-token-group (1 x 128) fp8 activation quantization.

scale[m, g] = max(amax(x[m, 128g : 128g+128]), eps) / 448, q = saturate(x / scale).
The Triton kernel is used for CUDA tensors; CPU tensors (and the Triton
interpreter, whose fp32 -> fp8 cast is wrong for a few % of values) use the
torch reference, which the kernel is tested against on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_ext.kv_b_proj import reference as ref
from mla_ext.triton_fp8 import launch_guard

GROUP = ref.FP8_BLOCK
EPS = 1e-10


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, eps,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride may pass 2^31
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
    scale = amax / 448.0
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + g, scale, mask=rows < M)


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] > 0 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along K, got strides {x.stride()}")


def per_token_group_quant_fp8(x: torch.Tensor, group: int = GROUP, eps: float = EPS,
                              use_triton: bool | None = None):
    """x [M, K] (row stride may exceed K) -> (fp8 e4m3 [M, K], fp32 scales [M, ceil(K/group)])."""
    _check_x(x)
    if group != GROUP:
        raise ValueError(f"group must be {GROUP}, got {group}")
    if use_triton is None:
        use_triton = x.is_cuda
    if not use_triton:
        return ref.per_token_group_quant_fp8_ref(x, group, eps)
    m, k = x.shape
    g = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    block_m = 16
    with launch_guard(x):
        _quant_kernel[(triton.cdiv(m, block_m), g)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), eps, GROUP=group, BLOCK_M=block_m
        )
    return q, s
