"""One-shot dense oracle for a whole MLA prefill-with-context layer (SPEC §1).

No paging, no chunks, no quantisation: the context's latent rows are given
per request as plain float tensors, everything is computed in float64/float32
in one softmax per request. The chunked, paged pipeline must equal this within
SPEC §9 (after accounting for the cache format's own rounding, which tests
apply to the context rows before calling this).
"""
from __future__ import annotations

import torch
from torch import Tensor


def up_project(kv_c: Tensor, w_kv_b: Tensor, num_heads: int, P: int, V: int) -> tuple[Tensor, Tensor]:
    """kv_c [T, L] -> (k_nope [T, N, P], v [T, N, V]).

    w_kv_b is the logical kv_b_proj weight `[N*(P+V), L]`: per head, P rows of
    k_nope followed by V rows of v (the checkpoint's layout).
    """
    T = kv_c.shape[0]
    kv = (kv_c.to(torch.float64) @ w_kv_b.to(torch.float64).t()).view(T, num_heads, P + V)
    return kv[..., :P], kv[..., P:]


def mla_prefill_reference(
    q: Tensor,  # [T, N, P+R]
    kv_c_new: Tensor,  # [T, L]
    k_pe_new: Tensor,  # [T, R]
    ctx_kv_c: list[Tensor],  # per request [ctx_r, L]
    ctx_k_pe: list[Tensor],  # per request [ctx_r, R]
    q_lens: list[int],
    w_kv_b: Tensor,  # [N*(P+V), L], dense (dequantized)
    P: int,
    V: int,
    softmax_scale: float,
    sinks: Tensor | None = None,  # [N] attention-sink logits (hy_v4), or None
) -> Tensor:
    """Output [T, N, V] in float32.

    New token i of request r attends to every context token of r and to new
    tokens j <= i of r (causal within the new tokens). With `sinks`, head n's
    logit sinks[n] is one more softmax column without a value.
    """
    T, N, D = q.shape
    R = D - P
    if sum(q_lens) != T:
        raise ValueError(f"q_lens: must sum to T={T}, got {sum(q_lens)}")
    if len(ctx_kv_c) != len(q_lens) or len(ctx_k_pe) != len(q_lens):
        raise ValueError("ctx_kv_c / ctx_k_pe: need one tensor per request")
    out = torch.empty(T, N, V, dtype=torch.float64)
    start = 0
    for r, qn in enumerate(q_lens):
        rows = slice(start, start + qn)
        latent = torch.cat([ctx_kv_c[r].to(torch.float64), kv_c_new[rows].to(torch.float64)])
        rope = torch.cat([ctx_k_pe[r].to(torch.float64), k_pe_new[rows].to(torch.float64)])
        k_nope, v = up_project(latent, w_kv_b, N, P, V)
        k = torch.cat([k_nope, rope[:, None, :R].expand(-1, N, R)], dim=-1)  # [S, N, P+R]
        qr = q[rows].to(torch.float64)
        scores = torch.einsum("tnd,snd->nts", qr, k) * softmax_scale  # [N, qn, S]
        ctx = ctx_kv_c[r].shape[0]
        S = k.shape[0]
        # causal over the new tokens: query i sees keys j < ctx + i + 1
        allowed = torch.arange(S)[None, :] < (ctx + torch.arange(qn)[:, None] + 1)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:
            col = sinks.to(torch.float64).view(N, 1, 1).expand(N, qn, 1)
            probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :S]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("nts,snv->tnv", probs, v)
        start += qn
    return out.to(torch.float32)
