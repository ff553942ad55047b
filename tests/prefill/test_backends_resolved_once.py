"""MLAPrefill resolves each op's backend once per (layer key, batch plan): the first forward of a
batch runs every call site's dispatcher once, later layers with the same spec and later calls of
the batch run none, the outputs are bitwise those of the per-call dispatch path, and a forced
backend (Dispatcher.force, MLA_EXT_FORCE_<OP>) still wins."""
import math

import pytest
import torch

from mla_ext.attention.api import MERGE
from mla_ext.config.models import MLAModelConfig
from mla_ext.config.policy import CacheConfig
from mla_ext.kv_b_proj.weights import DenseWeight
from mla_ext.prefill import backends as planned
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.synthetic import SyntheticBatch

MODEL = MLAModelConfig("t", L=512, R=64, P=32, V=16, num_heads=2, num_layers=3, max_model_len=256,
                       model_dtype=torch.bfloat16)


def _layer(index: int, context_attention: str, seed: int) -> MLAPrefill:
    w = torch.randn(MODEL.num_heads * (MODEL.P + MODEL.V), MODEL.L,
                    generator=torch.Generator().manual_seed(seed)) / math.sqrt(MODEL.L)
    return MLAPrefill(MODEL, CacheConfig("fp8", (), 16), DenseWeight(w.to(torch.bfloat16)), layer=index,
                      workspace_rows_override=32, context_attention=context_attention)


def _setup(context_attention: str):
    layers = [_layer(i, context_attention, seed=10 + i) for i in range(2)]
    batch = SyntheticBatch(MODEL, [50, 0, 9, 40], [4, 2, 3, 1], 16, seed=3)
    k_scale = torch.tensor([0.05], dtype=torch.float32)
    caches = [batch.fill_cache(layer, *batch.layer_context(i), k_scale) for i, layer in enumerate(layers)]
    return layers, batch, caches, k_scale


def _run(layers, batch, caches, meta, k_scale):
    return [layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, k_scale=k_scale)
            for layer, cache in zip(layers, caches)]


@pytest.mark.parametrize("context_attention", ["up_project", "absorbed", "auto"])
def test_each_op_resolved_once_per_layer_key_and_batch(resolutions, monkeypatch, context_attention):
    layers, batch, caches, k_scale = _setup(context_attention)
    meta = batch.metadata(k_scale)
    assert meta.plan(layers[0].workspace_rows, layers[0].chunk_alignment).num_chunks >= 2
    resolutions.clear()  # the cache writes of the setup

    out = [layers[0](batch.q, batch.kv_c_new, batch.k_pe_new, caches[0], meta)]
    first = dict(resolutions)
    (record,) = meta.resolved_backends().values()
    # One resolution per call site (the new tokens' ops and each chunk's), none twice.
    assert sum(first.values()) == len(record.sites) > 0
    assert all(c.backend is not None for c in record.sites.values())

    resolutions.clear()
    out.append(layers[1](batch.q, batch.kv_c_new, batch.k_pe_new, caches[1], meta))
    again = layers[0](batch.q, batch.kv_c_new, batch.k_pe_new, caches[0], meta)
    assert sum(resolutions.values()) == 0, resolutions  # same spec, same batch: nothing resolved again
    assert len(meta.resolved_backends()) == 1
    assert torch.equal(again, out[0])

    # Bitwise what every op call dispatching on its own gives.
    monkeypatch.setattr(planned, "RESOLVE_ONCE", False)
    want = _run(layers, batch, caches, batch.metadata(k_scale), k_scale)
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


def test_a_new_batch_resolves_again_and_explain_shows_the_choice(resolutions):
    layers, batch, caches, k_scale = _setup("up_project")
    meta = batch.metadata(k_scale)
    assert "not resolved for this batch yet" in layers[0].explain_context(meta)
    resolutions.clear()  # the cache writes of the setup
    _run(layers, batch, caches, meta, k_scale)
    n = sum(resolutions.values())
    text = layers[1].explain_context(meta)
    assert "backends resolved for this batch" in text and "attention[new] = " in text
    assert "gather[chunk 1] = cpu" in text
    _run(layers, batch, caches, batch.metadata(k_scale), k_scale)  # a new batch plan
    assert sum(resolutions.values()) == 2 * n


