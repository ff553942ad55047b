"""Indexer scores and top-k for prefill with context, chunked over the keys (CPU torch; a Triton
scorer plugs in).

Per request and per block of at most `query_block` of its new tokens, the keys of its index
space (context from the paged index cache, then the new tokens' own keys) are visited in chunks
of `chunk` positions, only up to the block's last visible position (causal). Each chunk is
scored ([qb, chunk]: sum_h w * relu(q . k)), masked causally, and merged into a running top-k
([qb, topk] scores + positions). The workspace is therefore
qb * (topk + chunk) scores + chunk * D keys, whatever the context length: never an [S, T]
matrix.

Tie rule (mla_ext/sparse/reference.py): higher score first, then the lower position. The fp32
merge keeps it with torch.topk over int64 keys (score bits, then the inverted position): every
key is distinct, so the library top-k picks exactly the rule's set; float64 (tests) merges by a
stable descending sort of [running | chunk] (running entries hold lower positions and stand first).
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.config.sparse import DEFAULT_CHUNK
from mla_ext.dispatch import Chosen, report_device
from mla_ext.sparse.index_cache import check_index_cache, gather_index_keys, get_index_format
from mla_ext.sparse.reference import PAD, check_lens

DEFAULT_QUERY_BLOCK = 256


def score_chunk_torch(q: Tensor, w: Tensor, k: Tensor) -> Tensor:
    """q [M, H, D], w [M, H], k [C, D] -> [M, C] = sum_h w[m, h] * relu(q[m, h] . k[c]), q's dtype."""
    s = torch.einsum("mhd,cd->mhc", q, k.to(q.dtype)).clamp_min_(0)
    return torch.einsum("mhc,mh->mc", s, w.to(q.dtype))


