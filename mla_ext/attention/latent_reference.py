"""Pure-PyTorch float64 reference for context attention in latent space
(the "absorbed" path of `MLAPrefill`, mla_ext/attention/latent.py).

Head h's keys and values are linear in the cached latent row kv_c (SPEC §1,
§10: rows [h(P+V), h(P+V)+P) of the [N(P+V), L] kv_b_proj weight are W_UK[h],
the next V rows W_UV[h]):

    k_nope[s, h] = W_UK[h] @ kv_c[s]          v[s, h] = W_UV[h] @ kv_c[s]

so q_nope[t, h] . k_nope[s, h] = (q_nope[t, h] @ W_UK[h]) . kv_c[s], and the
attention output is W_UV[h] @ sum_s p[t, h, s] kv_c[s]. Attending in latent
space is multi-query attention (every head shares the one latent row) with
q = [q_lat, q_pe] (Dqk = L + R) and v = kv_c (Dv = L); its LSE is the
head-space LSE exactly, and un-absorbing the latent output through W_UV gives
the head-space output. These functions state that with no paging, no chunks
and no rounding: the paged, chunked kernels are tested against them.
"""
from __future__ import annotations

import torch
from torch import Tensor


def split_kv_b_proj(w_kv_b: Tensor, num_heads: int, P: int, V: int) -> tuple[Tensor, Tensor]:
    """The logical [N*(P+V), L] weight -> (W_UK [N, P, L], W_UV [N, V, L]), views."""
    if w_kv_b.dim() != 2 or w_kv_b.shape[0] != num_heads * (P + V):
        raise ValueError(f"w_kv_b: expected [{num_heads * (P + V)}, L] (N*(P+V), L), got "
                         f"{tuple(w_kv_b.shape)}")
    w = w_kv_b.view(num_heads, P + V, w_kv_b.shape[1])
    return w[:, :P], w[:, P:]


def _per_request(T: int, N: int, V: int, q_lens: list[int], ctx_lens: list[int], attend) -> tuple[Tensor, Tensor]:
    """(o [T, N, V], lse [N, T]) float32, filled per request with context and queries by
    attend(r, rows) -> (o_r [qn, N, V], lse_r [N, qn]) in float64; o = 0, lse = -inf elsewhere."""
    o = torch.zeros(T, N, V, dtype=torch.float64)
    lse = torch.full((N, T), float("-inf"), dtype=torch.float64)
    start = 0
    for r, qn in enumerate(q_lens):
        rows = slice(start, start + qn)
        start += qn
        if qn and ctx_lens[r]:
            o[rows], lse[:, rows] = attend(r, rows)
    return o.to(torch.float32), lse.to(torch.float32)


def _check_batch(q: Tensor, ctx_kv_c, ctx_k_pe, q_lens) -> None:
    T = q.shape[0]
    if sum(q_lens) != T or len(ctx_kv_c) != len(q_lens) or len(ctx_k_pe) != len(q_lens):
        raise ValueError(f"q_lens / ctx_kv_c / ctx_k_pe: expected one entry per request summing to "
                         f"T={T}, got {len(q_lens)} lengths summing to {sum(q_lens)}, "
                         f"{len(ctx_kv_c)} and {len(ctx_k_pe)} tensors")


def latent_context_attention_reference(
    q: Tensor,  # [T, N, P+R]
    ctx_kv_c: list[Tensor],  # per request [ctx_r, L]
    ctx_k_pe: list[Tensor],  # per request [ctx_r, R]
    q_lens: list[int],
    w_kv_b: Tensor,  # [N*(P+V), L], dense (dequantized)
    P: int,
    V: int,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """The context part of one layer, attended in latent space, in float64.

    Returns (o [T, N, V] float32, lse [N, T] float32, natural log): query t of
    request r against every context token of r (no causal mask: new tokens
    come after the context). A request without context gets o = 0, lse = -inf.
    """
    _check_batch(q, ctx_kv_c, ctx_k_pe, q_lens)
    T, N, D = q.shape
    R = D - P
    w_uk, w_uv = split_kv_b_proj(w_kv_b.to(torch.float64), N, P, V)
    q64 = q.to(torch.float64)
    q_lat = torch.einsum("tnp,npl->tnl", q64[..., :P], w_uk)  # absorbed queries [T, N, L]

    def attend(r, rows):
        kv = ctx_kv_c[r].to(torch.float64)
        pe = ctx_k_pe[r].to(torch.float64)[:, :R]
        s = (torch.einsum("tnl,sl->nts", q_lat[rows], kv)
             + torch.einsum("tnr,sr->nts", q64[rows, :, P:], pe)) * softmax_scale  # [N, qn, C]
        lse_r = torch.logsumexp(s, dim=-1)  # [N, qn]
        o_lat = torch.einsum("nts,sl->tnl", torch.exp(s - lse_r[..., None]), kv)  # latent output [qn, N, L]
        return torch.einsum("tnl,nvl->tnv", o_lat, w_uv), lse_r

    return _per_request(T, N, V, q_lens, [t.shape[0] for t in ctx_kv_c], attend)


def head_space_context_attention_reference(
    q: Tensor, ctx_kv_c: list[Tensor], ctx_k_pe: list[Tensor], q_lens: list[int], w_kv_b: Tensor,
    P: int, V: int, softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    """The same context attention the up-projection way (SPEC §1 step 2), in float64:
    up-project the context rows, attend per head. Equal to the latent form up to
    float64 rounding (tests prove it); kept to show the identity, not for speed."""
    _check_batch(q, ctx_kv_c, ctx_k_pe, q_lens)
    T, N, D = q.shape
    R = D - P
    w = w_kv_b.to(torch.float64)

    def attend(r, rows):
        C = ctx_kv_c[r].shape[0]
        kv = (ctx_kv_c[r].to(torch.float64) @ w.t()).view(C, N, P + V)
        k = torch.cat([kv[..., :P], ctx_k_pe[r].to(torch.float64)[:, None, :R].expand(C, N, R)], dim=-1)
        s = torch.einsum("tnd,snd->nts", q[rows].to(torch.float64), k) * softmax_scale
        lse_r = torch.logsumexp(s, dim=-1)
        return torch.einsum("nts,snv->tnv", torch.exp(s - lse_r[..., None]), kv[..., P:]), lse_r

    return _per_request(T, N, V, q_lens, [t.shape[0] for t in ctx_kv_c], attend)
