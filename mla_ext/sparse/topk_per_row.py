"""Per-row top-k over a logits matrix, as vLLM's _C top_k_per_row_prefill / top_k_per_row_decode /
persistent_topk select (their contracts: mla_ext/sparse/indexer_ops_reference.py), in torch on any
device (torch.topk on the GPU; no host sync).

Row m selects among columns [row_starts[m], row_ends[m]) and writes the chosen columns relative to
row_starts[m] into out[m, :], -1 where the row has fewer than k columns. The selection follows
the library's tie rule through `tie_keys` (one int64 key per column: score bits, then the inverted
position, so every key is distinct and torch.topk picks exactly the rule's set); columns outside
the row get the smallest key and come out as -1. Rows are processed in blocks so the keys
workspace stays below `KEYS_BUDGET` elements whatever the batch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.sparse.reference import PAD
from mla_ext.sparse.topk import tie_keys

KEYS_BUDGET = 1 << 22  # int64 keys per row block (32 MiB)
_NONE = torch.iinfo(torch.int64).min


def top_k_per_row(logits: Tensor, row_starts: Tensor | None, row_ends: Tensor, out: Tensor) -> Tensor:
    """logits [M, W] float, row_starts/row_ends [M] int (row_starts None: 0), out int32 [M, k] (any
    strides; written in place) -> out."""
    M, W = logits.shape
    k = out.shape[1]
    dev = logits.device
    if M == 0 or k == 0:
        return out
    kk = min(k, W)
    if kk < k:
        out[:, kk:] = PAD
    if kk == 0:
        return out
    cols = torch.arange(W, device=dev, dtype=torch.int64)
    rb = max(1, KEYS_BUDGET // max(W, 1))
    for r0 in range(0, M, rb):
        r1 = min(M, r0 + rb)
        st = (torch.zeros(r1 - r0, dtype=torch.int64, device=dev) if row_starts is None
              else row_starts[r0:r1].to(device=dev, dtype=torch.int64))[:, None]
        en = row_ends[r0:r1].to(device=dev, dtype=torch.int64)[:, None]
        rel = cols[None, :] - st
        valid = (rel >= 0) & (cols[None, :] < en)
        keys = tie_keys(logits[r0:r1].to(torch.float32), rel.clamp(0, 0xFFFFFFFF))
        keys = torch.where(valid, keys, torch.full_like(keys, _NONE))
        top = torch.topk(keys, kk, dim=1)
        idx = torch.where(top.values == _NONE, torch.full_like(top.indices, PAD), top.indices - st)
        out[r0:r1, :kk] = idx.to(torch.int32)
    return out


def decode_row_ends(seq_lens: Tensor, next_n: int, num_rows: int) -> Tensor:
    """int64 [num_rows] on seq_lens' device (no host sync): the visible length of each decode row.
    seq_lens with num_rows entries ([B, next_n]) is per row; otherwise ([B, 1] / [B]) it is per
    request, row j of its next_n seeing L - next_n + j + 1 (clamped at 0)."""
    cl = seq_lens.reshape(-1).to(torch.int64)
    if cl.numel() == num_rows:
        return cl.clamp_min(0)
    need = (num_rows + next_n - 1) // next_n
    if next_n < 1 or cl.numel() < need:
        raise ValueError(f"seq_lens: expected {num_rows} per-row entries or at least {need} per-request ones "
                         f"(next_n={next_n}), got {tuple(seq_lens.shape)}")
    r = torch.arange(num_rows, device=cl.device)
    return (cl[r // next_n] - next_n + 1 + r % next_n).clamp_min(0)
