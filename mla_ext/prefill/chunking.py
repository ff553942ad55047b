"""Chunk planner for the context pass of MLA prefill (SPEC §8).

A batch's cached context can be far larger than any buffer, so it is
processed in chunks of at most W workspace rows. The planner decides, on the
host and from host data only, which context rows of which request go into
which chunk; the gather op and varlen attention then run once per chunk.

Packing rule: requests are walked in batch order and packed whole while
their (remaining) context fits in the chunk. A request that does not fit is
split at a length that keeps the split point inside its context a multiple of
the alignment A (the block size B, or lcm(B, cp_size*I) under context
parallelism), so the next chunk's `seq_start` is block-aligned; its remainder
starts the next chunk. Hence only a chunk's first request can be a
continuation, and every chunk except the last holds more than W-A rows, so
a batch takes at most ceil(total / (W-A+1)) chunks (ceil(total/W)+1 whenever
total < W*W/A): a long request next to many short ones does not cost one
chunk per request (the legacy equal-share split took 30 chunks for one 60k
request plus 31 short ones).

A chunk is a contiguous range of requests, so its query rows are one slice
of the prefill batch. Requests without context inside that range take part
with zero keys: attention gives them o = 0, lse = -inf, which is exactly
their context result. Requests without context outside every chunk are
listed in `ChunkPlan.empty_req_ids`; their context result is o = 0,
lse = -inf, which is what an accumulator initialised to (0, -inf) holds.

How to use a plan (one MLA layer, see SPEC §1):

    acc_o, acc_lse = zeros [T, N, V], full([N, T], -inf)
    for c in plan.chunks:
        t = c.tensors(device)
        gather_and_maybe_dequant_cache(cache, workspace[:c.total_rows],
            block_table[c.req_start:c.req_end], t.cu_seq_lens, c.num_reqs,
            kv_cache_dtype, k_scale, t.seq_starts)
        ... up-project workspace rows into k, v ...
        o, lse = varlen_attention(q[c.token_start:c.token_end], k, v,
            t.cu_seqlens_q, t.cu_seq_lens, c.max_query_len, c.max_seq_len,
            scale, causal=False)
        merge_attn_states(acc_o[c.token_start:c.token_end], acc_lse[:, c.token_start:c.token_end],
                          o, lse, out=<same slices>)   # in place
    # Merging into a (0, -inf) accumulator returns the other side unchanged,
    # so the first visit of a request is exact; a caller that wants a plain
    # copy for rows seen for the first time can use `merge_token_end`:
    # rows [token_start, merge_token_end) belong to the continued request
    # and must be merged, rows [merge_token_end, token_end) can be copied.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Sequence

import torch

from mla_ext._args import as_device

MAX_DEFAULT_WORKSPACE_ROWS = 64 * 1024
# Token positions, row offsets (cu_seq_lens, cu_seqlens_q) and seq_starts reach
# the kernels as int32: every context length, the workspace rows and the total
# query rows must fit.
INT32_MAX = 2**31 - 1
# The most chunks one batch may take. Every chunk costs each layer a gather, a
# kv_b_proj GEMM and an attention launch, so a plan past this bound is a
# mistake (a tiny workspace, or a corrupt length), not a workload: 65,536
# chunks are 4M context tokens even of a 64-row workspace, and the whole int32
# range of the default 65,536-row one. Planning that many takes about 0.5 s.
MAX_CONTEXT_CHUNKS = 1 << 16


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _show(v) -> str:
    """repr, except for ints too long to print (str() refuses past 4,300 digits)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v).bit_length() > 64:
        return f"{'a negative' if v < 0 else 'an'} integer of {abs(v).bit_length()} bits"
    return repr(v)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {_show(value)}")
    return value


