"""Pure-PyTorch references for the attention stage (SPEC §7).

These are the ground truth every other backend is tested against, and the
"torch" fallback backend: correct on any device, slow (one softmax per request).
Math runs in float32 by default, float64 on request (`compute_dtype`).

Conventions shared by every backend:
- LSE is the natural-log log-sum-exp of the scaled scores, laid out `[N, T]`.
- A query row with no visible key has o = 0 and lse = -inf (never NaN).
- Causal masks are bottom-right aligned: query i of a request with q_len
  queries and k_len keys sees keys j <= i + (k_len - q_len). With
  q_len == k_len (the new-token pass) this is the usual lower triangle; with
  k_len > q_len the queries are the last q_len positions of the sequence.
"""
from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    compute_dtype: torch.dtype = torch.float32,
    *,
    k_rope: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention with LSE. Returns (o [Tq,N,Dv] in q.dtype, lse [N,Tq] fp32).

    q [Tq,N,Dqk], k [Tk,N,Dqk], v [Tk,N,Dv]; request b owns query rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1].
    Query rows outside every request are left at o = 0, lse = -inf.

    Split keys (MLA): with `k_rope` ([Tk, R], or [Tk, 1 or N, R]) `k` is
    k_nope [Tk, N, P] and the keys are cat(k_nope, k_rope broadcast over heads),
    P + R = Dqk. The scores are then q[..., :P]·k_nope + q[..., P:]·k_rope, per
    request: the full keys are never built.

    Attention sinks: with `sinks` [N] each head's logit is one more column of every
    row's softmax whose probability is dropped (no value); the LSE includes it.
    """
    tq, n, _ = q.shape
    dv = v.shape[-1]
    o = torch.zeros(tq, n, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((n, tq), NEG_INF, dtype=compute_dtype, device=q.device)
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        ql, kl = q1 - q0, k1 - k0
        if ql == 0 or kl == 0:
            if sinks is not None and ql:  # only the sink: o = 0, lse = sink
                lse[:, q0:q1] = sinks.to(compute_dtype)[:, None]
            continue
        qb = q[q0:q1].to(compute_dtype).transpose(0, 1)  # [N, ql, Dqk]
        kb = k[k0:k1].to(compute_dtype).transpose(0, 1)  # [N, kl, Dqk] (or P)
        vb = v[k0:k1].to(compute_dtype).transpose(0, 1)  # [N, kl, Dv]
        if k_rope is None:
            s = torch.matmul(qb, kb.transpose(1, 2))  # [N, ql, kl]
        else:
            p = kb.shape[-1]
            rb = k_rope[k0:k1]
            if rb.dim() == 3 and rb.stride(1) == 0:
                rb = rb[:, :1]  # one rope row shared by the heads (an expanded view)
            # [1 or N, kl, R]; the head count is explicit: R = 0 (no rope) leaves no
            # elements to infer it from.
            rb = rb.to(compute_dtype).reshape(kl, rb.shape[1] if rb.dim() == 3 else 1,
                                              rb.shape[-1]).transpose(0, 1)
            s = torch.matmul(qb[..., :p], kb.transpose(1, 2)) + torch.matmul(qb[..., p:], rb.transpose(1, 2))
        s = s * softmax_scale
        if causal:
            i = torch.arange(ql, device=q.device).unsqueeze(1)
            j = torch.arange(kl, device=q.device).unsqueeze(0)
            s = s.masked_fill(j > i + (kl - ql), NEG_INF)
        if sinks is not None:  # the sink column joins the softmax, then leaves it
            col = sinks.to(compute_dtype).view(n, 1, 1).expand(n, ql, 1)
            row_lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
        else:
            row_lse = torch.logsumexp(s, dim=-1)  # [N, ql]; -inf for rows with no key
        has_key = torch.isfinite(row_lse)
        # exp(s - lse) is NaN on key-less rows (-inf - -inf); zero them instead.
        p = torch.exp(s - torch.where(has_key, row_lse, 0.0).unsqueeze(-1))
        p = torch.where(has_key.unsqueeze(-1), p, 0.0)
        o[q0:q1] = torch.matmul(p, vb).transpose(0, 1)
        lse[:, q0:q1] = row_lse
    return o.to(q.dtype), lse.to(torch.float32)


def merge_attn_states_ref(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial results (SPEC §7). o* [T,N,D], lse* [N,T].

    Returns (o [T,N,D] in o1.dtype, lse [N,T] fp32). +inf LSE counts as -inf;
    a side with -inf LSE contributes nothing (its o is never read into the
    result, so garbage there cannot leak); two empty sides give o = 0, lse = -inf.
    """
    a = _empty_if_pos_inf(lse1.to(compute_dtype))
    b = _empty_if_pos_inf(lse2.to(compute_dtype))
    m = torch.maximum(a, b)
    both_empty = m == NEG_INF
    m_safe = torch.where(both_empty, 0.0, m)
    w1 = torch.exp(a - m_safe)  # exp(-inf) = 0 for an empty side
    w2 = torch.exp(b - m_safe)
    denom = w1 + w2
    # [N,T] -> [T,N,1] to broadcast over the head dim
    w1t = (w1 / torch.where(both_empty, 1.0, denom)).transpose(0, 1).unsqueeze(-1)
    w2t = (w2 / torch.where(both_empty, 1.0, denom)).transpose(0, 1).unsqueeze(-1)
    x1 = torch.where(w1t > 0, o1.to(compute_dtype), 0.0)
    x2 = torch.where(w2t > 0, o2.to(compute_dtype), 0.0)
    o = w1t * x1 + w2t * x2
    lse = torch.where(both_empty, NEG_INF, m_safe + torch.log(torch.where(both_empty, 1.0, denom)))
    return o.to(o1.dtype), lse.to(torch.float32)


def _empty_if_pos_inf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(lse == math.inf, NEG_INF, lse)
