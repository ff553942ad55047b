"""Dynamic per-token-group (1 x 128) fp8 activation quantization.

scale[m, g] = max(amax(x[m, 128g : 128g+128]), eps) / 448, q = saturate(x / scale).
The Triton kernel (`triton_group_quant`, here with row-major scales and no
padding) is used for CUDA tensors; CPU tensors use the torch reference, unless
`use_triton=True` runs the kernel in the interpreter (whose fp32 -> fp8 cast is
wrong for a few % of values, so the final cast is then done in torch).
"""
from __future__ import annotations

import torch
import triton

from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import triton_group_quant as gq

GROUP = ref.FP8_BLOCK
EPS = gq.EPS


# The launch goes through this module-level name (tests replace it to watch launches).
_quant_kernel = gq._group_quant_kernel


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] > 0 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along K, got strides {x.stride()}")


def triton_reasons(device) -> list[str]:
    """Why the Triton quantizer cannot run on `device` (empty: it can). It stores
    float8_e4m3fn, a type Triton has only on sm_89+ (on sm_80/sm_86 the kernel would
    fail to compile); the torch path serves there. CPU tensors (the interpreter)
    store fp32 and cast in torch."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap < (8, 9):
        return [f"the Triton fp8 quantizer stores float8_e4m3fn, which Triton supports on sm_89+ only; "
                f"{device} is sm_{cap[0]}{cap[1]}"]
    return []


def per_token_group_quant_fp8(x: torch.Tensor, group: int = GROUP, eps: float = EPS,
                              use_triton: bool | None = None):
    """x [M, K] (row stride may exceed K) -> (fp8 e4m3 [M, K], fp32 scales [M, ceil(K/group)]).

    use_triton: None picks the Triton kernel for CUDA tensors where it can run
    (`triton_reasons`), else the torch path; True on a device without Triton fp8
    raises ValueError with the reason."""
    _check_x(x)
    if group != GROUP:
        raise ValueError(f"group must be {GROUP}, got {group}")
    if use_triton is None:
        use_triton = x.is_cuda and not triton_reasons(x.device)
    elif use_triton:
        why = triton_reasons(x.device)
        if why:
            raise ValueError("use_triton: " + "; ".join(why))
    if not use_triton:
        return ref.per_token_group_quant_fp8_ref(x, group, eps)
    m, k = x.shape
    s = torch.empty((m, triton.cdiv(k, group)), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device), s
    q = gq.launch_group_quant(x, gq.q_buffer((m, k), x.device), s, eps, block_m=16, kernel=_quant_kernel)
    return q, s
