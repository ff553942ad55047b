"""Public attention-stage API: varlen attention with LSE, and merge_attn_states.

Both ops validate their arguments here (ValueError naming the argument and
the expected value), then go through mla_ext.dispatch, so every backend can
say why it cannot serve an input and tests/benchmarks can force one:

- ``varlen_attention``: "triton" (CUDA tensors, or CPU tensors under
  TRITON_INTERPRET=1; reads split MLA keys as they are), then PyTorch's own
  kernels (torch_backends.py): "flex_attention" (CUDA: compiled per shape
  bucket; CPU: eager, for small packed batches) and "varlen_attn"
  (FlashAttention-2, CUDA bf16/fp16), then "torch" (reference.py:
  per-request fp32 softmax, correct anywhere, slow). Torch SDPA is not a
  backend (no varlen layout, no LSE: see torch_backends.py).

  Stated order: Triton stays first, as before these backends existed (no
  GPU measurement says otherwise yet); the new ones come before the
  reference, so they serve what Triton refuses (e.g. no triton: FA2 for
  bf16/fp16) and whatever a caller forces; on the CPU, where eager flex is
  measured slower than the reference, a heuristic keeps the old choice. Measured
  order: ATTENTION dispatches by the device's table in
  mla_ext/dispatch_tables (mla_ext.dispatch) where it has an entry for the
  call's bucket (`_table_key`: dtype, heads, head dims, mask, split keys,
  total query and key rows rounded up to powers of two, nearest measured
  bucket within two octaves); benchmarks/bench_attention.py writes those
  entries.
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
from mla_ext.attention import reference, torch_backends
from mla_ext.attention.scratch import AttentionScratch
from mla_ext.attention.sinks import apply_sinks, check_sinks
from mla_ext.cache.checks import check_no_internal_overlap, check_no_overlap
from mla_ext.dispatch import Backend, Dispatcher, pow2_buckets

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


# Scalars are checked, not coerced: int(4.7), bool("no") or float("0.1") would
# turn a caller's mistake into a silently different computation.
def _count(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    try:
        n = operator.index(value)  # ints and numpy integers, not floats
    except TypeError:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}") from None
    if not (n >= 0):
        raise ValueError(f"{name}: expected an int >= 0, got {n}")
    return n


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    return value


def _scale(value) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"softmax_scale: expected a finite positive number, got {value!r}")
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
    # Split MLA keys: k is k_nope [Tk, N, P] and k_rope [Tk, N, R] (a view,
    # head stride 0 when shared by the heads); None: k holds the whole keys.
    k_rope: torch.Tensor | None = None
    scratch: AttentionScratch | None = None


def _take(x: AttentionInputs, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A buffer of q's dtype and device: from the caller's scratch (reused), else new."""
    if x.scratch is not None:
        return x.scratch.take(name, shape, x.q.dtype, x.q.device)
    return torch.empty(shape, dtype=x.q.dtype, device=x.q.device)


def _assembled_keys(x: AttentionInputs) -> torch.Tensor:
    """The keys [Tk, N, P+R], for backends that take one key tensor. With split
    keys they are written into the scratch's "keys" buffer (no per-call
    allocation when the caller keeps a scratch)."""
    if x.k_rope is None:
        return x.k
    tk, n, p = x.k.shape
    k = _take(x, "keys", (tk, n, p + x.k_rope.shape[-1]))
    k[..., :p].copy_(x.k)
    k[..., p:].copy_(x.k_rope)
    return k


def _attn_triton_reasons(x: AttentionInputs) -> list[str]:
    why = _triton_reasons([x.q])
    if max(x.q.shape[-1], x.v.shape[-1]) > 256:
        # Padded tiles above 256 no longer fit sm_86 shared memory (99 KB).
        why.append(f"head dims (qk {x.q.shape[-1]}, v {x.v.shape[-1]}) above 256 are not tiled")
    return why


