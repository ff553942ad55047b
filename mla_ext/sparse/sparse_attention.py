"""Sparse latent attention (DSA) straight from the paged cache: absorbed queries attend a
per-query list of token positions (request-local index space, mla_ext/sparse/reference.py),
context positions from the paged latent cache in any format, new positions from the new
tokens' own latent rows; LSE natural-log [N, T].

Backends (`SPARSE` dispatcher; force with `SPARSE.force(name)` or
MLA_EXT_FORCE_SPARSE_LATENT_ATTENTION=name):
  triton  mla_ext/sparse/triton_sparse.py, decoding every format in its loader; CUDA, or
          the CPU under TRITON_INTERPRET=1 only when forced (the interpreter is for tests);
  torch   per block of queries, fetch the block's distinct selected cache entries
          (cache[block, slot]) once, decode them with mla_ext.cache.reference.decode_cache_rows
          (every format), fp32 matmuls; the workspace is bounded by `MAX_ROW_BYTES` whatever
          the context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.attention import triton_latent as TL
from mla_ext.cache.checks import check_cache_dtype
from mla_ext.dispatch import Backend, Chosen, Dispatcher
from mla_ext.sparse.torch_rows import attend, decode_entries
from mla_ext.config.formats import QuantMode, get_format
from mla_ext.attention.latent import latent_outputs
from mla_ext.dispatch import report_device

MAX_ROW_BYTES = 64 << 20  # torch backend: decoded rows per query block


@dataclass
class SparseInputs:
    q_lat: Tensor  # [N, T, L]
    q_pe: Tensor  # [T, N, R]
    kv_cache: Tensor
    kv_cache_dtype: str
    block_table: Tensor  # [num_reqs, max_blocks] int32
    indices: Tensor  # [T, K] int32
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    new_kv_c: Tensor  # [T, L]
    new_k_pe: Tensor  # [T, R]
    k_scale: Tensor | None
    softmax_scale: float

    @property
    def device(self) -> torch.device:
        return self.q_lat.device


def _triton_reasons(x: SparseInputs) -> list[str]:
    if x.device.type == "cpu" and SPARSE._forced_name() != "triton":
        return ["input is on the CPU: the Triton interpreter runs only when this backend is forced"]
    return TL.not_supported_reasons(x.kv_cache, x.q_lat, x.kv_cache_dtype)


def _host_meta(x: SparseInputs):
    dev = x.device
    cu = [0]
    for n in x.q_lens:
        cu.append(cu[-1] + n)
    tok_req = torch.repeat_interleave(torch.arange(len(x.q_lens)), torch.tensor(x.q_lens, dtype=torch.int64))
    return (tok_req.to(torch.int32).to(dev), torch.tensor(x.ctx_lens, dtype=torch.int32, device=dev),
            torch.tensor(cu, dtype=torch.int32, device=dev), cu)


def _triton_run(x: SparseInputs) -> tuple[Tensor, Tensor]:
    from mla_ext.sparse.triton_sparse import sparse_latent_attention_triton

    out, lse = latent_outputs(x.q_lat)
    tok_req, ctx, cuq, _ = _host_meta(x)
    sparse_latent_attention_triton(x.q_lat, x.q_pe, x.kv_cache, x.kv_cache_dtype, x.block_table, x.indices, tok_req,
                                   ctx, cuq, x.new_kv_c, x.new_k_pe, x.k_scale, x.softmax_scale, out, lse)
    return out, lse


def _rows(x: SparseInputs, t0: int, t1: int, tok_req: Tensor, cu: list[int]) -> tuple[Tensor, Tensor]:
    """(decoded rows [t1-t0, K, L+R] fp32, valid [t1-t0, K]) for queries t0..t1."""
    idx = x.indices[t0:t1].to(torch.int64)
    req = tok_req[t0:t1].to(torch.int64)[:, None].expand_as(idx)
    ctx = torch.tensor(x.ctx_lens, dtype=torch.int64, device=idx.device)[req]
    qlen = torch.tensor(x.q_lens, dtype=torch.int64, device=idx.device)[req]
    valid = (idx >= 0) & (idx < ctx + qlen)
    in_ctx = valid & (idx < ctx)
    B, nb, width = x.kv_cache.shape[1], x.kv_cache.shape[0], x.block_table.shape[1]
    lblk = torch.where(in_ctx, idx // B, 0)
    in_table = in_ctx & (lblk < width)
    blk = torch.where(in_table, x.block_table.to(torch.int64)[req, lblk.clamp_max(max(width - 1, 0))]
                      if width else torch.zeros_like(idx), -1)
    ok = in_table & (blk >= 0) & (blk < nb)
    L, R = x.q_lat.shape[-1], x.q_pe.shape[-1]
    dec = decode_entries(x.kv_cache, blk * B + idx % B, ok, B, x.kv_cache_dtype, x.k_scale, L + R)
    is_new = valid & (idx >= ctx)
    start = torch.tensor(cu[:-1], dtype=torch.int64, device=idx.device)[req]
    nrow = torch.where(is_new, start + idx - ctx, 0)
    new = torch.cat([x.new_kv_c[nrow].float(), x.new_k_pe[nrow][..., :R].float()], dim=-1)
    return torch.where(is_new[..., None], new, dec), valid


def _torch_run(x: SparseInputs) -> tuple[Tensor, Tensor]:
    out, lse = latent_outputs(x.q_lat)
    N, T, L = x.q_lat.shape
    K = x.indices.shape[1]
    tok_req, _, _, cu = _host_meta(x)
    step = max(1, MAX_ROW_BYTES // max(1, K * (L + x.q_pe.shape[-1]) * 4))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows, valid = _rows(x, t0, t1, tok_req, cu)  # [tq, K, L+R], [tq, K]
        o, ls = attend(x.q_lat[:, t0:t1].transpose(0, 1), x.q_pe[t0:t1], rows, valid, x.softmax_scale)
        out[:, t0:t1] = o.transpose(0, 1).to(out.dtype)
        lse[:, t0:t1] = ls.transpose(0, 1)
    return out, lse


SPARSE = Dispatcher(
    "sparse_latent_attention",
    [
        Backend("triton", _triton_reasons, _triton_run),
        Backend("torch", lambda x: [], _torch_run),
    ],
)


def _lens(values, name: str) -> tuple[int, ...]:
    if not (isinstance(values, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                     for v in values)):
        raise ValueError(f"{name}: expected host non-negative ints, one per request, got {values!r}")
    return tuple(values)


def sparse_latent_attention(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, kv_cache_dtype: str, block_table: Tensor, indices: Tensor,
    new_kv_c: Tensor, new_k_pe: Tensor, k_scale: Tensor | None, softmax_scale: float, *, q_lens, ctx_lens,
    chosen: Chosen | None = None,
) -> tuple[Tensor, Tensor]:
    """(o_lat [N, T, L] q_lat's dtype, lse [N, T] float32): token t attends exactly indices[t]
    (int32 [T, K], request-local positions, -1 = none; positions past ctx + q_len are no key).

    q_lat [N, T, L] absorbed q_nope; q_pe [T, N, R]; kv_cache [num_blocks, B, entry] in
    `kv_cache_dtype`; block_table int32 [num_reqs, max_blocks]; new_kv_c [T, L], new_k_pe
    [T, R] the new tokens' latent rows; k_scale fp32 [1] for per-tensor fp8 formats;
    q_lens / ctx_lens host ints per request. `chosen`: the call site's backend when resolved once
    per batch (mla_ext/prefill/backends.py); None dispatches."""
    q_lens, ctx_lens = _lens(q_lens, "q_lens"), _lens(ctx_lens, "ctx_lens")
    if q_lat.dim() != 3:
        raise ValueError(f"q_lat: expected [N, T, L], got {tuple(q_lat.shape)}")
    N, T, L = q_lat.shape
    if not (len(q_lens) == len(ctx_lens) and sum(q_lens) == T):
        raise ValueError(f"q_lens / ctx_lens: expected one entry per request, q_lens summing to T={T}; got {q_lens}, {ctx_lens}")
    if not (q_pe.dim() == 3 and q_pe.shape[:2] == (T, N)):
        raise ValueError(f"q_pe: expected [T={T}, N={N}, R], got {tuple(q_pe.shape)}")
    R = q_pe.shape[2]
    if not (indices.dim() == 2 and indices.shape[0] == T and indices.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"indices: expected int32 [T={T}, K], got {indices.dtype} {tuple(indices.shape)}")
    if not (new_kv_c.shape == (T, L) and new_k_pe.dim() == 2 and new_k_pe.shape[0] == T and new_k_pe.shape[1] >= R):
        raise ValueError(f"new_kv_c / new_k_pe: expected [T={T}, L={L}] / [T, R={R}], got {tuple(new_kv_c.shape)} / "
           f"{tuple(new_k_pe.shape)}")
    if not (block_table.dim() == 2 and block_table.shape[0] >= len(q_lens)):
        raise ValueError(f"block_table: expected [>= {len(q_lens)}, max_blocks], got {tuple(block_table.shape)}")
    fmt = get_format(kv_cache_dtype)
    fmt.check_dims(L, R)
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, entry], got {tuple(kv_cache.shape)}")
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        if not (isinstance(k_scale, Tensor) and k_scale.numel() == 1):
            raise ValueError(f"k_scale: {fmt.name!r} needs a float32 tensor of 1 element")
    check_cache_dtype(kv_cache, fmt)  # a float8 cache of the other fp8 type would decode wrongly
    check_no_meta(q_lat=q_lat, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, indices=indices,
                  new_kv_c=new_kv_c, new_k_pe=new_k_pe, k_scale=k_scale)
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_table", block_table), ("indices", indices),
                    ("new_kv_c", new_kv_c), ("new_k_pe", new_k_pe)):
        if t.device != q_lat.device:
            raise ValueError(f"{name}: expected device {q_lat.device} (q_lat's), got {t.device}")
    x = SparseInputs(q_lat, q_pe, kv_cache, kv_cache_dtype, block_table, indices, q_lens, ctx_lens, new_kv_c,
                     new_k_pe, k_scale, float(softmax_scale))
    return SPARSE.run(x, chosen)


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] of the sparse latent attention for a probe on `device`
    (default: CUDA if visible), in the form `python -m mla_ext info` shows."""
    dev = report_device(device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.empty(1, 1, 512, dtype=dt, device=dev)
    i32 = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    x = SparseInputs(q, q.new_empty(1, 1, 64), q.new_empty(1, 16, 576), "auto", i32, i32, (1,), (0,),
                     q.new_empty(1, 512), q.new_empty(1, 64), None, 1.0)
    return [(SPARSE.op, b.name, b.not_supported_reasons(x)) for b in SPARSE.backends]


# vLLM's flavour (physical slots, token-major): mla_ext/sparse/slot_attention.py.
from mla_ext.sparse.slot_attention import (  # noqa: E402,F401  (re-export)
    SPARSE_SLOTS, sparse_latent_attention_slots,
)
