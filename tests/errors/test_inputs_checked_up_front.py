"""Inputs that used to fail deep inside (a copy out of a meta tensor, a backend for no device, a
shape error in the indexer's scoring) are refused up front naming the argument: meta-device
inputs of the layer and the sparse ops, `sinks` on the meta device, an index cache whose width
or page size is not the layer's."""
from __future__ import annotations

import pytest
import torch

from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.sparse import index_cache as ic
from mla_ext.prefill.sparse import IndexInputs, SparseConfig
from mla_ext.sparse.topk import indexer_topk
from helpers.prefill import BLOCK, TINY, Batch, make_weight

META = torch.device("meta")
AUTO = CacheConfig(kv_cache_dtype="auto", block_size=BLOCK)
SPARSE = SparseConfig(index_topk=4, index_n_heads=2, index_head_dim=32)


def _layer(**kw):
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=torch.Generator().manual_seed(0)) / 32
    return MLAPrefill(TINY, AUTO, make_weight("dense", w), layer=1, **kw)


def _batch(layer):
    batch = Batch(ctx_lens=[8, 3], q_lens=[2, 3], seed=3)
    return batch, batch.fill_cache(layer, None), PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens)


def test_sinks_on_the_meta_device_are_refused_when_the_layer_is_built():
    with pytest.raises(ValueError, match=r"^sinks: a meta tensor \(shape only, no data\)"):
        _layer(sinks=torch.zeros(TINY.num_heads, device=META))


def test_a_forward_on_meta_tensors_is_refused_naming_q():
    layer = _layer()
    batch, cache, meta = _batch(layer)
    on_meta = PrefillMetadata(batch.block_table.to(META), batch.ctx_lens, batch.q_lens)
    with pytest.raises(ValueError, match=r"^q: a meta tensor"):
        layer(batch.q.to(META), batch.kv_c_new.to(META), batch.k_pe_new.to(META), cache.to(META), on_meta)
    with pytest.raises(ValueError, match=r"^q: a meta tensor"):
        layer.forward_context(batch.q.to(META), cache.to(META), on_meta)
    with pytest.raises(ValueError, match=r"^workspace: a meta tensor"):
        layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta,
              workspace=torch.empty(layer.workspace_rows, TINY.L + TINY.R, dtype=torch.bfloat16, device=META))


def _index_inputs(T, cache, D=32):
    g = torch.Generator().manual_seed(1)
    return IndexInputs(torch.randn(T, 2, D, generator=g), torch.randn(T, 2, generator=g), torch.randn(T, D, generator=g),
                       cache)


@pytest.mark.parametrize("case,match", [
    ("width", r"^index.cache: rows of 64 torch.bfloat16 elements, expected 32 \(index_head_dim\)"),
    ("block_size", r"^index.cache: pages of 8 tokens, but the latent cache's block_size is 16"),
    ("dtype", r"^index.cache: .*expected a 3-D torch.bfloat16 tensor"),
    ("meta", r"^index.cache: on meta, expected the latent cache's device cpu"),
])
def test_a_sparse_layer_refuses_an_index_cache_that_is_not_its_own(case, match):
    layer = _layer(sparse=SPARSE)
    batch, cache, meta = _batch(layer)
    nb = cache.shape[0]
    index_cache = {"width": torch.zeros(nb, BLOCK, 64, dtype=torch.bfloat16),
                   "block_size": torch.zeros(nb, BLOCK // 2, 32, dtype=torch.bfloat16),
                   "dtype": torch.zeros(nb, BLOCK, 32),
                   "meta": torch.zeros(nb, BLOCK, 32, dtype=torch.bfloat16, device=META)}[case]
    with pytest.raises(ValueError, match=match):
        layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, index=_index_inputs(5, index_cache))


def test_the_sparse_layer_still_runs_with_its_own_index_cache():
    layer = _layer(sparse=SPARSE)
    batch, cache, meta = _batch(layer)
    index_cache = ic.get_index_format("bfloat16").empty(cache.shape[0], BLOCK, 32).normal_()
    out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, index=_index_inputs(5, index_cache))
    assert out.shape == (5, TINY.num_heads, TINY.V) and torch.isfinite(out.float()).all()
    assert layer.last_selection.shape == (5, 4)


@pytest.mark.parametrize("fmt,width,match", [
    # One index-cache check serves the indexer and the layer's plan (the layer's messages).
    ("bfloat16", 16, r"index_cache: rows of 16 torch.bfloat16 elements, expected 32 \(index_head_dim\)"),
    ("fp8", 32 + 3, r"index_cache: rows of 35 torch.uint8 elements, expected index_head_dim \+ 4 \* index_head_dim / Q"),
])
def test_indexer_topk_refuses_an_index_cache_of_another_width(fmt, width, match):
    f = ic.get_index_format(fmt)
    cache = torch.zeros(3, 4, width, dtype=f.storage_dtype)
    g = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match=match):
        indexer_topk(torch.randn(2, 2, 32, generator=g), torch.randn(2, 2, generator=g),
                     torch.randn(2, 32, generator=g), cache, torch.zeros(1, 3, dtype=torch.int32), [2], [5], 4,
                     index_cache_dtype=fmt)


def test_the_sparse_ops_refuse_meta_tensors_naming_them():
    from mla_ext.sparse.sparse_attention import sparse_latent_attention

    cache = torch.zeros(2, 4, 32, dtype=torch.bfloat16, device=META)
    with pytest.raises(ValueError, match=r"^cache: a meta tensor"):
        ic.gather_index_keys(cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^k: a meta tensor"):
        ic.write_index_cache(torch.zeros(2, 32, device=META), cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^q_idx: a meta tensor"):
        indexer_topk(torch.zeros(2, 2, 32, device=META), torch.zeros(2, 2, device=META),
                     torch.zeros(2, 32, device=META), None, None, [2], [0], 4)
    m = lambda *s: torch.zeros(*s, device=META)  # noqa: E731
    with pytest.raises(ValueError, match=r"^q_lat: a meta tensor"):
        sparse_latent_attention(m(2, 3, 32), m(3, 2, 8), m(2, 4, 40), "auto", m(1, 1).int(), m(3, 2).int(),
                                m(3, 32), m(3, 8), None, 1.0, q_lens=[3], ctx_lens=[2])