def lengths(values: Sequence[int], name: str) -> list[int]:
    """Host token counts as ints >= 0 (numpy integers and a CPU integer tensor
    accepted). Not coerced: int(5.5) or a bool would silently plan a different batch."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or values.dim() != 1 or values.is_floating_point():
            raise ValueError(
                f"{name}: expected host ints (a list, or a 1-D integer CPU tensor: reading a "
                f"device tensor would sync), got a {values.dim()}-D {values.dtype} tensor on "
                f"{values.device}"
            )
        values = values.tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(
            f"{name}: expected a sequence of ints >= 0 (one per request), got "
            f"{type(values).__name__}"
        )
    out = []
    for i, v in enumerate(values):
        try:
            n = None if isinstance(v, bool) else operator.index(v)
        except TypeError:
            n = None
        if n is None or n < 0:
            raise ValueError(f"{name}[{i}]: expected an int >= 0, got {_show(v)}")
        out.append(n)
    return out


def workspace_alignment(block_size: int, cp_size: int = 1, cp_interleave: int = 1) -> int:
    """Row alignment A of the workspace and of split points: B, or
    lcm(B, cp_size * I) under context parallelism (cp_size > 1)."""
    _positive_int(block_size, "block_size")
    _positive_int(cp_size, "cp_size")
    _positive_int(cp_interleave, "cp_interleave")
    if cp_size == 1:
        return block_size
    return math.lcm(block_size, cp_size * cp_interleave)


def workspace_rows(
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    cp_size: int = 1,
    cp_interleave: int = 1,
    override: int | None = None,
) -> int:
    """Workspace rows W (SPEC §8).

    Default: min(max(8*max_model_len, 4*max_num_seqs*B), 65,536) rounded up to
    the alignment (`workspace_alignment`). A user `override` replaces the
    default and is rounded up to the alignment the same way, because chunk
    split points must be aligned.
    """
    _positive_int(max_model_len, "max_model_len")
    _positive_int(max_num_seqs, "max_num_seqs")
    align = workspace_alignment(block_size, cp_size, cp_interleave)
    if override is not None:
        rows = _round_up(_positive_int(override, "override (workspace rows)"), align)
        if rows > INT32_MAX:
            raise ValueError(
                f"override (workspace rows): expected at most {INT32_MAX} rows (int32 row "
                f"offsets) after rounding up to {align}, got {_show(override)}"
            )
        return rows
    w = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), MAX_DEFAULT_WORKSPACE_ROWS)
    return _round_up(max(w, align), align)


@dataclass(frozen=True)
class ChunkTensors:
    """A chunk's int32 metadata on a device (one host-to-device copy each)."""

    cu_seq_lens: torch.Tensor  # [num_reqs + 1] row offsets in the workspace
    seq_starts: torch.Tensor  # [num_reqs] offset of the chunk inside each request's context
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] query rows, rebased to token_start


@dataclass(frozen=True)
class ContextChunk:
    """One chunk: requests [req_start, req_end) of the prefill batch.

    Per request of the chunk (index i ↔ request req_start + i):
    `seq_starts[i]` is where the chunk starts inside that request's context,
    `chunk_lens[i]` how many context rows it takes (0 for a request without
    context), and `cu_seq_lens` the prefix sums: the rows
    workspace[cu_seq_lens[i]:cu_seq_lens[i+1]] hold the request's tokens
    seq_starts[i] ... seq_starts[i]+chunk_lens[i]-1.
    """

    index: int
    req_start: int
    req_end: int
    seq_starts: tuple[int, ...]
    chunk_lens: tuple[int, ...]
    cu_seq_lens: tuple[int, ...]
    token_start: int  # query rows [token_start, token_end) of the prefill batch
    token_end: int
    cu_seqlens_q: tuple[int, ...]  # query offsets rebased to token_start
    is_continuation: bool  # the first request already had rows in an earlier chunk
    merge_token_end: int  # rows [token_start, merge_token_end) must be merged, not copied

    @property
    def req_ids(self) -> range:
        return range(self.req_start, self.req_end)

    @property
    def num_reqs(self) -> int:
        return self.req_end - self.req_start

    @property
    def total_rows(self) -> int:
        return self.cu_seq_lens[-1]

    @property
    def max_seq_len(self) -> int:
        return max(self.chunk_lens)

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens_q, self.cu_seqlens_q[1:]))

    def tensors(self, device: torch.device | str = "cpu") -> ChunkTensors:
        return ChunkTensors(host_to_device(self.cu_seq_lens, device),
                            host_to_device(self.seq_starts, device),
                            host_to_device(self.cu_seqlens_q, device))


