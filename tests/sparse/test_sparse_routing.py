"""A sparse (DSA) layer is never silently dense: from every source (a given SparseConfig, its
model config, a built-in sparse model), MLAPrefill runs a batch past index_topk sparse (forward
with the indexer's inputs) or refuses it naming index_topk (forward without them,
forward_context, the vLLM and SGLang context hooks); within index_topk the dense answer is the
sparse one. The index cache's geometry is checked against the latent plan before it is read."""
from __future__ import annotations

import types

import pytest
import torch

from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.sparse import SparseConfig, sparse_forward
from mla_ext.sparse.index_cache import get_index_format
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK
from helpers.sparse_routing import (BUILTIN_SPARSE, PAST, SOURCES, SPARSE, SPARSE_TINY, TOPK, WITHIN, batch_for,
                                 model_config_says, sparse_layer, weight)


@pytest.mark.parametrize("source", SOURCES)
def test_past_index_topk_runs_sparse_or_is_refused_naming_it(source):
    layer = sparse_layer(source)
    assert layer.sparse.index_topk == TOPK
    q, kv_c, k_pe, cache, meta, ix = batch_for(layer, **PAST)
    with pytest.raises(ValueError, match=rf"index: layer 1 is sparse \(index_topk={TOPK}\)"):
        layer(q, kv_c, k_pe, cache, meta)
    with pytest.raises(ValueError, match=rf"metadata: layer 1 is sparse \(index_topk={TOPK}\) and request 0 has "
                                         r"12 context \+ 2 new tokens"):
        layer.forward_context(q, cache, meta)
    out = layer(q, kv_c, k_pe, cache, meta, index=ix)
    assert torch.isfinite(out).all() and layer.last_selection.shape == (sum(PAST["qlens"]), TOPK)


@pytest.mark.parametrize("source", SOURCES)
def test_within_index_topk_dense_is_the_sparse_answer(source):
    layer = sparse_layer(source)
    q, kv_c, k_pe, cache, meta, ix = batch_for(layer, **WITHIN)
    dense = MLAPrefill(SPARSE_TINY, CacheConfig("auto", block_size=BLOCK), weight(SPARSE_TINY), layer=1,
                       workspace_rows_override=32, max_num_seqs=8)
    assert dense.sparse is None
    o, lse = layer.forward_context(q, cache, meta)
    o_d, lse_d = dense.forward_context(q, cache, meta)
    assert torch.equal(o, o_d) and torch.equal(lse, lse_d)
    out = layer(q, kv_c, k_pe, cache, meta)  # no indexer inputs needed: nothing is dropped
    sparse = sparse_forward(layer, q, kv_c, k_pe, cache, meta, ix, None)
    assert rel_fro(out, sparse) <= 2e-2  # bf16, SPEC §9


def test_a_given_sparse_config_must_be_the_model_configs():
    with model_config_says(SPARSE_TINY, SPARSE):
        with pytest.raises(ValueError, match=r"sparse: index_topk=16 but the model config .* says index_topk=8"):
            MLAPrefill(SPARSE_TINY, CacheConfig(), weight(SPARSE_TINY), layer=1,
                       sparse=SparseConfig(16, SPARSE.index_n_heads, SPARSE.index_head_dim))
        layer = MLAPrefill(SPARSE_TINY, CacheConfig(), weight(SPARSE_TINY), layer=1,
                           sparse=SparseConfig(TOPK, SPARSE.index_n_heads, SPARSE.index_head_dim,
                                               index_cache_dtype="fp8"))
        assert layer.sparse.index_cache_dtype == "fp8"  # the cache format is the caller's choice
    with pytest.raises(ValueError, match="sparse: expected an mla_ext.prefill.sparse.SparseConfig"):
        MLAPrefill(SPARSE_TINY, CacheConfig(), weight(SPARSE_TINY), layer=1, sparse={"index_topk": 8})


