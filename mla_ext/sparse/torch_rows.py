"""The steps the two torch backends of sparse latent attention share (request-local indices:
mla_ext/sparse/sparse_attention.py; vLLM's flat physical slots: mla_ext/sparse/slot_attention.py):
decode each selected cache entry once, then attend a token's K rows with its LSE. fp32 math,
bounded by the caller's token blocks."""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.cache.reference import decode_cache_rows


def decode_entries(kv_cache: Tensor, flat: Tensor, ok: Tensor, per_block: int, kv_cache_dtype: str,
                   k_scale: Tensor | None, width: int) -> Tensor:
    """fp32 [*flat.shape, width]: entry flat // per_block, flat % per_block of the paged cache,
    decoded as the cache holds it; zeros where not `ok` (never read). Tokens of a block share
    most of their entries: each distinct entry is decoded once."""
    s = torch.where(ok, flat.to(torch.int64), 0)
    uniq, inv = torch.unique(s, return_inverse=True)
    raw = kv_cache[uniq // per_block, uniq % per_block]  # [U, entry]
    dec = decode_cache_rows(raw, kv_cache_dtype, k_scale)[:, :width].to(kv_cache.device)[inv]
    return torch.where(ok[..., None], dec, 0.0)


def attend(q_lat: Tensor, q_pe: Tensor, rows: Tensor, valid: Tensor, softmax_scale: float) -> tuple[Tensor, Tensor]:
    """q_lat [t, H, L], q_pe [t, H, R], rows fp32 [t, K, L+R], valid [t, K] -> (o fp32 [t, H, L],
    natural-log lse [t, H]); a token without a valid row gets o = 0, lse = -inf."""
    L = q_lat.shape[-1]
    s = torch.einsum("thl,tkl->thk", q_lat.float(), rows[..., :L])
    if q_pe.shape[-1]:
        s += torch.einsum("thr,tkr->thk", q_pe.float(), rows[..., L:])
    s = (s * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("thk,tkl->thl", p, rows[..., :L]), lse
