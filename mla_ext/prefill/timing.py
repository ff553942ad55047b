"""Per-step timing and work counts for one MLA prefill-with-context layer.

`StepClock` is the optional `clock` of `MLAPrefill.forward`: the layer calls
`clock.mark(step)` after each step, and the time since the previous mark is
added to that step. On a GPU a mark records a CUDA event (no host sync on the
hot path; `totals()` synchronises once at the end), on the CPU it reads
`time.perf_counter()`. Steps (SPEC §1): gather, kv_b_proj, keys (the split
keys k_nope / k_pe in the attention dtype: casts only, no [M, N, P+R] build), attention (new tokens and context chunks), merge.

`step_work` counts what each step must move or compute for a batch, from the
layer's resolved plan (its chunk plan, cache format and workspace dtype), so
that a time becomes GB/s or TFLOP/s:
  gather     bytes: cache rows read (page format's bytes per token) + workspace
             rows written (E elements of the workspace dtype)
  kv_b_proj  flops: 2*M*N*K over the new tokens and every context chunk
  attention  flops: 2 * visible (query, key) pairs * heads * (Dqk + Dv)
  merge      bytes: every merge reads two partial outputs and LSEs and writes one
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

STEPS = ("gather", "kv_b_proj", "keys", "attention", "merge")


class StepClock:
    """Accumulates time per step between marks (see the module docstring)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str | None, object]] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [(None, self._now())]

    def mark(self, step: str) -> None:
        """The time since the previous mark (or start) belongs to `step`."""
        if not self._marks:
            raise ValueError("StepClock.mark: call start() first")
        self._marks.append((step, self._now()))

    def totals(self) -> dict[str, float]:
        """Seconds per step (and 'total'); synchronises the device once."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for (_, a), (step, b) in zip(self._marks, self._marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[step] = out.get(step, 0.0) + dt
        out["total"] = sum(out.values())
        return out


def causal_pairs(q_len: int) -> int:
    """Visible (query, key) pairs of causal self-attention over q_len new tokens."""
    return q_len * (q_len + 1) // 2


@dataclass(frozen=True)
class StepWork:
    """Bytes moved or flops computed by one step for one batch."""

    step: str
    amount: float
    unit: str  # "bytes" or "flops"

    def rate(self, seconds: float) -> tuple[float, str]:
        """(GB/s or TFLOP/s, unit label) achieved in `seconds`."""
        if self.unit == "bytes":
            return self.amount / seconds / 1e9, "GB/s"
        return self.amount / seconds / 1e12, "TFLOP/s"


def step_work(layer, metadata) -> dict[str, StepWork]:
    """What each step of `layer.forward(..., metadata)` moves or computes."""
    m = layer.model
    spec = layer.spec
    N, E = m.num_heads, m.L + m.R
    T = metadata.num_tokens
    plan = metadata.plan(layer.workspace_rows, layer.chunk_alignment)
    ctx_rows = sum(c.total_rows for c in plan.chunks)
    ws_bytes = torch.empty(0, dtype=layer.workspace_dtype).element_size()
    o_bytes = torch.empty(0, dtype=m.model_dtype).element_size()
    gather = ctx_rows * (spec.bytes_per_token + E * ws_bytes)
    gemm = 2.0 * (T + ctx_rows) * N * (m.P + m.V) * m.L
    pairs = sum(causal_pairs(q) for q in metadata.query_lens)
    for c in plan.chunks:
        q_lens = [b - a for a, b in zip(c.cu_seqlens_q, c.cu_seqlens_q[1:])]
        pairs += sum(q * k for q, k in zip(q_lens, c.chunk_lens))
    attention = 2.0 * pairs * N * (m.P + m.R + m.V)
    # One merge per chunk over its query rows, and the final one over all T.
    merged_rows = sum(c.token_end - c.token_start for c in plan.chunks) + T
    merge = merged_rows * N * 3 * (m.V * o_bytes + 4)
    # The keys stay split (k_nope a view of the kv_b_proj output, k_pe the
    # workspace's rope columns): this step only casts what is not already in the
    # attention dtype (the model dtype). Usually nothing moves.
    keys = 0
    kvb_bytes = torch.empty(0, dtype=layer.kv_b_proj.params_dtype).element_size()
    if layer.kv_b_proj.params_dtype != m.model_dtype:
        keys += (T + ctx_rows) * N * m.P * (kvb_bytes + o_bytes)
    if layer.workspace_dtype != m.model_dtype:
        keys += ctx_rows * m.R * (ws_bytes + o_bytes)
    return {
        "gather": StepWork("gather", gather, "bytes"),
        "kv_b_proj": StepWork("kv_b_proj", gemm, "flops"),
        "keys": StepWork("keys", keys, "bytes"),
        "attention": StepWork("attention", attention, "flops"),
        "merge": StepWork("merge", merge, "bytes"),
    }
