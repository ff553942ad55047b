"""Per-token-group (1 x 128) fp8 activation quantization with the scales written
M-major, the layout cuBLASLt's block-scaled FP8 GEMM reads (torch._scaled_mm with
DeepSeek's 1x128 activation / 128x128 weight scaling on sm_90).

For x [M, K] (bf16/fp16/fp32, unit stride along K, any row stride) and
Mp = round_up(M, m_multiple), Kp = round_up(K, k_multiple) (k_multiple a multiple
of 128):

    q      float8_e4m3fn [Mp, Kp], contiguous
    scale  float32 [Mp, Kp/128] with strides (1, Mp): M-major (a [Kp/128, Mp]
           contiguous buffer, transposed)

    scale[m, g] = max(amax(x[m, 128g : 128g+128]), eps) / 448
    q[m, k]     = saturate_e4m3(x[m, k] / scale[m, k // 128])

Rows M..Mp and columns K..Kp are quantized as zeros (q = 0, scale = eps / 448), so
they add nothing to a GEMM. The definition is the one of
`reference.per_token_group_quant_fp8_ref` (row-major scales), applied to x padded
with zeros; `per_token_group_quant_fp8_mmajor_ref` is its torch form here.

Both divisions are IEEE round-to-nearest (`tl.math.div_rn`), as in torch, so on a
GPU the scales are bit-identical to the reference and q differs only where the
reference's own fp32 -> e4m3 rounding does (it does not: both round to nearest
even). Under TRITON_INTERPRET=1 the interpreter's fp32 -> fp8 cast is wrong for a
few % of values (toolchain notes): there the kernel stores the scaled fp32 values
and torch does the final cast, so the interpreted kernel is exact too.

Used by the `scaled_mm_block` kv_b_proj backend; usable by any FP8 path that feeds
torch._scaled_mm's blockwise scaling (e.g. FP8 prefill).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_ext import compat
from mla_ext.kv_b_proj import reference as ref
from mla_ext.triton_fp8 import launch_guard

GROUP = ref.FP8_BLOCK
EPS = 1e-10
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# register budget: 128
@triton.jit(do_not_specialize=["M", "Mq", "stride_sg"])  # batch-varying: no re-compile
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, Mq, Kq, stride_xm, stride_qm, stride_sm, stride_sg, eps,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, FP8_OUT: tl.constexpr):
    """One program: BLOCK_M rows x one 128-wide group g of q [Mq, Kq]. Rows >= M and
    columns >= K of x (padding up to Mq, Kq) are quantized as zeros; the scales go to
    s_ptr + row * stride_sm + g * stride_sg (row-major or M-major)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride may pass 2^31
    cols = g * GROUP + tl.arange(0, GROUP)
    in_x = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=in_x, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if FP8_OUT:
        q = q.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=(rows[:, None] < Mq) & (cols[None, :] < Kq))
    tl.store(s_ptr + rows * stride_sm + g.to(tl.int64) * stride_sg, scale, mask=rows < Mq)


def _interpreted(device: torch.device) -> bool:
    return device.type != "cuda" and compat.interpreting()


def q_buffer(shape: tuple[int, int], device) -> torch.Tensor:
    """The q buffer `launch_group_quant` takes: fp8 e4m3, or fp32 where the kernel is
    interpreted (the cast is then done in torch)."""
    device = torch.device(device)
    return torch.empty(shape, dtype=torch.float32 if _interpreted(device) else torch.float8_e4m3fn, device=device)


