"""DSA in the layer: `MLAPrefill(..., sparse=SparseConfig)` runs a sparse family sparse.

A sparse family's config carries `index_topk`, `index_n_heads`, `index_head_dim`
(DeepSeek-V3.2, GLM-5 `glm_moe_dsa`); `SparseConfig.from_config` reads them (None for a
dense family, which stays dense). `forward(..., index=IndexInputs(...))` then:

  1. selects, per new token, the index_topk positions of its request's index space
     (context then new tokens) with the chunked indexer (mla_ext/sparse/topk.py), the
     context's indexer keys read from this layer's paged index cache (same block table as
     the latent cache: a block id names both pages);
  2. absorbs the queries through W_UK, attends exactly the selected positions straight from
     the paged latent cache (mla_ext/sparse/sparse_attention.py, any cache format; new
     positions from the new tokens' own rows), un-absorbs through W_UV.

When no request has more than index_topk tokens (context + new) nothing would be dropped and
the dense path is the same computation (tests prove it), so the layer runs dense and the
indexer inputs are not needed; past that, a sparse layer without `index` is an error, never
a silent dense answer. `index` may instead be a selection made before (int32 [T, K],
request-local positions, -1 padded: `layer.last_selection` of another layer), which a GLM-5
"shared" layer reuses from the previous full layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.attention.latent import absorb_queries, absorbed_weights, unabsorb
from mla_ext.config.sparse import SPARSE_KEYS, SparseConfig
from mla_ext.prefill.backends import NO_PLAN
from mla_ext.sparse.index_cache import check_index_cache as check_index_cache_format
from mla_ext.sparse.sparse_attention import sparse_latent_attention
from mla_ext.sparse.topk import indexer_topk


@dataclass
class IndexInputs:
    """The new tokens' indexer inputs (RoPE applied) and the layer's paged index cache."""
    q: Tensor  # [T, H, D]
    weights: Tensor  # [T, H]: weights_proj(hidden) * H^-0.5 * D^-0.5
    k: Tensor  # [T, D]
    cache: Tensor | None  # [num_blocks, B, D or D + 4D/Q] in SparseConfig.index_cache_dtype


def indexer_backend(q: Tensor) -> str:
    """The indexer's scorer: Triton on CUDA (reads the paged index cache directly), torch elsewhere."""
    if q.device.type != "cuda":
        return "torch"
    from mla_ext.sparse import triton_indexer

    return "torch" if triton_indexer.not_supported_reasons(q) else "triton"


def sparse_forward(layer, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor, metadata,
                   index: IndexInputs, k_scale: Tensor | None, sites=NO_PLAN) -> Tensor:
    """[T, N, V]: the sparse layer's output (arguments already checked by MLAPrefill.forward). `sites`:
    the batch's resolved backends (mla_ext/prefill/backends.py): the indexer's scorer, its index
    gather and the sparse attention are each chosen once per (layer key, batch plan)."""
    cfg, m = layer.sparse, layer.model
    T, dev = q.shape[0], q.device
    ctx, qls = list(metadata.context_lens), list(metadata.query_lens)
    if isinstance(index, Tensor):  # a selection made before (GLM-5's "shared" layers reuse the last full one's)
        if index.dim() != 2 or index.shape[0] != T or index.dtype not in (torch.int32, torch.int64) \
                or index.device != dev:
            raise ValueError(f"index: a selection must be int32 [T={T}, K] on {dev}, got {index.dtype} "
                             f"{tuple(index.shape)} on {index.device}")
        sel = index
    elif isinstance(index, IndexInputs):
        H, D = cfg.index_n_heads, cfg.index_head_dim
        if tuple(index.q.shape) != (T, H, D) or tuple(index.weights.shape) != (T, H) \
                or tuple(index.k.shape) != (T, D):
            raise ValueError(f"index: expected q [{T}, {H}, {D}], weights [{T}, {H}], k [{T}, {D}]; got "
                             f"{tuple(index.q.shape)}, {tuple(index.weights.shape)}, {tuple(index.k.shape)}")
        sel = indexer_topk(index.q, index.weights, index.k, index.cache, metadata.block_table, qls, ctx,
                           cfg.index_topk, index_cache_dtype=cfg.index_cache_dtype, chunk=cfg.chunk,
                           backend=sites.value(("indexer", "new"), lambda: indexer_backend(index.q)),
                           chosen=sites.site(("index_gather", "new")))
    else:
        raise ValueError(f"index: expected mla_ext.prefill.sparse.IndexInputs or a selection tensor, got "
                         f"{type(index).__name__}")
    w_uk, w_uv_t = absorbed_weights(layer.kv_b_proj, m.num_heads, m.P, m.V, q.dtype, dev)
    q_lat = absorb_queries(q[..., :m.P], w_uk)
    scale = layer._k_scale(k_scale if k_scale is not None else metadata.k_scale, dev)
    o_lat, _ = sparse_latent_attention(q_lat, q[..., m.P:], kv_cache, layer.kv_cache_dtype, metadata.block_table,
                                       sel, kv_c_normed, k_pe, scale, layer.softmax_scale, q_lens=qls, ctx_lens=ctx,
                                       chosen=sites.site(("sparse_attention", "new")))
    layer.last_selection = sel  # for inspection and tests
    return unabsorb(o_lat, w_uv_t)