def _attn_triton_run(x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    from mla_ext.attention.triton_attention import split_keys_pad_less, varlen_attention_triton

    tq, n, _ = x.q.shape
    k, k_rope = x.k, x.k_rope
    if k_rope is not None and not split_keys_pad_less(k.shape[-1], k_rope.shape[-1]):
        k, k_rope = _assembled_keys(x), None  # e.g. P 192 + R 64: one 256 tile pads less
    # Rows outside every request (cu_seqlens_q[-1] < Tq) are defined as empty.
    out = torch.zeros(tq, n, x.v.shape[-1], dtype=x.q.dtype, device=x.q.device)
    lse = torch.full((n, tq), float("-inf"), dtype=torch.float32, device=x.q.device)
    varlen_attention_triton(
        x.q, k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, min(x.max_seqlen_q, tq),
        x.softmax_scale, x.causal, out, lse, k_rope=k_rope,
    )
    return out, lse


def _attn_flex_run(x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_backends.flex_run(x, lambda: _assembled_keys(x))


def _attn_varlen_run(x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_backends.varlen_run(x, lambda: _assembled_keys(x), lambda name, shape: _take(x, name, shape))


def _attn_torch_run(x: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.varlen_attention_ref(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.softmax_scale, x.causal, k_rope=x.k_rope
    )


def _device_name(device: torch.device) -> str:
    """The name a dispatch table is filed under: the CUDA device's name (torch keeps
    the device properties, so this is cheap per call), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _table_key(x: AttentionInputs) -> tuple[str, list[str]]:
    """(device name, buckets nearest first) of one call, for the dispatch table:
    `<dtype>/N=<heads>/qk=<Dqk>/v=<Dv>/<causal|full>/k=<split|whole>/Tq=<2^i>/Tk=<2^j>`,
    Tq / Tk the total query / key rows rounded up to a power of two; then the
    buckets up to two octaves away in either, by total distance."""
    tq, n, dqk = x.q.shape
    base = (f"{str(x.q.dtype).replace('torch.', '')}/N={n}/qk={dqk}/v={x.v.shape[-1]}/"
            f"{'causal' if x.causal else 'full'}/k={'whole' if x.k_rope is None else 'split'}")
    qs, ks = pow2_buckets(max(tq, 1), 2), pow2_buckets(max(x.k.shape[0], 1), 2)
    pairs = sorted(((i, j) for i in range(len(qs)) for j in range(len(ks))),
                   key=lambda ij: ((ij[0] + 1) // 2 + (ij[1] + 1) // 2, ij[1], ij[0]))
    return _device_name(x.q.device), [f"{base}/Tq={qs[i]}/Tk={ks[j]}" for i, j in pairs]


ATTENTION = Dispatcher(
    "attention",
    [
        Backend("triton", _attn_triton_reasons, _attn_triton_run),
        Backend("flex_attention", torch_backends.flex_reasons, _attn_flex_run, torch_backends.flex_heuristic),
        Backend("varlen_attn", torch_backends.varlen_reasons, _attn_varlen_run),
        Backend("torch", lambda x: [], _attn_torch_run),
    ],
    table_key=_table_key,
)


def _validate_attention(x: AttentionInputs) -> None:
    q, k, v = x.q, x.k, x.v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not (isinstance(t, torch.Tensor) and t.dim() == 3):
            raise ValueError(f"{name}: expected a 3-D tensor [tokens, heads, head_dim]")
        if t.dtype not in O_DTYPES:
            raise ValueError(f"{name}: expected dtype bfloat16, float16 or float32, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (as q), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
        if not (t.shape[-1] <= 1 or t.stride(-1) == 1):
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got stride {t.stride(-1)}")
    if not (k.shape[1] == q.shape[1] and v.shape[1] == q.shape[1]):
        raise ValueError(f"k, v: expected {q.shape[1]} heads (as q), got {k.shape[1]} and {v.shape[1]}")
    if x.k_rope is None:
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"k: expected head dim {q.shape[2]} (as q), got {k.shape[2]}")
    else:
        r = x.k_rope
        if k.shape[2] + r.shape[2] != q.shape[2]:
            raise ValueError(f"k, k_rope: expected head dims summing to {q.shape[2]} (q's), got "
               f"{k.shape[2]} + {r.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: expected {k.shape[0]} tokens (as k), got {v.shape[0]}")
    for name, cu in (("cu_seqlens_q", x.cu_seqlens_q), ("cu_seqlens_k", x.cu_seqlens_k)):
        if not (isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 1):
            raise ValueError(f"{name}: expected a 1-D int32 tensor [batch + 1]")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name}: expected dtype int32, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {cu.device}")
        if not cu.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    if x.cu_seqlens_q.numel() != x.cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_k: expected {x.cu_seqlens_q.numel()} entries (as cu_seqlens_q), "
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
            if not (int(cu[0]) >= 0 and bool((lens >= 0).all())):
                raise ValueError(f"{name}: expected non-decreasing offsets starting at >= 0")
            if not (int(cu[-1]) <= rows):
                raise ValueError(f"{name}: last offset {int(cu[-1])} exceeds the {rows} rows")
            if not (lens.numel() == 0 or int(lens.max()) <= mx):
                raise ValueError(f"max_seqlen for {name}: expected >= the longest request "
                   f"({int(lens.max()) if lens.numel() else 0}), got {mx}")


def _scratch(value) -> AttentionScratch | None:
    if not (value is None or isinstance(value, AttentionScratch)):
        raise ValueError(f"scratch: expected an mla_ext.attention.scratch.AttentionScratch or None, got {type(value).__name__}")
    return value


def _rope_view(k_rope, q, k) -> torch.Tensor | None:
    """k_rope checked and viewed as [Tk, N, R] (head stride 0 when shared)."""
    if k_rope is None:
        return None
    if not (isinstance(k_rope, torch.Tensor) and k_rope.dim() in (2, 3)):
        raise ValueError("k_rope: expected a tensor [Tk, R] or [Tk, 1 or num_heads, R], got "
           + (f"{k_rope.dim()}-D" if isinstance(k_rope, torch.Tensor) else type(k_rope).__name__))
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and isinstance(k, torch.Tensor) and k.dim() == 3):
        return k_rope  # q / k themselves are rejected by _validate_attention
    if k_rope.dtype != q.dtype:
        raise ValueError(f"k_rope: expected dtype {q.dtype} (as q), got {k_rope.dtype}")
    if k_rope.device != q.device:
        raise ValueError(f"k_rope: expected device {q.device} (as q), got {k_rope.device}")
    if k_rope.shape[0] != k.shape[0]:
        raise ValueError(f"k_rope: expected {k.shape[0]} tokens (as k), got {k_rope.shape[0]}")
    n = q.shape[1]
    r = k_rope.unsqueeze(1) if k_rope.dim() == 2 else k_rope
    if r.shape[1] not in (1, n):
        raise ValueError(f"k_rope: expected 1 or {n} heads (as q), got {r.shape[1]}")
    if not (r.shape[-1] <= 1 or r.stride(-1) == 1):
        raise ValueError(f"k_rope: the head dim must be contiguous (stride 1), got stride {r.stride(-1)}")
    return r.expand(r.shape[0], n, r.shape[2])


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
    *,
    k_rope: torch.Tensor | None = None,
    scratch: AttentionScratch | None = None,
    sinks: torch.Tensor | None = None,
    chosen=None,
):
    """Variable-length multi-head attention with LSE, for MLA shapes.

    q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] (Dqk = P+R and Dv = V may
    differ; up to 256 on the Triton backend, any size on torch; token/head
    strides are free, the head dim must be contiguous); cu_seqlens_q / cu_seqlens_k int32 [B+1] offsets; request b
    attends its queries cu_seqlens_q[b]:[b+1] to its keys cu_seqlens_k[b]:[b+1].

    causal=True masks bottom-right aligned: query i sees keys
    j <= i + (k_len - q_len) (for the new-token pass q_len == k_len).
    Rows without a visible key (k_len 0, or fully masked) get o = 0,
    lse = -inf; query rows past cu_seqlens_q[-1] too. `chosen` (mla_ext.dispatch.Chosen): a call
    site resolved once (MLAPrefill resolves each op once per batch).

    Split MLA keys: with `k_rope` ([Tk, R] shared by the heads, or
    [Tk, 1 or N, R]; q.dtype, head dim contiguous), `k` is k_nope [Tk, N, P]
    (any token/head strides, e.g. a view of the kv_b_proj output) and the keys
    are cat(k_nope, k_rope) with P + R = Dqk. The Triton and torch backends
    never build them; flex_attention and varlen_attn assemble them into
    `scratch` ("keys"; varlen_attn also pads V there, "v_padded") when one is
    given (an `AttentionScratch` kept across calls: no per-call allocation),
    else into a new tensor.

    Attention sinks: with `sinks` (a float tensor [N] on q's device) each head's
    logit joins every row's softmax (attention/sinks.py); it is folded into the
    backend's result exactly, so every backend serves it, and the returned LSE
    includes it (merge such a result with sink-free partials only: the sink must
    enter once).

    Returns (o [Tq, N, Dv] in q.dtype, lse [N, Tq] float32, natural log), or
    just o when return_lse is False. max_seqlen_q/k must bound the request
    lengths (checked on CPU; on CUDA it sizes the grid without a sync).
    """
    x = AttentionInputs(q, k, v, cu_seqlens_q, cu_seqlens_k, _count(max_seqlen_q, "max_seqlen_q"),
                        _count(max_seqlen_k, "max_seqlen_k"), _scale(softmax_scale),
                        _flag(causal, "causal"), _rope_view(k_rope, q, k),
                        _scratch(scratch))
    return_lse = _flag(return_lse, "return_lse")
    _validate_attention(x)
    sinks = check_sinks(sinks, q.shape[1], q.device)
    o, lse = ATTENTION.run(x, chosen)
    if sinks is not None:
        o, lse = apply_sinks(o, lse, sinks)
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
            ok, msg = _ext.cuda_kernels_usable(x.out.device)
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
    if not (isinstance(x.o1, torch.Tensor) and x.o1.dim() == 3):
        raise ValueError("prefix_output (o1): expected [T, N, D]")
    t, n, d = x.o1.shape
    for name, o in (("o1", x.o1), ("o2", x.o2), ("out", x.out)):
        if not (isinstance(o, torch.Tensor) and tuple(o.shape) == (t, n, d)):
            raise ValueError(f"{name}: expected shape [{t}, {n}, {d}] (as o1), got "
               f"{tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__}")
        if o.dtype not in O_DTYPES:
            raise ValueError(f"{name}: expected dtype bfloat16, float16 or float32, got {o.dtype}")
        if o.dtype != x.o1.dtype:
            raise ValueError(f"{name}: expected dtype {x.o1.dtype} (as o1), got {o.dtype}")
        if o.device != x.o1.device:
            raise ValueError(f"{name}: expected device {x.o1.device} (as o1), got {o.device}")
        if not (d <= 1 or o.stride(2) == 1):
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got stride {o.stride(2)}")
    lses = [("lse1", x.lse1), ("lse2", x.lse2)] + ([("out_lse", x.out_lse)] if x.out_lse is not None else [])
    for name, lse in lses:
        if not (isinstance(lse, torch.Tensor) and tuple(lse.shape) == (n, t)):
            raise ValueError(f"{name}: expected shape [{n}, {t}] ([num_heads, num_tokens]), got "
               f"{tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}")
        if lse.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {lse.dtype}")
        if lse.device != x.o1.device:
            raise ValueError(f"{name}: expected device {x.o1.device} (as o1), got {lse.device}")
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
    *,
    chosen=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint key sets (SPEC §7).

    o1, o2 [T, N, D] (bf16/fp16/fp32, same dtype, any token/head strides, head
    dim contiguous); lse1, lse2 [N, T] fp32 natural-log. +inf LSE is treated
    as -inf; a side with -inf returns the other side unchanged; both -inf give
    o = 0, lse = -inf. `out` / `out_lse` may be given (and may be o1/lse1 or
    o2/lse2 themselves, for an in-place merge); otherwise they are allocated.
    Any other memory shared between an output and an input (a shifted view,
    say), or between the two outputs, is a ValueError naming both.
    `chosen` (mla_ext.dispatch.Chosen): a call site resolved once (MLAPrefill). Returns (out, out_lse).
    """
    if out is None and isinstance(o1, torch.Tensor):
        out = torch.empty_like(o1, memory_format=torch.contiguous_format)
    if out_lse is None and isinstance(lse1, torch.Tensor) and isinstance(o1, torch.Tensor):
        out_lse = torch.empty(o1.shape[1], o1.shape[0], dtype=torch.float32, device=o1.device)
    x = MergeInputs(out, out_lse, o1, lse1, o2, lse2)
    _validate_merge(x)
    MERGE.run(x, chosen)
    return out, out_lse


# ---------------------------------------------------------------------------
# Reporting (for the `info` CLI)
# ---------------------------------------------------------------------------

def backend_report(device: str | torch.device | None = None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for probe inputs on `device` (default: CUDA if
    visible, else CPU), in the form every stage's report takes for the `info` CLI.
    An empty reasons list means the backend can serve the op there."""
    try:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    q = torch.empty(1, 1, 8, device=dev, dtype=torch.float32)
    cu = torch.zeros(2, dtype=torch.int32, device=dev)
    o = torch.empty(1, 1, 8, device=dev)
    lse = torch.empty(1, 1, device=dev)
    # The attention probe has the MLA head dims (192 / 128), 16-bit on CUDA.
    qa = torch.empty(1, 1, 192, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    va = qa.new_empty(1, 1, 128)
    probes = (
        ("attention", ATTENTION, AttentionInputs(qa, qa, va, cu, cu, 0, 0, 1.0, False)),
        ("merge", MERGE, MergeInputs(o, lse, o, lse, o, lse)),
    )
    return [(op, b.name, b.not_supported_reasons(inp)) for op, disp, inp in probes for b in disp.backends]