@pytest.mark.parametrize("name", BUILTIN_SPARSE)
def test_builtin_sparse_models_are_sparse(name):
    """deepseek-v3.2 and glm-5 as get_model_config reads them: a layer built from the config alone is
    sparse with the model's index_topk and refuses a dense answer past it."""
    from mla_ext.config.models import get_model_config

    cfg = SparseConfig.from_config(get_model_config(name))
    if cfg is None:
        pytest.skip(f"the config reader gives {name} no SparseConfig yet")
    layer = sparse_layer(f"builtin:{name}", workspace_rows_override=4096)
    assert layer.sparse.index_topk == cfg.index_topk == 2048
    m = layer.model
    n_blocks = -(-2050 // BLOCK)
    from mla_ext.prefill.layer import PrefillMetadata

    table = torch.arange(n_blocks, dtype=torch.int32)[None]
    meta = PrefillMetadata(table, [2049], [1], block_size=BLOCK)
    cache = torch.zeros(layer.spec.cache_shape(n_blocks), dtype=layer.spec.storage_dtype)
    q = torch.zeros(1, m.num_heads, m.P + m.R, dtype=m.model_dtype)
    with pytest.raises(ValueError, match="index_topk=2048"):
        layer.forward_context(q, cache, meta)
    with pytest.raises(ValueError, match="index_topk=2048"):
        layer(q, torch.zeros(1, m.L, dtype=m.model_dtype), torch.zeros(1, m.R, dtype=m.model_dtype), cache, meta)


def _bad_index_caches(nb):
    f32 = get_index_format("float32")
    D = SPARSE.index_head_dim
    return {
        "page_size": (f32.empty(nb, BLOCK // 2, D), r"pages of 8 tokens, but the latent cache's block_size is 16"),
        "width": (f32.empty(nb, BLOCK, D + 4), r"rows of 20 torch.float32 elements, expected 16"),
        "dtype": (get_index_format("bfloat16").empty(nb, BLOCK, D), r"expected a 3-D torch.float32 tensor"),
        "blocks": (f32.empty(nb - 1, BLOCK, D), r"blocks, fewer than the latent cache's"),
        "not_a_tensor": ([[0.0]], r"expected a paged index cache tensor"),
    }


@pytest.mark.parametrize("what", ["page_size", "width", "dtype", "blocks", "not_a_tensor"])
def test_index_cache_geometry_is_checked_against_the_latent_plan(what):
    layer = sparse_layer("given")
    q, kv_c, k_pe, cache, meta, ix = batch_for(layer, **PAST)
    bad, msg = _bad_index_caches(cache.shape[0])[what]
    with pytest.raises(ValueError, match=r"index_cache: .*" + msg):
        layer.prepare(cache, index_cache=bad, warm=False)
    with pytest.raises(ValueError, match=r"index_cache: .*" + msg):
        layer.check_index_cache(bad, cache)
    ix.cache = bad
    with pytest.raises(ValueError, match=r"index\.cache: .*" + msg):
        layer(q, kv_c, k_pe, cache, meta, index=ix)


def test_index_cache_geometry_fp8_and_dense_layers():
    layer = sparse_layer("given")
    fp8 = SparseConfig(TOPK, SPARSE.index_n_heads, SPARSE.index_head_dim, index_cache_dtype="fp8")
    fp8_layer = MLAPrefill(SPARSE_TINY, CacheConfig(block_size=BLOCK), weight(SPARSE_TINY), layer=1, sparse=fp8)
    fmt = get_index_format("fp8")
    fp8_layer.check_index_cache(fmt.empty(4, BLOCK, 16, 16))  # one scale per token
    fp8_layer.check_index_cache(fmt.empty(4, BLOCK, 16, 4))  # four
    with pytest.raises(ValueError, match=r"index_cache: rows of 17 torch.uint8 elements"):
        fp8_layer.check_index_cache(torch.empty(4, BLOCK, 17, dtype=torch.uint8))
    dense = MLAPrefill(SPARSE_TINY, CacheConfig(block_size=BLOCK), weight(SPARSE_TINY), layer=1)
    with pytest.raises(ValueError, match="index_cache: layer 1 is dense"):
        dense.check_index_cache(get_index_format("float32").empty(4, BLOCK, 16))
    assert layer.prepare(torch.zeros(layer.spec.cache_shape(4), dtype=layer.spec.storage_dtype),
                         index_cache=get_index_format("float32").empty(4, BLOCK, 16), warm=False) is layer


# -- the serving-engine hooks ---------------------------------------------------------------------

def _vllm_metadata(ctx, qlens, topk=TOPK):
    prefill = types.SimpleNamespace(chunked_context=types.SimpleNamespace(context_lens_list=list(ctx)),
                                    query_lens_cpu=torch.tensor(qlens))
    return types.SimpleNamespace(topk_tokens=topk, prefill=prefill)


def test_vllm_context_hook_leaves_sparse_impls_past_index_topk_to_vllm(monkeypatch):
    from mla_ext.vllm import absorbed_context as AC

    monkeypatch.setenv(AC.CONTEXT_ENV, "absorbed")
    sparse_impl = types.SimpleNamespace(is_sparse=True)
    assert "index_topk=8" in AC.sparse_refusal(sparse_impl, _vllm_metadata(**PAST))
    assert AC.sparse_refusal(sparse_impl, _vllm_metadata(**WITHIN)) is None
    assert AC.sparse_refusal(types.SimpleNamespace(), _vllm_metadata(**PAST)) is None  # a dense impl
    unknown = _vllm_metadata(**WITHIN, topk=None)
    assert "index_topk is not known" in AC.sparse_refusal(sparse_impl, unknown)

    class Impl:  # vLLM's _compute_prefill_context contract; the wrapper must pass attn_metadata on
        is_sparse = True

        def _compute_prefill_context(self, q, kv_cache, attn_metadata, k_scale):
            return "vllm's own"

    assert AC.install(Impl)
    impl = Impl()
    md = _vllm_metadata(**PAST)
    assert impl._compute_prefill_context(torch.zeros(5, 2, 8), torch.zeros(1), md, None) == "vllm's own"
    assert impl._mla_ext_last_context_path == "vllm"
    path, why = AC.choose(impl, torch.zeros(5, 2, 8), torch.zeros(1), md.prefill, md)
    assert path == "vllm" and "index_topk=8" in why


def test_sglang_context_hook_serves_dsa_layers_only_within_index_topk():
    from mla_ext.sglang import chunked_prefix as CP
    from mla_ext.sglang.pool_view import Unsupported

    indexer = types.SimpleNamespace(index_topk=TOPK, n_heads=SPARSE.index_n_heads, head_dim=SPARSE.index_head_dim)
    attn = types.SimpleNamespace(use_dsa=True, indexer=indexer)
    with pytest.raises(Unsupported, match="index_topk=8"):
        CP.dsa_refusal(attn, PAST["ctx"], PAST["qlens"])
    CP.dsa_refusal(attn, WITHIN["ctx"], WITHIN["qlens"])
    CP.dsa_refusal(types.SimpleNamespace(use_dsa=False), PAST["ctx"], PAST["qlens"])  # dense: nothing to refuse
    with pytest.raises(Unsupported, match="index_topk is not known"):
        CP.dsa_refusal(types.SimpleNamespace(use_dsa=True, indexer=None), WITHIN["ctx"], WITHIN["qlens"])
    assert CP._sparse_of(attn) == SparseConfig(TOPK, SPARSE.index_n_heads, SPARSE.index_head_dim)
