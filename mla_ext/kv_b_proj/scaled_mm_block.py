"""Block-FP8 W8A8 kv_b_proj through torch._scaled_mm's cuBLASLt blockwise scaling.

DeepSeek's recipe (activations 1 x 128, weights 128 x 128, fp32 scales) is what
cuBLASLt runs natively on sm_90 from CUDA 12.9 on (PyTorch PR 158037). For
A = x [M, K] and B = W^T [K, N] (W [N, K] row-major, so B is column-major):

- scale_a: [M, K/128], strides (1, M): M-major (`triton_group_quant` writes it so);
- scale_b: [L4, N/128], strides (1, L4), L4 = round_up(K/128, 4) (PyTorch PR 166752:
  before it, torch passed L = K/128 and cuBLASLt read wrong scales when L % 4 != 0);
- an explicit out_dtype (bf16 or fp16);
- M a multiple of 4 (the M-major scale's leading dimension is 16-byte aligned).

To satisfy every torch version at once, K is zero-padded to Kp = a multiple of 512
(so L4 = L = Kp/128 and both the old and the new scale_b rule hold) and M to a
multiple of 4: zero rows/columns add nothing. DeepSeek's kv_b_proj has K = 512, so
there the weight is used as loaded and only M may be padded. The weight side
(`BlockScaledWeight`: the padded fp8 weight and its 128 x 128 scales in cuBLASLt's
layout) is built once per layer and device (`KvBProj` caches it); each call
quantizes x (one Triton kernel) and runs one GEMM.

Whether this torch's `_scaled_mm` takes blockwise scales on a device is probed
once per (device, out dtype) with a tiny GEMM checked against a float reference
(`blockwise_scaled_mm_reasons`): on the CPU it does not (torch 2.14 says "Invalid
scaling configuration"); on sm_90 it depends on the torch and cuBLAS build.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from mla_ext.compat import _first_line
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import triton_group_quant as gq

BLOCK = ref.FP8_BLOCK
K_MULTIPLE = 4 * BLOCK   # K/128 a multiple of 4: L4 == L
M_MULTIPLE = 4
OUT_DTYPES = (torch.bfloat16, torch.float16)
NEEDS_CAPABILITY_MAJOR = 9  # cuBLASLt's 1x128 / 128x128 block scaling is Hopper-only


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


@dataclass(frozen=True)
class BlockScaledWeight:
    """The weight side of the GEMM, in cuBLASLt's layout.

    weight  float8_e4m3fn [N, Kp] contiguous (columns K..Kp are zeros); `b` = weight.t()
    scale   float32 [Kp/128, N/128] with strides (1, Kp/128): cuBLASLt's [L4, N/128]
    """

    weight: torch.Tensor
    scale: torch.Tensor
    N: int
    K: int
    Kp: int

    @property
    def b(self) -> torch.Tensor:
        """mat2 of torch._scaled_mm: [Kp, N], column-major."""
        return self.weight.t()

    @property
    def device(self) -> torch.device:
        return self.weight.device


def shape_reasons(n: int, k: int) -> list[str]:
    """Why a [N, K] weight cannot go through this GEMM (empty: it can)."""
    why = []
    if n % BLOCK:
        why.append(f"N={n} must be a multiple of {BLOCK} (whole 128 x 128 weight-scale blocks for cuBLASLt)")
    if k < 1:
        why.append(f"K={k} must be >= 1")
    return why


def prepare_weight(w_q: torch.Tensor, w_s: torch.Tensor, k_multiple: int = K_MULTIPLE) -> BlockScaledWeight:
    """w_q fp8 e4m3 [N, K], w_s fp32 [ceil(N/128), ceil(K/128)] (the checkpoint layout,
    w = q * s) -> the GEMM's weight side, on w_q's device. A copy only where K is
    padded; the scales are always a small new tensor."""
    if not isinstance(w_q, torch.Tensor) or w_q.dim() != 2 or w_q.dtype != torch.float8_e4m3fn:
        got = f"{w_q.dtype} {tuple(w_q.shape)}" if isinstance(w_q, torch.Tensor) else type(w_q).__name__
        raise ValueError(f"w_q: expected a float8_e4m3fn [N, K] tensor, got {got}")
    n, k = w_q.shape
    why = shape_reasons(n, k)
    if why:
        raise ValueError("w_q: " + "; ".join(why))
    if k_multiple % K_MULTIPLE:
        raise ValueError(f"k_multiple: expected a multiple of {K_MULTIPLE}, got {k_multiple}")
    gn, gk = n // BLOCK, -(-k // BLOCK)
    if not isinstance(w_s, torch.Tensor) or tuple(w_s.shape) != (gn, gk) or not w_s.dtype.is_floating_point:
        got = f"{w_s.dtype} {tuple(w_s.shape)}" if isinstance(w_s, torch.Tensor) else type(w_s).__name__
        raise ValueError(f"w_s: expected float [{gn}, {gk}] (ceil(N/128), ceil(K/128)), got {got}")
    kp = _round_up(k, k_multiple)
    if kp == k and w_q.is_contiguous():
        w = w_q
    else:
        w = torch.zeros((n, kp), dtype=torch.float8_e4m3fn, device=w_q.device)
        w[:, :k] = w_q
    l4 = kp // BLOCK
    # [L4, N/128] with strides (1, L4): a contiguous [N/128, L4] buffer, transposed.
    s = torch.ones((gn, l4), dtype=torch.float32, device=w_q.device)
    s[:, :gk] = w_s.to(device=w_q.device, dtype=torch.float32)
    return BlockScaledWeight(w, s.t(), n, k, kp)


# -- capability probe -----------------------------------------------------------

_PROBE_LOCK = threading.Lock()
_PROBED: dict[tuple[str, int, torch.dtype], str | None] = {}


def _probe_key(device: torch.device, out_dtype: torch.dtype) -> tuple[str, int, torch.dtype]:
    device = torch.device(device)
    if device.type == "cuda":
        return ("cuda", device.index if device.index is not None else torch.cuda.current_device(), out_dtype)
    return (device.type, -1, out_dtype)


def _run_probe(device: torch.device, out_dtype: torch.dtype) -> str | None:
    """A tiny blockwise GEMM (M=4, K=512, N=256, distinct power-of-two scales per
    block) against a float reference; None when it is right."""
    where = (f"{torch.cuda.get_device_name(device)} ({device})" if device.type == "cuda" else str(device))
    if not hasattr(torch, "_scaled_mm"):
        return f"torch._scaled_mm is missing from torch {torch.__version__}"
    m, k, n = M_MULTIPLE, K_MULTIPLE, 2 * BLOCK
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-2, 3, (m, k), generator=g).float()
    b = torch.randint(-2, 3, (n, k), generator=g).float()
    sa = torch.exp2(torch.randint(-2, 3, (m, k // BLOCK), generator=g).float())
    sb = torch.exp2(torch.randint(-2, 3, (n // BLOCK, k // BLOCK), generator=g).float())
    want = (a * sa.repeat_interleave(BLOCK, 1)) @ (b * ref.expand_block_scales(sb, n, k)).t()
    try:
        scale_a = gq.mmajor_scales(m, k // BLOCK, device)
        scale_a.copy_(sa)
        w = prepare_weight(b.to(torch.float8_e4m3fn).to(device), sb.to(device))
        y = torch._scaled_mm(a.to(torch.float8_e4m3fn).to(device), w.b, scale_a=scale_a, scale_b=w.scale,
                             out_dtype=out_dtype)
        y = y.float().cpu()
    except Exception as exc:  # noqa: BLE001 - whatever this build raises is the answer
        return (f"torch._scaled_mm of torch {torch.__version__} on {where} does not take blockwise "
                f"1x128 x 128x128 fp32 scales ({_first_line(exc)})")
    ok = torch.isfinite(y).all() and bool(((y - want).abs() <= 0.01 * want.abs() + 1e-3 * want.abs().max()).all())
    if not ok:
        err = float((y - want).abs().max() / want.abs().max())
        return (f"torch._scaled_mm of torch {torch.__version__} on {where} gives wrong results with blockwise "
                f"1x128 x 128x128 scales in cuBLASLt's layout (max error {err:.3g} of max|ref|)")
    return None


def blockwise_scaled_mm_error(device, out_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The probe's verdict for (device, out_dtype), run once per process; None: it works.
    Never probes inside a CUDA graph capture (returns a reason instead, uncached)."""
    device = torch.device(device)
    key = _probe_key(device, out_dtype)
    if key in _PROBED:
        return _PROBED[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return (f"blockwise torch._scaled_mm on {device} not probed yet and a CUDA graph is being captured; "
                "call KvBProj.prepare() (or run one eager forward) before capturing")
    with _PROBE_LOCK:
        if key not in _PROBED:
            if device.type == "cuda":
                with torch.cuda.device(key[1]):
                    _PROBED[key] = _run_probe(torch.device("cuda", key[1]), out_dtype)
            else:
                _PROBED[key] = _run_probe(device, out_dtype)
        return _PROBED[key]


def blockwise_scaled_mm_probed(device, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    return _probe_key(torch.device(device), out_dtype) in _PROBED


def blockwise_scaled_mm_reasons(device, out_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Why this GEMM cannot run on `device` with `out_dtype` output (empty: it can):
    the device type, the architecture (sm_90 only), the out dtype, then the probe."""
    device = torch.device(device)
    why = []
    if out_dtype not in OUT_DTYPES:
        why.append(f"out dtype must be bf16 or fp16 (cuBLASLt blockwise fp8), got {out_dtype}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return why + ["no CUDA device is available"]
        cap = torch.cuda.get_device_capability(device)
        if cap[0] != NEEDS_CAPABILITY_MAJOR:
            return why + [f"needs sm_90 (cuBLASLt's 1x128 / 128x128 block scaling is Hopper-only), "
                          f"device is sm_{cap[0]}{cap[1]}"]
    elif device.type != "cpu":
        return why + [f"unsupported device type {device.type!r}"]
    if why:
        return why
    err = blockwise_scaled_mm_error(device, out_dtype)
    return [] if err is None else [err]


# -- the GEMM ---------------------------------------------------------------------

def quantize_activation(x: torch.Tensor, kp: int, x_scale: torch.Tensor | None = None,
                        use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 [Mp, kp], scales fp32 [Mp, kp/128] M-major), Mp = round_up(M, 4).

    bf16/fp16/fp32 x: dynamic 1 x 128 quantization (`triton_group_quant`). fp8 x (FP8
    prefill): used as it is, with its `x_scale` (per tensor [1] or per row [M, 1],
    default 1) as every group's scale of the row; copied only to pad M or K."""
    m, k = x.shape
    if x.dtype != torch.float8_e4m3fn:
        return gq.per_token_group_quant_fp8_mmajor(x, M_MULTIPLE, kp, use_triton=use_triton)
    mp = _round_up(m, M_MULTIPLE)
    if mp == m and k == kp and x.is_contiguous():
        q = x
    else:
        q = torch.zeros((mp, kp), dtype=torch.float8_e4m3fn, device=x.device)
        q[:m, :k] = x
    scales = gq.mmajor_scales(mp, kp // BLOCK, x.device)
    scales.fill_(1.0)
    if x_scale is not None:
        s = x_scale.to(device=x.device, dtype=torch.float32).reshape(-1, 1)
        rows = m if s.shape[0] == m else mp  # per-row scales, else one for every row
        scales[:rows].copy_(s.expand(rows, kp // BLOCK))  # padding rows (zeros) keep scale 1
    return q, scales


def scaled_mm_block_linear(x: torch.Tensor, w: BlockScaledWeight, out_dtype: torch.dtype,
                           x_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           use_triton: bool | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in `out_dtype` (bf16/fp16), W given by `prepare_weight`.

    x: bf16/fp16/fp32 (quantized here, 1 x 128 groups) or float8_e4m3fn (with an
    optional per-tensor fp32 `x_scale`); unit stride along K. `out`: [M, N] with unit
    column stride, written in place and returned."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != w.K:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a 2-D tensor [M, K={w.K}], got {got}")
    if x.dtype not in gq.X_DTYPES + (torch.float8_e4m3fn,):
        raise ValueError(f"x: dtype must be bf16, fp16, fp32 or float8_e4m3fn, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x: must have unit stride along K, got strides {tuple(x.stride())}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float16, got {out_dtype}")
    if x.device != w.device:
        raise ValueError(f"x: must be on the weight's device {w.device}, got {x.device}")
    m = x.shape[0]
    if out is not None and (tuple(out.shape) != (m, w.N) or out.dtype != out_dtype or out.device != x.device
                            or (w.N > 1 and out.stride(1) != 1)):
        raise ValueError(f"out: expected {out_dtype} [{m}, {w.N}] on {x.device} with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    if m == 0:
        return out if out is not None else torch.empty((0, w.N), dtype=out_dtype, device=x.device)
    q, scales = quantize_activation(x, w.Kp, x_scale, use_triton)
    if q.shape[0] == m and out is not None and out.is_contiguous():
        return torch._scaled_mm(q, w.b, scale_a=scales, scale_b=w.scale, out_dtype=out_dtype, out=out)
    y = torch._scaled_mm(q, w.b, scale_a=scales, scale_b=w.scale, out_dtype=out_dtype)
    y = y[:m]
    if out is None:
        return y
    out.copy_(y)
    return out
