"""Public attention-stage API: varlen attention with LSE, and merge_attn_states.

Both ops validate their arguments here (ValueError naming the argument and
the expected value), then go through mla_ext.dispatch, so every backend can
say why it cannot serve an input and tests/benchmarks can force one:

- ``varlen_attention``: "triton" (CUDA tensors, or CPU tensors under
  TRITON_INTERPRET=1), then "torch" (reference.py: per-request fp32 softmax,
  correct anywhere, slow).
- ``merge_attn_states``: "cuda" (C++/CUDA kernel), "cpu" (C++/OpenMP kernel),
  "triton", then "torch" (reference.py).

Force a backend with ``ATTENTION.force("torch")`` / ``MERGE.force("cpu")`` or
the environment (MLA_EXT_FORCE_ATTENTION=torch, MLA_EXT_FORCE_MERGE=cpu).
Neither op synchronises the host on the CUDA backends (no .item(), no
data-dependent shapes), so both can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass

import torch

from mla_ext import _ext
from mla_ext.attention import reference
from mla_ext.cache.checks import check_no_internal_overlap, check_no_overlap
from mla_ext.dispatch import Backend, Dispatcher

O_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------

def _triton_reasons(tensors: list[torch.Tensor]) -> list[str]:
    why = []
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return [f"triton is not importable ({exc})"]
    dev = tensors[0].device
    if dev.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            why.append("CPU tensors need TRITON_INTERPRET=1 (set before mla_ext is imported)")
    elif dev.type != "cuda":
        why.append(f"tensors are on {dev}, Triton needs CUDA (or CPU under TRITON_INTERPRET=1)")
    return why


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# Scalars are checked, not coerced: int(4.7), bool("no") or float("0.1") would
# turn a caller's mistake into a silently different computation.
def _count(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    try:
        n = operator.index(value)  # ints and numpy integers, not floats
    except TypeError:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}") from None
    _check(n >= 0, f"{name}: expected an int >= 0, got {n}")
    return n


def _flag(value, name: str) -> bool:
    _check(isinstance(value, bool), f"{name}: expected a bool, got {value!r}")
    return value


def _scale(value) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value > 0
    _check(ok, f"softmax_scale: expected a finite positive number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------
# varlen attention
# ---------------------------------------------------------------------------

@dataclass
class AttentionInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool


def _attn_triton_reasons(x: AttentionInputs) -> list[str]:
    why = _triton_reasons([x.q])
    if max(x.q.shape[-1], x.v.shape[-1]) > 256:
        # Padded tiles above 256 no longer fit sm_86 shared memory (99 KB).
        why.append(f"head dims (qk {x.q.shape[-1]}, v {x.v.shape[-1]}) above 256 are not tiled")
    return why


def _attn_triton_run(x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    from mla_ext.attention.triton_attention import varlen_attention_triton

    tq, n, _ = x.q.shape
    # Rows outside every request (cu_seqlens_q[-1] < Tq) are defined as empty.
    out = torch.zeros(tq, n, x.v.shape[-1], dtype=x.q.dtype, device=x.q.device)
    lse = torch.full((n, tq), float("-inf"), dtype=torch.float32, device=x.q.device)
    varlen_attention_triton(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.max_seqlen_q,
        x.softmax_scale, x.causal, out, lse,
    )
    return out, lse


def _attn_torch_run(x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.varlen_attention_ref(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.softmax_scale, x.causal
    )


ATTENTION = Dispatcher(
    "attention",
    [
        Backend("triton", _attn_triton_reasons, _attn_triton_run),
        Backend("torch", lambda x: [], _attn_torch_run),
    ],
)


def _validate_attention(x: AttentionInputs) -> None:
    q, k, v = x.q, x.k, x.v
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(t, torch.Tensor) and t.dim() == 3,
               f"{name}: expected a 3-D tensor [tokens, heads, head_dim]")
        _check(t.dtype in O_DTYPES, f"{name}: expected dtype bfloat16, float16 or float32, got {t.dtype}")
        _check(t.dtype == q.dtype, f"{name}: expected dtype {q.dtype} (as q), got {t.dtype}")
        _check(t.device == q.device, f"{name}: expected device {q.device} (as q), got {t.device}")
        _check(t.shape[-1] <= 1 or t.stride(-1) == 1,
               f"{name}: the head dim must be contiguous (stride 1), got stride {t.stride(-1)}")
    _check(k.shape[1] == q.shape[1] and v.shape[1] == q.shape[1],
           f"k, v: expected {q.shape[1]} heads (as q), got {k.shape[1]} and {v.shape[1]}")
    _check(k.shape[2] == q.shape[2], f"k: expected head dim {q.shape[2]} (as q), got {k.shape[2]}")
    _check(v.shape[0] == k.shape[0], f"v: expected {k.shape[0]} tokens (as k), got {v.shape[0]}")
    for name, cu in (("cu_seqlens_q", x.cu_seqlens_q), ("cu_seqlens_k", x.cu_seqlens_k)):
        _check(isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 1,
               f"{name}: expected a 1-D int32 tensor [batch + 1]")
        _check(cu.dtype == torch.int32, f"{name}: expected dtype int32, got {cu.dtype}")
        _check(cu.device == q.device, f"{name}: expected device {q.device} (as q), got {cu.device}")
        _check(cu.is_contiguous(), f"{name}: expected a contiguous tensor")
    _check(x.cu_seqlens_q.numel() == x.cu_seqlens_k.numel(),
           f"cu_seqlens_k: expected {x.cu_seqlens_q.numel()} entries (as cu_seqlens_q), "
           f"got {x.cu_seqlens_k.numel()}")
    if q.device.type == "cpu":
        # Checked mode: on the CPU the offsets are host data, so out-of-range
        # requests are caught here instead of becoming out-of-bounds reads.
        # (On CUDA this would synchronise the host; the caller owns the contract.)
        for name, cu, rows, mx in (
            ("cu_seqlens_q", x.cu_seqlens_q, q.shape[0], x.max_seqlen_q),
            ("cu_seqlens_k", x.cu_seqlens_k, k.shape[0], x.max_seqlen_k),
        ):
            lens = cu[1:] - cu[:-1]
            _check(int(cu[0]) >= 0 and bool((lens >= 0).all()),
                   f"{name}: expected non-decreasing offsets starting at >= 0")
            _check(int(cu[-1]) <= rows, f"{name}: last offset {int(cu[-1])} exceeds the {rows} rows")
            _check(lens.numel() == 0 or int(lens.max()) <= mx,
                   f"max_seqlen for {name}: expected >= the longest request "
                   f"({int(lens.max()) if lens.numel() else 0}), got {mx}")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    return_lse: bool = True,
):
    """Variable-length multi-head attention with LSE, for MLA shapes.

    q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] (Dqk = P+R and Dv = V may
    differ; up to 256 on the Triton backend, any size on torch; token/head
    strides are free, the head dim must be contiguous); cu_seqlens_q / cu_seqlens_k int32 [B+1] offsets; request b
    attends its queries cu_seqlens_q[b]:[b+1] to its keys cu_seqlens_k[b]:[b+1].

    causal=True masks bottom-right aligned: query i sees keys
    j <= i + (k_len - q_len) (for the new-token pass q_len == k_len).
    Rows without a visible key (k_len 0, or fully masked) get o = 0,
    lse = -inf; query rows past cu_seqlens_q[-1] too.

    Returns (o [Tq, N, Dv] in q.dtype, lse [N, Tq] float32, natural log), or
    just o when return_lse is False. max_seqlen_q/k must bound the request
    lengths (checked on CPU; on CUDA it sizes the grid without a sync).
    """
    x = AttentionInputs(q, k, v, cu_seqlens_q, cu_seqlens_k, _count(max_seqlen_q, "max_seqlen_q"),
                        _count(max_seqlen_k, "max_seqlen_k"), _scale(softmax_scale),
                        _flag(causal, "causal"))
    _validate_attention(x)
    o, lse = ATTENTION(x)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------

@dataclass
class MergeInputs:
    out: torch.Tensor
    out_lse: torch.Tensor | None
    o1: torch.Tensor
    lse1: torch.Tensor
    o2: torch.Tensor
    lse2: torch.Tensor


def _compiled_reasons(device_type: str):
    def reasons(x: MergeInputs) -> list[str]:
        why = []
        if x.out.device.type != device_type:
            why.append(f"tensors are on {x.out.device}, this backend needs {device_type}")
        if not _ext.available():
            why.append(_ext.load_error() or "mla_ext._C is not built")
        elif device_type == "cuda" and x.out.device.type == "cuda":
            ok, msg = _ext.cuda_kernels_usable()
            if not ok:
                why.append(msg)
        return why

    return reasons


def _merge_compiled_run(x: MergeInputs) -> None:
    _ext.ops().merge_attn_states(x.out, x.out_lse, x.o1, x.lse1, x.o2, x.lse2)


def _merge_triton_run(x: MergeInputs) -> None:
    from mla_ext.attention.triton_merge import merge_attn_states_triton

    merge_attn_states_triton(x.out, x.out_lse, x.o1, x.lse1, x.o2, x.lse2)


def _merge_torch_run(x: MergeInputs) -> None:
    o, lse = reference.merge_attn_states_ref(x.o1, x.lse1, x.o2, x.lse2)
    x.out.copy_(o)
    if x.out_lse is not None:
        x.out_lse.copy_(lse)


MERGE = Dispatcher(
    "merge",
    [
        Backend("cuda", _compiled_reasons("cuda"), _merge_compiled_run),
        Backend("cpu", _compiled_reasons("cpu"), _merge_compiled_run),
        Backend("triton", lambda x: _triton_reasons([x.out]), _merge_triton_run),
        Backend("torch", lambda x: [], _merge_torch_run),
    ],
)


def _validate_merge(x: MergeInputs) -> None:
    _check(isinstance(x.o1, torch.Tensor) and x.o1.dim() == 3, "prefix_output (o1): expected [T, N, D]")
    t, n, d = x.o1.shape
    for name, o in (("o1", x.o1), ("o2", x.o2), ("out", x.out)):
        _check(isinstance(o, torch.Tensor) and tuple(o.shape) == (t, n, d),
               f"{name}: expected shape [{t}, {n}, {d}] (as o1), got "
               f"{tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__}")
        _check(o.dtype in O_DTYPES, f"{name}: expected dtype bfloat16, float16 or float32, got {o.dtype}")
        _check(o.dtype == x.o1.dtype, f"{name}: expected dtype {x.o1.dtype} (as o1), got {o.dtype}")
        _check(o.device == x.o1.device, f"{name}: expected device {x.o1.device} (as o1), got {o.device}")
        _check(d <= 1 or o.stride(2) == 1,
               f"{name}: the head dim must be contiguous (stride 1), got stride {o.stride(2)}")
    lses = [("lse1", x.lse1), ("lse2", x.lse2)] + ([("out_lse", x.out_lse)] if x.out_lse is not None else [])
    for name, lse in lses:
        _check(isinstance(lse, torch.Tensor) and tuple(lse.shape) == (n, t),
               f"{name}: expected shape [{n}, {t}] ([num_heads, num_tokens]), got "
               f"{tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}")
        _check(lse.dtype == torch.float32, f"{name}: expected dtype float32, got {lse.dtype}")
        _check(lse.device == x.o1.device, f"{name}: expected device {x.o1.device} (as o1), got {lse.device}")
    # Outputs may be exactly an input of their kind (an in-place merge: every
    # backend reads a row before writing it), never a shifted or partial view
    # of any input (out=buf[1:6] over o1=buf[:5] read rows already merged),
    # nor overlap each other or themselves.
    outputs = [("out", x.out, ("o1", "o2"))] + ([("out_lse", x.out_lse, ("lse1", "lse2"))]
                                                if x.out_lse is not None else [])
    inputs = (("o1", x.o1), ("lse1", x.lse1), ("o2", x.o2), ("lse2", x.lse2))
    for w_name, w, same_kind in outputs:
        check_no_internal_overlap(w, w_name)
        for r_name, r in inputs:
            check_no_overlap(w, w_name, r, r_name, in_place=r_name in same_kind)
    if x.out_lse is not None:
        check_no_overlap(x.out_lse, "out_lse", x.out, "out")


def merge_attn_states(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint key sets (SPEC §7).

    o1, o2 [T, N, D] (bf16/fp16/fp32, same dtype, any token/head strides, head
    dim contiguous); lse1, lse2 [N, T] fp32 natural-log. +inf LSE is treated
    as -inf; a side with -inf returns the other side unchanged; both -inf give
    o = 0, lse = -inf. `out` / `out_lse` may be given (and may be o1/lse1 or
    o2/lse2 themselves, for an in-place merge); otherwise they are allocated.
    Any other memory shared between an output and an input (a shifted view,
    say), or between the two outputs, is a ValueError naming both.
    Returns (out, out_lse).
    """
    if out is None and isinstance(o1, torch.Tensor):
        out = torch.empty_like(o1, memory_format=torch.contiguous_format)
    if out_lse is None and isinstance(lse1, torch.Tensor) and isinstance(o1, torch.Tensor):
        out_lse = torch.empty(o1.shape[1], o1.shape[0], dtype=torch.float32, device=o1.device)
    x = MergeInputs(out, out_lse, o1, lse1, o2, lse2)
    _validate_merge(x)
    MERGE(x)
    return out, out_lse


# ---------------------------------------------------------------------------
# Reporting (for the `info` CLI)
# ---------------------------------------------------------------------------

def backend_report(device: str | torch.device | None = None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for probe inputs on `device` (default: CUDA if
    visible, else CPU), in the form every stage's report takes for the `info` CLI.
    An empty reasons list means the backend can serve the op there."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    q = torch.empty(1, 1, 8, device=dev, dtype=torch.float32)
    cu = torch.zeros(2, dtype=torch.int32, device=dev)
    o = torch.empty(1, 1, 8, device=dev)
    lse = torch.empty(1, 1, device=dev)
    probes = (
        ("attention", ATTENTION, AttentionInputs(q, q, q, cu, cu, 0, 0, 1.0, False)),
        ("merge", MERGE, MergeInputs(o, lse, o, lse, o, lse)),
    )
    return [(op, b.name, b.not_supported_reasons(inp)) for op, disp, inp in probes for b in disp.backends]
