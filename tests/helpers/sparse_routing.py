"""Sparse (DSA) layers from each source a user describes them with, for the routing tests and the
fuzz class "sparse routing": a tiny DeepSeek-shaped layer (prefill_data.TINY) that is sparse with
index_topk = TOPK because

  "given"         MLAPrefill(..., sparse=SparseConfig(...)) says so;
  "model_config"  its model config says so: `SparseConfig.from_config(model)` answers for it
                  (`model_config_says`: what the config reader gives a sparse model's config);
  "builtin:NAME"  a built-in sparse model (deepseek-v3.2, glm-5) as get_model_config reads it.

A batch past index_topk (context + new > TOPK for some request) must be refused naming
index_topk by every dense-only entry point, and run sparse by forward with the indexer's inputs."""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch

from mla_ext.kv_b_proj import weights as W
from mla_ext.config.models import get_model_config
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.sparse.index_cache import get_index_format, write_index_cache
from mla_ext.prefill.synthetic import SyntheticBatch
from mla_ext.prefill.sparse import IndexInputs, SparseConfig
from helpers.prefill import BLOCK, TINY

TOPK, INDEX_HEADS, INDEX_DIM = 8, 2, 16
SPARSE = SparseConfig(TOPK, INDEX_HEADS, INDEX_DIM, index_cache_dtype="float32")
SPARSE_TINY = replace(TINY, name="tiny-deepseek-dsa")
SOURCES = ("given", "model_config")
BUILTIN_SPARSE = ("deepseek-v3.2", "glm-5")
PAST = dict(ctx=[12, 0, 5], qlens=[2, 3, 4])  # request 0 (and 2) past index_topk = 8
WITHIN = dict(ctx=[4, 0, 3], qlens=[2, 3, 4])  # every request within it


def past(topk: int) -> dict:
    """A batch with requests past index_topk (0 and 2) and one within (1)."""
    return dict(ctx=[topk + 4, 0, topk - 3], qlens=[2, 3, 4])


def available_sources() -> list[str]:
    """SOURCES, and the built-in sparse models whose config the config reader gives a SparseConfig."""
    return list(SOURCES) + [f"builtin:{n}" for n in BUILTIN_SPARSE
                            if SparseConfig.from_config(get_model_config(n)) is not None]


@contextlib.contextmanager
def model_config_says(model, sparse: SparseConfig):
    """SparseConfig.from_config(model) answers `sparse` within the block (for `model` only)."""
    real = SparseConfig.from_config.__func__

    def from_config(cls, raw, **overrides):
        if raw is model:
            return replace(sparse, **overrides)
        return real(cls, raw, **overrides)

    SparseConfig.from_config = classmethod(from_config)
    try:
        yield
    finally:
        SparseConfig.from_config = classmethod(real)


def weight(model, seed: int = 0) -> W.WeightFormat:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(model.num_heads * (model.P + model.V), model.L, generator=gen) / math.sqrt(model.L)
    return W.DenseWeight.from_dense(w, model.model_dtype)


def sparse_layer(source: str, fmt: str = "auto", **kw) -> MLAPrefill:
    """A sparse MLAPrefill (layer 1) of the tiny model, sparse by `source` (see the module docstring)."""
    kw.setdefault("workspace_rows_override", 32)
    kw.setdefault("max_num_seqs", 8)
    cache = CacheConfig(fmt, block_size=BLOCK)
    if source == "given":
        return MLAPrefill(SPARSE_TINY, cache, weight(SPARSE_TINY), layer=1, sparse=SPARSE, **kw)
    if source == "model_config":
        with model_config_says(SPARSE_TINY, SPARSE):
            return MLAPrefill(SPARSE_TINY, cache, weight(SPARSE_TINY), layer=1, **kw)
    if source.startswith("builtin:"):
        model = get_model_config(source.split(":", 1)[1])
        return MLAPrefill(model, cache, weight(model), layer=1, **kw)
    raise AssertionError(source)


def batch_for(layer: MLAPrefill, ctx, qlens, seed: int = 0):
    """(q, kv_c_normed, k_pe, kv_cache, metadata, indexer inputs with an index cache in the layer's
    index_cache_dtype) of a random batch of `layer`'s model in its cache format."""
    batch = SyntheticBatch(layer.model, list(ctx), list(qlens), BLOCK, seed=seed)
    k_scale = torch.tensor([0.02]) if layer.spec.is_quantized else None
    cache = batch.fill_cache(layer, *batch.layer_context(layer.layer_index), k_scale)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, k_scale, block_size=BLOCK)
    return batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, index_inputs(layer, batch, cache.shape[0], seed)


def index_inputs(layer: MLAPrefill, batch: SyntheticBatch, num_blocks: int, seed: int) -> IndexInputs:
    """Random indexer inputs of the new tokens and an index cache holding the context's keys at the
    same slots as the latent rows (batch.slots)."""
    gen = torch.Generator().manual_seed(100 + seed)
    T, H, D = sum(batch.q_lens), layer.sparse.index_n_heads, layer.sparse.index_head_dim
    fmt = layer.sparse.index_cache_dtype
    cache = get_index_format(fmt).empty(num_blocks, BLOCK, D, D).zero_()
    n_ctx = sum(batch.ctx_lens)
    if n_ctx:
        write_index_cache(torch.randn(n_ctx, D, generator=gen), cache, torch.cat(batch.slots), fmt)
    return IndexInputs(torch.randn(T, H, D, generator=gen), torch.rand(T, H, generator=gen),
                       torch.randn(T, D, generator=gen), cache)
