"""Attention sinks: one learnable logit per head that joins every softmax.

Some MLA families (transformers' hy_v4, like GPT-OSS) append a per-head logit
`sink[n]` to each query row's scaled scores before the softmax and drop its
probability afterwards: the row's weights sum to less than one. With a row's
result given as (o, lse) over its keys,

    o'   = o * exp(lse) / (exp(lse) + exp(sink)) = o * sigmoid(lse - sink)
    lse' = logaddexp(lse, sink)

so the sink folds into a finished partial result exactly. Merging partial
results (SPEC §7) stays exact as long as the sink enters exactly one of them:
the prefill layer folds it into the new-token pass, which every query row has.
A row with no key (lse = -inf) gets o' = 0 and lse' = sink.

The sink is a raw logit: the softmax scale multiplies the scores, not it.
"""
from __future__ import annotations

import torch


def check_sinks(sinks, num_heads: int, device: torch.device, name: str = "sinks") -> torch.Tensor | None:
    """None, or a finite float tensor [num_heads] on `device`, returned as float32."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"{name}: expected a float tensor [{num_heads}] (one logit per head) or "
                         f"None, got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point or tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"{name}: expected a float tensor [{num_heads}] (one logit per head), "
                         f"got {tuple(sinks.shape)} {sinks.dtype}")
    if sinks.device != torch.device(device):
        raise ValueError(f"{name}: expected device {device} (as q), got {sinks.device}")
    if sinks.device.type == "cpu" and not bool(torch.isfinite(sinks).all()):
        raise ValueError(f"{name}: expected finite logits, got {sinks.tolist()}")
    return sinks.float()


def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, N, D], lse [N, T] fp32) of a finished row set -> the same rows with
    the per-head sink logits [N] (fp32) in their softmax; o keeps its dtype."""
    s = sinks.float()[:, None]  # [N, 1]
    keep = torch.sigmoid(lse - s)  # exp(lse) / (exp(lse) + exp(s)); 0 where lse = -inf
    o_new = (o.float() * keep.transpose(0, 1).unsqueeze(-1)).to(o.dtype)
    return o_new, torch.logaddexp(lse, s.expand_as(lse))
