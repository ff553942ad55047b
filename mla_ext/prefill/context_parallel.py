"""Context-parallel gather of the paged latent cache (SPEC §6).

Under context parallelism (CP) the cached tokens of every request are spread
over `cp_size` ranks in runs of `interleave` (I) tokens: global position `p`
lives on rank `(p // I) % cp_size`, at local index
`(p // (I * cp_size)) * I + p % I` of that rank's own paged cache. A rank's
block table therefore covers LOCAL positions, and local order is global order
restricted to the rank.

To attend over a chunk `[s, s + n)` of each request, every rank gathers its
local rows of the chunk (local positions `[lc(s), lc(s + n))`, where `lc(x)`
counts the rank's positions below `x`; contiguous in local order, whatever the
alignment of `s`), pads its buffer to the largest rank's row count, and the
buffers are all-gathered over the process group; `cp_reorder` then maps every
(request, position) back to its row in the gathered tensor and writes the
chunk in per-request global order, padding removed.

Lengths and starts are host-side integers (the chunk planner owns them), so
buffer sizes need no sync; the reorder map itself is built with torch ops on
the device, and the gather's int32 offsets reach the device through pinned
memory with non_blocking=True (`prefill.chunking.host_to_device`, the same
helper as the prefill layer's chunk metadata): no host sync, capturable.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mla_ext.cache import api  # the public gather op (dispatches CUDA / CPU / Triton)
from mla_ext.config.policy import check_bool
from mla_ext.prefill.chunking import host_to_device, lengths

GatherFn = Callable[..., object]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_cp(cp_size: int, interleave: int, rank: int | None = None) -> None:
    if not _is_int(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    if not _is_int(interleave) or interleave < 1:
        raise ValueError(f"interleave: expected an int >= 1, got {interleave!r}")
    if rank is not None and not (_is_int(rank) and 0 <= rank < cp_size):
        raise ValueError(f"rank: expected an int in [0, {cp_size}), got {rank!r}")


def cp_rank_of(pos, cp_size: int, interleave: int):
    """Rank holding global position `pos` (int or tensor)."""
    return (pos // interleave) % cp_size


def cp_local_index(pos, cp_size: int, interleave: int):
    """Index of global position `pos` in its own rank's local order (int or tensor)."""
    return (pos // (interleave * cp_size)) * interleave + pos % interleave


def cp_local_lens(ctx_lens, cp_size: int, rank: int, interleave: int):
    """How many of positions `[0, n)` rank `rank` holds, for each n in `ctx_lens`.

    Works elementwise on an int, a sequence of ints (returns a list) or an
    integer tensor (returns a tensor on its device). Equal to
    `cp_local_index`-count of `{p < n : rank(p) == rank}`.
    """
    _check_cp(cp_size, interleave, rank)
    if isinstance(ctx_lens, (Tensor, int)):
        return _count_below(ctx_lens, rank, cp_size, interleave)
    if isinstance(ctx_lens, (str, bytes)) or not hasattr(ctx_lens, "__iter__"):
        raise ValueError(f"ctx_lens: expected an int, a sequence of ints or an integer tensor, "
                         f"got {type(ctx_lens).__name__}")
    return [_count_below(int(n), rank, cp_size, interleave) for n in ctx_lens]


def _count_below(n, rank, cp_size: int, interleave: int):
    """Positions p < n with rank(p) == rank: whole periods, plus the rank's share of the
    last partial period. `n` and `rank` are ints or broadcastable integer tensors."""
    period = interleave * cp_size
    rem = n % period - rank * interleave
    if isinstance(rem, Tensor):
        rem = rem.clamp(0, interleave)
    else:
        rem = min(max(rem, 0), interleave)
    return (n // period) * interleave + rem


def _host_ints(x, n: int, arg: str) -> list[int]:
    """Host ints >= 0, one per request; checked like the chunk planner's lengths (a
    float or a bool is an error, not truncated; a device tensor would sync)."""
    vals = lengths(x, arg)
    if len(vals) != n:
        raise ValueError(f"{arg}: expected {n} entries (one per request), got {len(vals)}")
    return vals


def cp_local_chunk(seq_lens: Sequence[int], seq_starts: Sequence[int] | None,
                   cp_size: int, rank: int, interleave: int) -> tuple[list[int], list[int]]:
    """(local lengths, local starts) of chunks `[s, s + n)` on `rank`, per request."""
    starts = list(seq_starts) if seq_starts is not None else [0] * len(seq_lens)
    lo = cp_local_lens(starts, cp_size, rank, interleave)
    hi = cp_local_lens([s + n for s, n in zip(starts, seq_lens)], cp_size, rank, interleave)
    return [h - l for h, l in zip(hi, lo)], lo


def _cumsum0(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def cp_padded_rows(seq_lens: Sequence[int], seq_starts: Sequence[int] | None,
                   cp_size: int, interleave: int) -> int:
    """Rows of every rank's (padded) local buffer: the largest rank's row count."""
    return max(sum(cp_local_chunk(seq_lens, seq_starts, cp_size, k, interleave)[0])
               for k in range(cp_size))


def cp_reorder_index(seq_lens: Sequence[int], seq_starts: Sequence[int] | None,
                     cp_size: int, interleave: int, padded_rows: int,
                     device: torch.device | str = "cpu") -> Tensor:
    """int64 [sum(seq_lens)]: row of the gathered `[cp_size * padded_rows, E]` tensor
    holding each output row (request-major, position order)."""
    _check_cp(cp_size, interleave)
    num_reqs = len(seq_lens)
    starts = list(seq_starts) if seq_starts is not None else [0] * num_reqs
    total = sum(seq_lens)
    # Per rank: where each request's local rows start in that rank's buffer.
    base = [[k * padded_rows + c for c in _cumsum0(cp_local_chunk(seq_lens, starts, cp_size, k,
                                                                      interleave)[0])[:-1]]
            for k in range(cp_size)]
    i64 = dict(dtype=torch.int64, device=device)
    lens_t = torch.tensor(list(seq_lens), **i64)
    starts_t = torch.tensor(starts, **i64)
    req = torch.repeat_interleave(torch.arange(num_reqs, **i64), lens_t, output_size=total)
    cu = torch.tensor(_cumsum0(seq_lens)[:-1], **i64)
    pos = starts_t[req] + (torch.arange(total, **i64) - cu[req])
    k = cp_rank_of(pos, cp_size, interleave)
    # Local index of pos minus the local index of its chunk's start on the same rank.
    j = cp_local_index(pos, cp_size, interleave) - _count_below(starts_t[req], k, cp_size, interleave)
    return torch.tensor(base, **i64)[k, req] + j


def cp_reorder(gathered: Tensor, seq_lens: Sequence[int], seq_starts: Sequence[int] | None,
               cp_size: int, interleave: int, out: Tensor | None = None) -> Tensor:
    """All-gathered `[cp_size * padded_rows, E]` (or `[cp_size, padded_rows, E]`) -> the
    chunks in per-request global order, `[sum(seq_lens), E]` (written into `out` if given)."""
    for arg, t in (("gathered", gathered), ("out", out)):
        if t is not None and not isinstance(t, Tensor):
            raise ValueError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    flat = gathered.reshape(-1, gathered.shape[-1])
    if flat.shape[0] % cp_size:
        raise ValueError(f"gathered: expected a multiple of cp_size={cp_size} rows, got {flat.shape[0]}")
    idx = cp_reorder_index(seq_lens, seq_starts, cp_size, interleave, flat.shape[0] // cp_size,
                           flat.device)
    if out is None:
        return flat.index_select(0, idx)
    if out.shape != (idx.numel(), flat.shape[1]):
        raise ValueError(f"out: expected shape {(idx.numel(), flat.shape[1])}, got {tuple(out.shape)}")
    if out.is_contiguous():
        torch.index_select(flat, 0, idx, out=out)
    else:  # out= would resize a strided view: go through a temporary
        out.copy_(flat.index_select(0, idx))
    return out


def cp_reorder_ref(per_rank: Sequence[Tensor], seq_lens: Sequence[int],
                   seq_starts: Sequence[int] | None, cp_size: int, interleave: int) -> Tensor:
    """Loop-by-token reference of the reorder: `per_rank[k]` holds rank k's local rows of
    every request's chunk, request after request, unpadded."""
    starts = list(seq_starts) if seq_starts is not None else [0] * len(seq_lens)
    cursor = [0] * cp_size  # next unread row of each rank's buffer
    rows = []
    for s, n in zip(starts, seq_lens):
        first = [cursor[k] for k in range(cp_size)]
        for p in range(s, s + n):
            k = (p // interleave) % cp_size
            rows.append(per_rank[k][cursor[k]])
            cursor[k] += 1
        # Sanity: each rank consumed exactly its local rows of this chunk.
        for k in range(cp_size):
            want = cp_local_lens(s + n, cp_size, k, interleave) - cp_local_lens(s, cp_size, k, interleave)
            assert cursor[k] - first[k] == want
    width = per_rank[0].shape[-1]
    if not rows:
        return per_rank[0].new_empty(0, width)
    return torch.stack(rows)


# Dtypes every torch.distributed backend (gloo included) all-gathers as they are;
# others (fp8, int16 on gloo) travel as bytes, which is all an all-gather moves.
_COMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)
# all_gather_single replaces all_gather_into_tensor (deprecated) in newer torch.
_all_gather_one = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(out: Tensor, local: Tensor, group) -> None:
    if local.dtype not in _COMM_DTYPES:
        out, local = out.view(torch.uint8), local.view(torch.uint8)
    _all_gather_one(out, local, group=group)


def _default_gather() -> GatherFn:
    return api.gather_and_maybe_dequant_cache


def cp_gather_context(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, seq_lens: Sequence[int],
    kv_cache_dtype: str, k_scale: Tensor | None, *, cp_size: int, rank: int, interleave: int,
    seq_starts: Sequence[int] | None = None, group=None, gather: GatherFn | None = None,
    validate: bool = False,
) -> Tensor:
    """Gathers chunk `[seq_starts[r], +seq_lens[r])` of every request into `dst[:sum]`.

    `src_cache`/`block_table` are this rank's local cache and local block table
    (rows per request; it covers local positions). `seq_lens`/`seq_starts` are the
    GLOBAL chunk lengths/starts (host ints, identical on every rank). `dst` is
    `[>= sum(seq_lens), W]` with the gather's output dtype and width; rows past the
    sum are untouched. `gather` has the signature of `gather_and_maybe_dequant_cache`
    (default: that public op). `validate=True` is passed on to it (its checked mode:
    reads the block table on the host, a sync; see mla_ext.cache.api).
    Returns `dst[:sum(seq_lens)]`.
    """
    _check_cp(cp_size, interleave, rank)
    for arg, t in (("src_cache", src_cache), ("dst", dst), ("block_table", block_table)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    validate = check_bool(validate, "validate")
    lens = lengths(seq_lens, "seq_lens")
    num_reqs = len(lens)
    starts = _host_ints(seq_starts, num_reqs, "seq_starts") if seq_starts is not None else None
    total = sum(lens)
    if dst.dim() != 2 or dst.shape[0] < total:
        raise ValueError(f"dst: expected [>= {total}, W] rows, got {tuple(dst.shape)}")
    world = dist.get_world_size(group) if cp_size > 1 else 1
    if world != cp_size:
        raise ValueError(f"group: expected {cp_size} ranks (cp_size), got {world}")
    gather = gather or _default_gather()

    local_lens, local_starts = cp_local_chunk(lens, starts, cp_size, rank, interleave)
    padded = cp_padded_rows(lens, starts, cp_size, interleave)
    local = dst.new_empty(max(padded, 1), dst.shape[1])  # padding rows are never read
    if num_reqs:
        extra = {"validate": True} if validate else {}
        gather(src_cache, local, block_table, host_to_device(_cumsum0(local_lens), src_cache.device),
               num_reqs, kv_cache_dtype, k_scale, host_to_device(local_starts, src_cache.device),
               **extra)
    if cp_size == 1:
        gathered = local
    else:
        gathered = dst.new_empty(cp_size * local.shape[0], dst.shape[1])
        _all_gather(gathered, local, group)
    return cp_reorder(gathered, lens, starts, cp_size, interleave, out=dst[:total])