def check_index_cache(cfg: SparseConfig, index_cache, block_size: int, kv_cache: Tensor | None = None,
                      arg: str = "index_cache") -> None:
    """A layer's paged index cache against its latent plan, before anything reads it: the same block
    ids name a latent page and an index page, so the index pages must hold `block_size` tokens (the
    latent cache's page size; another page size maps block b, offset o to other tokens and the
    indexer scores the wrong rows), at least as many blocks as the latent cache (an id valid there
    must be valid here), the storage dtype of `cfg.index_cache_dtype` and its row width (D, or
    D + 4*D/Q bytes for fp8): mla_ext.sparse.index_cache.check_index_cache with the layer's facts."""
    check_index_cache_format(index_cache, cfg.index_cache_dtype, cfg.index_head_dim, block_size, arg=arg,
                             kv_cache=kv_cache)


def check_index_inputs(cfg, index, kv_cache: Tensor, q: Tensor) -> None:
    """`index` (IndexInputs or a selection tensor) for a layer of SparseConfig `cfg` whose latent
    cache is `kv_cache` and new-token queries `q`; shapes of the indexer inputs are checked by
    sparse_forward, the rest here."""
    if isinstance(index, Tensor):
        check_no_meta(index=index)
        return
    if not isinstance(index, IndexInputs):
        return  # sparse_forward names the expected types
    named = {"index.q": index.q, "index.weights": index.weights, "index.k": index.k, "index.cache": index.cache}
    for name, t in named.items():
        if t is not None and not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_no_meta(**named)
    for name, t in named.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
    # index.cache's geometry (dtype, page size, width, blocks) is not re-checked here: MLAPrefill.forward
    # checked it against the latent plan first (mla_ext.prefill.sparse.check_index_cache).


def sparse_for(model, sparse, context_parallel):
    """The layer's SparseConfig: `sparse` when given (its indexer shape checked against the model
    config's, when that has one), else the model config's own (`SparseConfig.from_config`), so a
    layer of a sparse (DSA) model is sparse however it was described; None for a dense model."""
    if sparse is not None and not isinstance(sparse, SparseConfig):
        raise ValueError(f"sparse: expected an mla_ext.prefill.sparse.SparseConfig or None, got "
                         f"{type(sparse).__name__}")
    stated = SparseConfig.from_config(model)
    if sparse is None:
        sparse = stated
    elif stated is not None:
        for key in SPARSE_KEYS:
            if getattr(sparse, key) != getattr(stated, key):
                raise ValueError(f"sparse: {key}={getattr(sparse, key)} but the model config {model.name!r} "
                                 f"says {key}={getattr(stated, key)}; a layer's indexer is its model's")
    if sparse is not None and context_parallel is not None:
        raise ValueError(f"sparse: the sparse (DSA) path (index_topk={sparse.index_topk}) does not support "
                         "context parallelism yet (its selected positions index the whole context); pass "
                         "context_parallel=None")
    return sparse