def tie_keys(scores: Tensor, pos: Tensor) -> Tensor:
    """int64 keys whose descending order is the tie rule's: the fp32 score's bits mapped to a
    monotone int32 in the high half, (2^32 - 1 - position) in the low half. Distinct positions
    give distinct keys, so a library top-k (torch.topk) selects exactly the tie rule's set."""
    b = (scores.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 -> +0.0 (they tie)
    b = torch.where(b < 0, b ^ 0x7FFFFFFF, b)  # negative floats: larger magnitude -> smaller key
    return (b << 32) | (0xFFFFFFFF - pos)


def merge_topk(vals: Tensor, idx: Tensor, s: Tensor, pos0: int, topk: int) -> tuple[Tensor, Tensor]:
    """Merge chunk scores s [M, C] (positions pos0..pos0+C-1, -inf = hidden) into the running
    (vals, idx) [M, topk] by the tie rule: fp32 through torch.topk on `tie_keys` (no sort),
    other dtypes (the float64 tests) by a stable descending sort."""
    cand_idx = torch.arange(pos0, pos0 + s.shape[1], dtype=torch.int64, device=s.device).expand_as(s)
    allv = torch.cat([vals, s.to(vals.dtype)], dim=1)
    alli = torch.cat([idx, cand_idx], dim=1)
    k = min(topk, allv.shape[1])
    if allv.dtype == torch.float32:
        order = torch.topk(tie_keys(allv, alli.clamp_min(0)), k, dim=1).indices
    else:
        order = torch.sort(allv, dim=1, descending=True, stable=True).indices[:, :k]
    return allv.gather(1, order), alli.gather(1, order)


def indexer_topk(
    q_idx: Tensor,  # [T, H, D] rotated indexer queries of the new tokens
    w: Tensor,  # [T, H] score weights (weights_proj * H^-0.5 * D^-0.5)
    k_new: Tensor,  # [T, D] rotated indexer keys of the new tokens
    index_cache: Tensor | None,  # paged index cache of the context (None: no request has context)
    block_table: Tensor | None,
    q_lens: list[int],
    ctx_lens: list[int],
    topk: int,
    *,
    index_cache_dtype="bfloat16",
    chunk: int = DEFAULT_CHUNK,
    query_block: int = DEFAULT_QUERY_BLOCK,
    compute_dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    out: Tensor | None = None,
    chosen: Chosen | None = None,
) -> Tensor:
    """int32 [T, topk] selected positions per new token (request-local index space, -1 padded).

    backend "torch": each chunk's context keys are gathered (dequantized) into a [chunk, D]
    workspace and scored with einsum in `compute_dtype`; "triton": mla_ext/sparse/triton_indexer.py
    scores the chunk reading the paged cache directly (fp32 scores). `chosen`: the index gather's
    backend, resolved at its first call and reused by every chunk's (the layer resolves it once per
    batch: mla_ext/prefill/backends.py); None dispatches every gather."""
    T = q_idx.shape[0]
    check_lens(T, q_lens, ctx_lens)
    if q_idx.dim() != 3 or w.shape != q_idx.shape[:2] or k_new.shape != (T, q_idx.shape[2]):
        raise ValueError(f"q_idx / w / k_new: expected [T, H, D] / [T, H] / [T, D], got {tuple(q_idx.shape)} / "
                         f"{tuple(w.shape)} / {tuple(k_new.shape)}")
    for name, v in (("topk", topk), ("chunk", chunk), ("query_block", query_block)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    fmt = get_index_format(index_cache_dtype)
    if any(ctx_lens) and (index_cache is None or block_table is None):
        raise ValueError("index_cache / block_table: required when a request has context")
    D = q_idx.shape[2]
    check_no_meta(q_idx=q_idx, w=w, k_new=k_new, block_table=block_table)
    if index_cache is not None:  # its width against D here, not as a shape error deep in the scoring
        check_index_cache(index_cache, fmt, D)
    dev = q_idx.device
    if backend == "triton":
        from mla_ext.sparse import triton_indexer

        why = triton_indexer.not_supported_reasons(q_idx)
        if why:
            raise ValueError(f"backend: 'triton' cannot run here: {'; '.join(why)}")
        if fmt.quantized and index_cache is not None:
            S = (index_cache.shape[2] - D) // 4
            qbs = D // max(S, 1)
        else:
            qbs = D
    elif backend != "torch":
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=dev)
    elif out.shape != (T, topk) or out.dtype != torch.int32:
        raise ValueError(f"out: expected int32 [{T}, {topk}], got {out.dtype} {tuple(out.shape)}")
    q_all, w_all, kn_all = q_idx.to(compute_dtype), w.to(compute_dtype), k_new.to(compute_dtype)
    start = 0
    for r, (qn, c) in enumerate(zip(q_lens, ctx_lens)):
        for b0 in range(0, qn, query_block):
            rows = slice(start + b0, start + min(qn, b0 + query_block))
            q, wr = q_all[rows], w_all[rows]
            m = q.shape[0]
            qpos = c + b0 + torch.arange(m, device=dev)  # positions of the block's queries
            vals = torch.full((m, 0), float("-inf"), dtype=compute_dtype, device=dev)
            idx = torch.full((m, 0), PAD, dtype=torch.int64, device=dev)
            end = c + b0 + m  # keys visible to the block: [0, end)
            for p0 in range(0, end, chunk):
                p1 = min(end, p0 + chunk)
                if backend == "triton":
                    s = triton_indexer.score_range_triton(
                        q_idx[rows], w[rows], index_cache, fmt.quantized,
                        None if block_table is None else block_table[r], k_new[start:start + qn], c, p0, p1,
                        c + b0, qbs).to(compute_dtype)
                else:
                    keys = _keys(index_cache, block_table, r, c, p0, p1, kn_all[start:start + qn], fmt, D, dev, chosen)
                    s = score_chunk_torch(q, wr, keys).to(compute_dtype)
                s = s.masked_fill(torch.arange(p0, p1, device=dev)[None, :] > qpos[:, None], float("-inf"))
                vals, idx = merge_topk(vals, idx, s, p0, topk)
            idx = torch.where(vals == float("-inf"), torch.full_like(idx, PAD), idx)
            out[rows, : idx.shape[1]] = idx.to(torch.int32)
            out[rows, idx.shape[1]:] = PAD
        start += qn
    return out


def _keys(cache, block_table, r, c, p0, p1, k_new_r, fmt, D, dev, chosen=None) -> Tensor:
    """Keys of positions [p0, p1) of request r: context ones gathered (dequantized) from the
    paged cache, new ones from k_new_r."""
    parts = []
    if p0 < c:
        n = min(p1, c) - p0
        cu = torch.tensor([0, n], dtype=torch.int32)
        parts.append(gather_index_keys(cache, block_table[r:r + 1], cu, fmt, seq_starts=torch.tensor(
            [p0], dtype=torch.int32), head_dim=D, chosen=chosen).to(dev))
    if p1 > c:
        parts.append(k_new_r[max(p0, c) - c: p1 - c])
    return parts[0] if len(parts) == 1 else torch.cat([parts[0].to(parts[1].dtype), parts[1]])


INDEXER_BACKENDS = ("triton", "torch")  # indexer_topk(backend=...): the caller picks (mla_ext.prefill.sparse)


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] of the indexer scoring + top-k for a probe on `device` (default:
    CUDA if visible), in the form `python -m mla_ext info` shows (its backend is an argument of
    indexer_topk, not a Dispatcher)."""
    from mla_ext.sparse import triton_indexer

    q = torch.empty(1, 1, 128, device=report_device(device))
    off_cuda = [] if q.device.type == "cuda" else [f"tensors on {q.device}: the sparse layer scores with torch "
                                                   "off CUDA (mla_ext.prefill.sparse.indexer_backend)"]
    why = {"triton": off_cuda + triton_indexer.not_supported_reasons(q), "torch": []}
    return [("indexer_topk", name, why[name]) for name in INDEXER_BACKENDS]
