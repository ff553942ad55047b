"""Pure-PyTorch float64 oracle of DeepSeek Sparse Attention prefill with context.

One index space per request: request r's tokens are numbered 0 .. ctx[r]-1 for
its context (already cached) and ctx[r] .. ctx[r]+q_len[r]-1 for its new
tokens, so new token i of r sits at position ctx[r]+i and may see positions
0 .. ctx[r]+i (causal). Every index below (top-k output, sparse attention
input) is a position in that space; -1 pads a query's list when it sees fewer
than `topk` tokens.

Indexer (transformers' DeepseekV32Indexer, SPEC §12), with q_I [T, H, D] and
k_I [ctx+q_len, D] already rotated (RoPE on their first R dims, as the main
attention's q/k_pe are rotated before this library):

    score[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s])          (s <= pos(t))

where `w = weights_proj(hidden) * H^-0.5 * D^-0.5` (`indexer_weights`): the
softmax scale D^-0.5 is positive, so it moves out of relu into w.

Top-k tie rule (this library's, everywhere): higher score first; among equal
scores the LOWER position wins (a stable descending sort). torch.topk states no
rule for ties and does not follow this one on the CPU (20 zeros, k=5 gave
[12, 14, 13, 15, 11]); so a selected set equals torch.topk's except where the
k-th score is tied, and the parity tests accept exactly those substitutions.
Ties are common: relu makes a token's score exactly 0 whenever every head's
dot product is negative.

Sparse attention: MLA in latent space (mla_ext/attention/latent_reference.py)
of each query against the latent rows [kv_c | k_pe] at its selected positions,
with natural-log LSE [N, T]; a query with no selected token gets o = 0,
lse = -inf. With topk >= ctx + q_len nothing is dropped and it is dense causal
MLA prefill (tests prove it against the dense layer).
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.attention.latent_reference import split_kv_b_proj
from mla_ext.cache.reference import decode_cache_rows

PAD = -1


def _offsets(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


def check_lens(T: int, q_lens: list[int], ctx_lens: list[int]) -> None:
    if len(q_lens) != len(ctx_lens) or sum(q_lens) != T or min(list(q_lens) + list(ctx_lens) + [0]) < 0:
        raise ValueError(f"q_lens / ctx_lens: expected one non-negative entry per request, q_lens summing "
                         f"to T={T}; got {list(q_lens)} and {list(ctx_lens)}")


# -- RoPE (the indexer's; the main attention's q_pe / k_pe arrive rotated) ----------------

def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the first R = cos.shape[-1] dims of x [..., D] (cos/sin [..., R] as transformers'
    rotary embedding returns them: cat(freqs, freqs)); the rest pass through.

    interleaved=False: half-split pairs (i, i + R/2) (DeepSeek-V3.2's indexer);
    interleaved=True: adjacent pairs (2i, 2i+1), output de-interleaved as
    [evens', odds'] (GLM-5's indexer and both models' main attention)."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    c, s = cos[..., : R // 2], sin[..., : R // 2]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., : R // 2], xr[..., R // 2:]
    return torch.cat([a * c - b * s, b * c + a * s, xp], dim=-1)


def indexer_weights(weights_proj_out: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """weights_proj(hidden) [T, H] -> the per-head score weights w (float64): times H^-0.5 * D^-0.5."""
    return weights_proj_out.to(torch.float64) * (n_heads ** -0.5) * (head_dim ** -0.5)


# -- scores and top-k ---------------------------------------------------------------------

def indexer_scores_reference(q_idx: Tensor, k_idx: list[Tensor], w: Tensor, q_lens: list[int],
                             ctx_lens: list[int]) -> list[Tensor]:
    """Per request r: scores [q_len[r], ctx[r]+q_len[r]] float64, -inf where causally hidden.

    q_idx [T, H, D] new tokens' rotated indexer queries; k_idx[r] [ctx[r]+q_len[r], D]
    request r's rotated indexer keys in its index space; w [T, H] from `indexer_weights`."""
    check_lens(q_idx.shape[0], q_lens, ctx_lens)
    qo = _offsets(q_lens)
    out = []
    for r, (qn, c) in enumerate(zip(q_lens, ctx_lens)):
        k = k_idx[r].to(torch.float64)
        if k.shape[0] != c + qn:
            raise ValueError(f"k_idx[{r}]: expected {c + qn} rows (ctx + q_len), got {k.shape[0]}")
        q = q_idx[qo[r]:qo[r + 1]].to(torch.float64)
        s = torch.einsum("thd,sd->ths", q, k).clamp_min(0)
        s = torch.einsum("ths,th->ts", s, w[qo[r]:qo[r + 1]].to(torch.float64))
        pos = c + torch.arange(qn)
        s = s.masked_fill(torch.arange(c + qn)[None, :] > pos[:, None], float("-inf"))
        out.append(s)
    return out


