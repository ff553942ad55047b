"""The DSA indexer query's RoPE + per-(token, head) e4m3 quantization with the q scale folded into
the score weights: vLLM 0.33's fused_indexer_q_rope_quant (deepseek_v2.py's indexer; contract in
mla_ext/sparse/indexer_ops_reference.py), for GPUs whose Triton has no fp8e4nv (below sm_89).

indexer_q_rope_quant(positions, q, cos_sin_cache, weights, softmax_scale, head_scale, is_neox)
    -> (q e4m3 [T, H, D] float8_e4m3fn, weights * q_scale * softmax_scale * head_scale fp32 [T, H])

Backends (mla_ext.dispatch): Triton (triton_indexer_quant.py; CPU tensors only when forced, under
TRITON_INTERPRET=1) and torch (the reference itself: float64 where it is exact, fp32 where vLLM's
kernel computes in fp32). ValueError naming the argument for a wrong dtype / shape / device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.dispatch import Backend, Dispatcher, report_device
from mla_ext.sparse.indexer_ops_reference import indexer_q_rope_quant_reference


def _check(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class QQuantInputs:
    positions: Tensor
    q: Tensor
    cos_sin_cache: Tensor
    weights: Tensor
    softmax_scale: float
    head_scale: float
    is_neox: bool
    q_out: Tensor  # uint8 [T, H, D]
    w_out: Tensor  # fp32 [T, H]

    @property
    def device(self) -> torch.device:
        return self.q.device


def _triton_reasons(x: QQuantInputs) -> list[str]:
    from mla_ext.attention.triton_latent import _pad
    from mla_ext.sparse.triton_indexer_quant import not_supported_reasons

    why = not_supported_reasons(x.q)
    if x.device.type == "cpu" and INDEXER_Q_QUANT._forced_name() != "triton":
        why.append("CPU tensors: the Triton interpreter runs only when forced")
    if _pad(x.q.shape[-1]) > 256:
        why.append(f"head_dim {x.q.shape[-1]} is above the 256 the kernel's tile holds")
    return why


def _run_triton(x: QQuantInputs) -> None:
    from mla_ext.sparse.triton_indexer_quant import q_rope_quant_triton

    q_rope_quant_triton(x.positions, x.q, x.cos_sin_cache, x.weights, x.softmax_scale, x.head_scale, x.is_neox,
                        x.q_out, x.w_out)


def _run_torch(x: QQuantInputs) -> None:
    qf, w = indexer_q_rope_quant_reference(x.positions, x.q, x.cos_sin_cache, x.weights, x.softmax_scale,
                                           x.head_scale, x.is_neox)
    x.q_out.copy_(qf.view(torch.uint8))
    x.w_out.copy_(w)


INDEXER_Q_QUANT = Dispatcher("indexer_q_quant", [
    Backend("triton", _triton_reasons, _run_triton),
    Backend("torch", lambda x: [], _run_torch),
])


def indexer_q_rope_quant(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, weights: Tensor, softmax_scale: float,
                         head_scale: float, is_neox: bool) -> tuple[Tensor, Tensor]:
    """q [T, H, D] bf16/fp16/fp32 (RoPE on its first R dims), positions [T] int, cos_sin_cache
    [max_pos, R] (cos | sin halves), weights [T, H] -> (float8_e4m3fn [T, H, D], fp32 [T, H])."""
    check_no_meta(positions=positions, q=q, cos_sin_cache=cos_sin_cache, weights=weights)
    _check(q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"q: expected a bf16 [num_tokens, n_heads, head_dim] tensor, got {q.dtype} {tuple(q.shape)}")
    T, H, D = q.shape
    dev = q.device
    _check(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] % 2 == 0 and 0 < cos_sin_cache.shape[1] <= D
           and cos_sin_cache.is_floating_point(),
           f"cos_sin_cache: expected a float [max_position, rope_dim] tensor (rope_dim even, <= {D}), got "
           f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    _check(positions.dim() == 1 and positions.shape[0] == T and positions.dtype in (torch.int32, torch.int64),
           f"positions: expected int [{T}], got {positions.dtype} {tuple(positions.shape)}")
    _check(weights.dim() == 2 and tuple(weights.shape) == (T, H) and weights.is_floating_point(),
           f"weights: expected a float [{T}, {H}] tensor, got {weights.dtype} {tuple(weights.shape)}")
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache), ("weights", weights)):
        _check(t.device == dev, f"{name}: on {t.device}, expected q's device {dev}")
    if dev.type == "cpu" and T:  # a position past the table would read outside it (on CUDA: no host sync)
        _check(int(positions.min()) >= 0 and int(positions.max()) < cos_sin_cache.shape[0],
               f"positions: expected values in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache's rows)")
    q_out = torch.empty(T, H, D, dtype=torch.uint8, device=dev)
    w_out = torch.empty(T, H, dtype=torch.float32, device=dev)
    INDEXER_Q_QUANT(QQuantInputs(positions.contiguous(), q if q.stride(-1) == 1 else q.contiguous(),
                                 cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous(),
                                 weights, float(softmax_scale), float(head_scale), bool(is_neox), q_out, w_out))
    return q_out.view(torch.float8_e4m3fn), w_out


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for a probe on `device` (default: CUDA if visible)."""
    dev = report_device(device)
    q = torch.empty(1, 1, 128, dtype=torch.bfloat16, device=dev)
    x = QQuantInputs(torch.zeros(1, dtype=torch.int64, device=dev), q, torch.empty(1, 64, device=dev),
                     torch.empty(1, 1, device=dev), 1.0, 1.0, False, q.view(torch.uint8)[..., :128],
                     torch.empty(1, 1, device=dev))
    return [(INDEXER_Q_QUANT.op, b.name, b.not_supported_reasons(x)) for b in INDEXER_Q_QUANT.backends]