def launch_group_quant(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, eps: float = EPS,
                       block_m: int | None = None, kernel=None) -> torch.Tensor:
    """Quantize x [M, K] (unit K stride) into q [Mq, Kq] (Mq >= M, Kq >= K, from
    `q_buffer`) and scales [Mq, ceil(Kq/128)] of any strides; what lies beyond x is
    quantized as zeros. Returns q as float8_e4m3fn. `kernel`: the jitted kernel to
    launch (default `_group_quant_kernel`; callers pass their own name for it)."""
    m, k = x.shape
    mq, kq = q.shape
    interpreted = q.dtype == torch.float32
    if mq > 0 and kq > 0:
        if block_m is None:
            # The interpreter's cost is per program instance: few, big tiles. On a GPU,
            # 32 x 128 elements per program: x is read once, the kernel is memory-bound.
            block_m = min(64, triton.next_power_of_2(mq)) if interpreted else 32
        with launch_guard(q):
            (kernel or _group_quant_kernel)[(triton.cdiv(mq, block_m), triton.cdiv(kq, GROUP))](
                x, q, scales, m, k, mq, kq, x.stride(0) if m > 0 else k, q.stride(0),
                scales.stride(0), scales.stride(1), eps, GROUP=GROUP, BLOCK_M=block_m, FP8_OUT=not interpreted,
                num_warps=4,
            )
    return ref.quantize_e4m3(q) if interpreted else q


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _check_args(x, m_multiple, k_multiple) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a 2-D tensor [M, K], got {got}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x: dtype must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x: must have unit stride along K, got strides {tuple(x.stride())}")
    for name, v in (("m_multiple", m_multiple), ("k_multiple", k_multiple)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if k_multiple % GROUP:
        raise ValueError(f"k_multiple: expected a multiple of {GROUP} (whole scale groups), got {k_multiple}")


def padded_shape(m: int, k: int, m_multiple: int = 4, k_multiple: int = GROUP) -> tuple[int, int]:
    """(Mp, Kp) of the quantized activation for x [m, k]."""
    return _round_up(m, m_multiple), _round_up(max(k, 1), k_multiple)


def mmajor_scales(mp: int, groups: int, device) -> torch.Tensor:
    """An uninitialised fp32 [mp, groups] tensor with strides (1, mp)."""
    return torch.empty((groups, mp), dtype=torch.float32, device=device).t()


def per_token_group_quant_fp8_mmajor_ref(x: torch.Tensor, m_multiple: int = 4, k_multiple: int = GROUP,
                                         eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `per_token_group_quant_fp8_mmajor` (same outputs, same layout)."""
    _check_args(x, m_multiple, k_multiple)
    m, k = x.shape
    mp, kp = padded_shape(m, k, m_multiple, k_multiple)
    xp = torch.zeros((mp, kp), dtype=torch.float32, device=x.device)
    xp[:m, :k] = x.float()
    q, s = ref.per_token_group_quant_fp8_ref(xp, GROUP, eps)
    out = mmajor_scales(mp, kp // GROUP, x.device)
    out.copy_(s)
    return q, out


def per_token_group_quant_fp8_mmajor(x: torch.Tensor, m_multiple: int = 4, k_multiple: int = GROUP,
                                     eps: float = EPS, use_triton: bool | None = None,
                                     block_m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 e4m3 [Mp, Kp] contiguous, scales fp32 [Mp, Kp/128] strides (1, Mp)).

    `use_triton`: None = the Triton kernel for CUDA tensors on sm_89+, the torch
    reference otherwise; True on a CPU tensor runs the kernel in the Triton interpreter
    (TRITON_INTERPRET=1), with the final fp8 cast done in torch (see the module doc).
    """
    _check_args(x, m_multiple, k_multiple)
    native = x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)
    if use_triton is None:
        use_triton = native
    elif use_triton and x.is_cuda and not native:
        cap = torch.cuda.get_device_capability(x.device)
        raise ValueError(f"use_triton: the kernel stores fp8 e4m3, which Triton compiles for sm_89+ only; "
                         f"{x.device} is sm_{cap[0]}{cap[1]} (pass use_triton=None for the torch reference)")
    if not use_triton:
        return per_token_group_quant_fp8_mmajor_ref(x, m_multiple, k_multiple, eps)
    m, k = x.shape
    mp, kp = padded_shape(m, k, m_multiple, k_multiple)
    scales = mmajor_scales(mp, kp // GROUP, x.device)
    q = launch_group_quant(x, q_buffer((mp, kp), x.device), scales, eps, block_m)
    return q, scales