def topk_reference(scores: Tensor, k: int) -> Tensor:
    """scores [M, S] (-inf = not visible) -> int32 [M, k]: positions by descending score, ties to
    the lower position; -1 where a row has fewer than k visible positions."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx = order.indices[:, :k].to(torch.int32)
    vals = order.values[:, :k]
    idx = torch.where(vals == float("-inf"), torch.full_like(idx, PAD), idx)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], k - idx.shape[1]), PAD)], dim=1)
    return idx


def select_reference(q_idx: Tensor, k_idx: list[Tensor], w: Tensor, q_lens: list[int], ctx_lens: list[int],
                     topk: int) -> Tensor:
    """The whole indexer: int32 [T, topk] selected positions per new token (request-local index space)."""
    parts = [topk_reference(s, topk) for s in indexer_scores_reference(q_idx, k_idx, w, q_lens, ctx_lens)]
    if not parts:
        return torch.empty(0, topk, dtype=torch.int32)
    return torch.cat(parts, dim=0)


def dense_indices(q_lens: list[int], ctx_lens: list[int], topk: int | None = None) -> Tensor:
    """Every causally visible position per new token (what the indexer selects when topk >= ctx+q_len):
    int32 [T, topk or max(ctx+q_len)], -1 padded."""
    width = topk if topk is not None else max([c + q for c, q in zip(ctx_lens, q_lens)] + [1])
    rows = []
    for qn, c in zip(q_lens, ctx_lens):
        pos = c + torch.arange(qn)
        j = torch.arange(width)
        rows.append(torch.where(j[None, :] <= pos[:, None], j[None, :], torch.full((1, 1), PAD)))
    return torch.cat(rows).to(torch.int32) if rows else torch.empty(0, width, dtype=torch.int32)


# -- sparse latent attention ------------------------------------------------------------

def sparse_latent_attention_reference(
    q: Tensor,  # [T, N, P+R]
    kv_c: list[Tensor],  # per request [ctx+q_len, L]: context rows then new rows
    k_pe: list[Tensor],  # per request [ctx+q_len, R]
    indices: Tensor,  # int32 [T, K] request-local positions, -1 = none
    q_lens: list[int],
    w_kv_b: Tensor,  # [N*(P+V), L] dense
    P: int,
    V: int,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """(o [T, N, V] float32, lse [N, T] float32): each query attends exactly its listed positions
    (duplicates are not expected: top-k never repeats a position); -1 and positions at or past
    ctx + q_len are no key (the kernels' rule)."""
    T, N, D = q.shape
    R = D - P
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices: expected [T={T}, K], got {tuple(indices.shape)}")
    w_uk, w_uv = split_kv_b_proj(w_kv_b.to(torch.float64), N, P, V)
    q64 = q.to(torch.float64)
    q_lat = torch.einsum("tnp,npl->tnl", q64[..., :P], w_uk)
    o = torch.zeros(T, N, V, dtype=torch.float64)
    lse = torch.full((N, T), float("-inf"), dtype=torch.float64)
    qo = _offsets(q_lens)
    for r in range(len(q_lens)):
        kv = kv_c[r].to(torch.float64)
        pe = k_pe[r].to(torch.float64)[:, :R]
        for t in range(qo[r], qo[r + 1]):
            sel = indices[t].long()
            sel = sel[(sel >= 0) & (sel < kv.shape[0])]  # -1 and positions past the request: no key
            if sel.numel() == 0:
                continue
            s = (kv[sel] @ q_lat[t].t() + pe[sel] @ q64[t, :, P:].t()).t() * softmax_scale  # [N, k]
            lse[:, t] = torch.logsumexp(s, dim=-1)
            o_lat = torch.exp(s - lse[:, t, None]) @ kv[sel]  # [N, L]
            o[t] = torch.einsum("nl,nvl->nv", o_lat, w_uv)
    return o.to(torch.float32), lse.to(torch.float32)


def sparse_latent_attention_slots_reference(
    q_lat: Tensor,  # [T, H, L] absorbed queries
    q_pe: Tensor,  # [T, H, R]
    kv_cache: Tensor,  # [num_blocks, block_size, entry] in kv_cache_dtype
    kv_cache_dtype: str,
    slots: Tensor,  # int32 [T, K] flat physical slots, -1 = none
    softmax_scale: float,
    k_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(o_lat [T, H, L] float32, lse [T, H] float32 natural log) of vLLM's sparse MLA kernel hook
    (mla_ext/sparse/slot_attention.py): token t attends the cache rows slots[t], slot s being row
    s of the cache viewed flat (block s // block_rows, offset s % block_rows, block_rows the
    block stride in rows). A slot that names no row of the cache (negative, offset >= block_size,
    block >= num_blocks) is no key; a token without a key gets o = 0, lse = -inf. Rows are
    decoded as the cache holds them (decode_cache_rows), the math in float64."""
    T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    nb, B = kv_cache.shape[:2]
    block_rows = kv_cache.stride(0) // kv_cache.stride(1)
    cache = kv_cache.cpu()
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = cache.view(torch.uint8)
    o = torch.zeros(T, H, L, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        s = [int(v) for v in slots[t].tolist()]
        s = [v for v in s if v >= 0 and v % block_rows < B and v // block_rows < nb]
        if not s:
            continue
        raw = torch.stack([cache[v // block_rows, v % block_rows] for v in s])
        rows = decode_cache_rows(raw, kv_cache_dtype, k_scale).to(torch.float64)  # [k, L+R]
        sc = (q_lat[t].cpu().to(torch.float64) @ rows[:, :L].t()
              + q_pe[t].cpu().to(torch.float64) @ rows[:, L:L + R].t()) * softmax_scale  # [H, k]
        lse[t] = torch.logsumexp(sc, dim=-1)
        o[t] = torch.exp(sc - lse[t, :, None]) @ rows[:, :L]
    return o.to(torch.float32), lse.to(torch.float32)