def host_to_device(values: Sequence[int], device: torch.device | str,
                   dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Host ints as a `dtype` tensor on `device`, without a host sync.

    For a CUDA device the values are staged in pinned (page-locked) memory and
    copied with non_blocking=True: the copy is queued on the current stream and
    the host goes on (a copy from pageable memory waits for it, and cannot be
    captured in a CUDA graph). torch's pinned-memory allocator keeps the staging
    buffer alive until the copy has run. Every per-batch metadata copy (chunk
    offsets, cu_seqlens_q, the context-parallel gather's offsets) goes through here.
    """
    device = as_device(device)
    try:
        host = torch.tensor(values, dtype=dtype)
    except (RuntimeError, OverflowError, TypeError) as exc:
        raise ValueError(f"values: expected ints that fit {dtype}, got {str(values)[:80]} ({exc})") from None
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class ChunkPlan:
    workspace_rows: int
    alignment: int
    chunks: tuple[ContextChunk, ...]
    empty_req_ids: tuple[int, ...]  # requests without context that no chunk covers
    no_context_req_ids: tuple[int, ...]  # every request without context

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


def plan_context_chunks(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    workspace_rows: int,
    alignment: int,
) -> ChunkPlan:
    """Plans the context chunks of a prefill batch (SPEC §8).

    context_lens[r]: tokens of request r already in the cache; query_lens[r]:
    its new tokens (rows of q). `workspace_rows` (W) and `alignment` (A, see
    `workspace_alignment`) must be positive with W a multiple of A. Host-only;
    the returned chunks satisfy: every context row of every request is in
    exactly one chunk; no chunk has more than W rows; only a chunk's first
    request can continue from an earlier chunk; split points are multiples of A.

    Bounded: O(num_reqs + chunks) time, and ValueError (before any loop over
    chunks) when a context length, W or the total query rows exceed int32
    (`INT32_MAX`), or when the plan would need more than `MAX_CONTEXT_CHUNKS`
    chunks.
    """
    ctx = lengths(context_lens, "context_lens")
    qlens = lengths(query_lens, "query_lens")
    if len(ctx) != len(qlens):
        raise ValueError(
            f"query_lens: expected {len(ctx)} entries (as context_lens), got {len(qlens)}"
        )
    W = _positive_int(workspace_rows, "workspace_rows")
    A = _positive_int(alignment, "alignment")
    if W % A:
        raise ValueError(f"workspace_rows: expected a multiple of the alignment {A}, got {W}")
    if W > INT32_MAX:
        raise ValueError(f"workspace_rows: expected at most {INT32_MAX} (int32 row offsets), "
                         f"got {_show(W)}")
    # O(num_reqs) bounds in front of the loop, whose length comes from the lengths.
    for r, n in enumerate(ctx):
        if n > INT32_MAX:
            raise ValueError(
                f"context_lens[{r}]: expected at most {INT32_MAX} tokens (int32 positions), got "
                f"{_show(n)}"
            )
    qsl = [0]
    for x in qlens:
        qsl.append(qsl[-1] + x)
    if qsl[-1] > INT32_MAX:
        raise ValueError(
            f"query_lens: expected at most {INT32_MAX} query rows in all (int32 offsets), "
            f"got {_show(qsl[-1])}"
        )
    total = sum(ctx)
    if -(-total // W) > MAX_CONTEXT_CHUNKS:  # every chunk holds at most W rows
        _too_many_chunks(W, total, -(-total // W))

    chunks: list[ContextChunk] = []
    # State of the chunk being filled.
    cur_reqs: list[tuple[int, int, int]] = []  # (request, seq_start, rows)
    used = 0
    continuation = False

    def close() -> None:
        nonlocal cur_reqs, used, continuation
        # Requests without context at the end of a chunk add nothing: drop them.
        while cur_reqs and cur_reqs[-1][2] == 0:
            cur_reqs.pop()
        if cur_reqs:
            if len(chunks) == MAX_CONTEXT_CHUNKS:  # split points can cost up to A-1 rows a chunk
                _too_many_chunks(W, total, len(chunks) + 1)
            chunks.append(_make_chunk(len(chunks), cur_reqs, qsl, continuation))
        cur_reqs, used, continuation = [], 0, False

    for r, total in enumerate(ctx):
        if total == 0:
            if cur_reqs:  # inside a chunk's range: zero keys, o = 0 / lse = -inf
                cur_reqs.append((r, 0, 0))
            continue
        start = 0
        while start < total:
            room = W - used
            rest = total - start
            if rest <= room:
                cur_reqs.append((r, start, rest))
                used += rest
                break
            take = room // A * A  # split point start + take stays a multiple of A
            if take > 0:
                cur_reqs.append((r, start, take))
                start += take
            close()
            # Request r starts the next chunk; it continues one if rows of it were taken.
            continuation = start > 0
        if used == W:
            close()
    close()

    covered = {r for c in chunks for r in c.req_ids}
    no_ctx = tuple(r for r, x in enumerate(ctx) if x == 0)
    return ChunkPlan(
        workspace_rows=W,
        alignment=A,
        chunks=tuple(chunks),
        empty_req_ids=tuple(r for r in no_ctx if r not in covered),
        no_context_req_ids=no_ctx,
    )


def _too_many_chunks(W: int, total: int, at_least: int) -> None:
    raise ValueError(
        f"workspace_rows: {W} rows would take at least {at_least:,} chunks for {_show(total)} context "
        f"rows; at most {MAX_CONTEXT_CHUNKS:,} chunks are planned (each costs every layer a "
        f"gather, a GEMM and an attention launch): use a larger workspace or check context_lens"
    )


def _make_chunk(index: int, reqs: list[tuple[int, int, int]], qsl: list[int], continuation: bool) -> ContextChunk:
    req_start, req_end = reqs[0][0], reqs[-1][0] + 1
    cu = [0]
    for _, _, rows in reqs:
        cu.append(cu[-1] + rows)
    token_start, token_end = qsl[req_start], qsl[req_end]
    return ContextChunk(
        index=index,
        req_start=req_start,
        req_end=req_end,
        seq_starts=tuple(s for _, s, _ in reqs),
        chunk_lens=tuple(n for _, _, n in reqs),
        cu_seq_lens=tuple(cu),
        token_start=token_start,
        token_end=token_end,
        cu_seqlens_q=tuple(qsl[r] - token_start for r in range(req_start, req_end + 1)),
        is_continuation=continuation,
        merge_token_end=qsl[req_start + 1] if continuation else token_start,
    )


def plan_from_config(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    cp_size: int = 1,
    cp_interleave: int = 1,
    workspace_override: int | None = None,
) -> ChunkPlan:
    """`plan_context_chunks` with W and A derived from the serving config."""
    align = workspace_alignment(block_size, cp_size, cp_interleave)
    w = workspace_rows(max_model_len, max_num_seqs, block_size, cp_size, cp_interleave,
                       override=workspace_override)
    return plan_context_chunks(context_lens, query_lens, w, align)