def test_forced_backend_still_wins(resolutions, monkeypatch):
    layers, batch, caches, k_scale = _setup("up_project")
    meta = batch.metadata(k_scale)
    plain = _run(layers, batch, caches, meta, k_scale)
    chosen = {k: c.backend.name for k, c in next(iter(meta.resolved_backends().values())).sites.items()}
    assert chosen[("merge", "new")] == "cpu"

    with MERGE.force("torch"):
        forced = _run(layers, batch, caches, meta, k_scale)
    records = list(meta.resolved_backends().values())
    assert len(records) == 2  # the forced state is part of the key: a new record, not the stale one
    assert {c.backend.name for k, c in records[1].sites.items() if k[0] == "merge"} == {"torch"}

    monkeypatch.setenv("MLA_EXT_FORCE_MERGE", "torch")
    by_env = _run(layers, batch, caches, meta, k_scale)
    monkeypatch.setattr(planned, "RESOLVE_ONCE", False)
    want = _run(layers, batch, caches, batch.metadata(k_scale), k_scale)
    for a, b, c in zip(forced, by_env, want):
        assert torch.equal(a, c) and torch.equal(b, c)
    monkeypatch.delenv("MLA_EXT_FORCE_MERGE")
    monkeypatch.setattr(planned, "RESOLVE_ONCE", True)
    # Back to the stated order: the first record again, still equal to the first outputs.
    resolutions.clear()
    for a, b in zip(_run(layers, batch, caches, meta, k_scale), plain):
        assert torch.equal(a, b)
    assert sum(resolutions.values()) == 0


def test_public_ops_still_dispatch_per_call(resolutions):
    layers, batch, caches, k_scale = _setup("up_project")
    x = batch.kv_c_new.to(layers[0].kv_b_proj.params_dtype)
    resolutions.clear()
    for _ in range(2):
        layers[0].kv_b_proj(x)
    assert resolutions["kv_b_proj"] == 2


def test_sparse_path_resolves_each_op_once_per_batch(resolutions, monkeypatch):
    """A sparse (DSA) layer past index_topk: the index gather (one per request and key chunk) and the
    sparse latent attention are each resolved once for the batch, not per chunk or per layer."""
    from dataclasses import replace

    from helpers.prefill import BLOCK
    from helpers.sparse_routing import SPARSE, SPARSE_TINY, batch_for, past, weight

    cfg = replace(SPARSE, chunk=4)  # several key chunks, so several index gathers per request
    layers = [MLAPrefill(SPARSE_TINY, CacheConfig("auto", block_size=BLOCK), weight(SPARSE_TINY, seed=i), layer=1,
                         sparse=cfg, workspace_rows_override=32, max_num_seqs=8) for i in range(2)]
    q, kv_c, k_pe, cache, meta, index = batch_for(layers[0], **past(cfg.index_topk))
    assert cfg.drops(meta.context_lens, meta.query_lens)
    resolutions.clear()
    first = layers[0](q, kv_c, k_pe, cache, meta, index=index)
    assert resolutions["index_gather"] == 1 and resolutions["sparse_latent_attention"] == 1, resolutions
    resolutions.clear()
    layers[1](q, kv_c, k_pe, cache, meta, index=index)
    assert sum(resolutions.values()) == 0, resolutions  # same spec, same batch
    (record,) = meta.resolved_backends().values()
    assert {op for op, _ in record.sites} == {"index_gather", "sparse_attention"}
    assert record.values[("indexer", "new")] == "torch"

    monkeypatch.setattr(planned, "RESOLVE_ONCE", False)
    again = layers[0](q, kv_c, k_pe, cache, batch_for(layers[0], **past(cfg.index_topk))[4], index=index)
    assert torch.equal(again, first)
