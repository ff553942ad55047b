"""What a layer's resolved backends are keyed on, per cache format, weight format and context path:
each is resolved once per batch and gives bitwise the per-call dispatch answer; layers that differ
in any fact their choices depend on never share a record; forcing any of the layer's dispatchers
makes a new record (never a stale choice)."""
import math

import pytest
import torch

from mla_ext.config.models import MLAModelConfig
from mla_ext.config.policy import CacheConfig
from mla_ext.kv_b_proj import weights as W
from mla_ext.prefill import backends as planned
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.synthetic import SyntheticBatch

# P + V = 128 per head, 2 heads: N = 256 rows, K = L = 512 (every weight format packs this).
MODEL = MLAModelConfig("keys", L=512, R=64, P=64, V=64, num_heads=2, num_layers=4, max_model_len=256,
                       model_dtype=torch.bfloat16)
CTX, QLENS, BLOCK = [40, 0, 9, 33], [3, 2, 4, 1], 16


def _weight(kind: str, seed: int) -> W.WeightFormat:
    w = torch.randn(MODEL.num_heads * (MODEL.P + MODEL.V), MODEL.L,
                    generator=torch.Generator().manual_seed(seed)) / math.sqrt(MODEL.L)
    bf16 = torch.bfloat16
    return {
        "dense": lambda: W.DenseWeight.from_dense(w, bf16),
        "fp8_tensor": lambda: W.Fp8Weight.from_dense(w, per_channel=False, params_dtype=bf16),
        "fp8_channel": lambda: W.Fp8Weight.from_dense(w, per_channel=True, params_dtype=bf16),
        "fp8_block": lambda: W.Fp8BlockWeight.from_dense(w, bf16),
        "marlin_fp8": lambda: W.MarlinFp8Weight.from_dense(w, bf16),
        "nvfp4": lambda: W.Nvfp4Weight.from_dense(w, bf16),
        "int4_groups": lambda: W.Int4GroupWeight.from_dense(w, 128, bf16),
    }[kind]()


def _layer(index: int, fmt: str = "fp8", weight: str = "dense", mode: str = "up_project", rows: int = 32,
           skip=()) -> MLAPrefill:
    return MLAPrefill(MODEL, CacheConfig(fmt, tuple(skip), BLOCK), _weight(weight, 20 + index), layer=index,
                      workspace_rows_override=rows, context_attention=mode)


def _inputs(layers, seed=4):
    batch = SyntheticBatch(MODEL, CTX, QLENS, BLOCK, seed=seed)
    k_scale = torch.tensor([0.05], dtype=torch.float32)
    caches = [batch.fill_cache(layer, *batch.layer_context(layer.layer_index), k_scale) for layer in layers]
    return batch, caches, k_scale


def _forward(layers, batch, caches, meta):
    return [layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta) for layer, cache in zip(layers, caches)]


def _per_call(monkeypatch, layers, batch, caches, k_scale):
    monkeypatch.setattr(planned, "RESOLVE_ONCE", False)
    try:
        return _forward(layers, batch, caches, batch.metadata(k_scale))
    finally:
        monkeypatch.setattr(planned, "RESOLVE_ONCE", True)


def _check_once_and_bitwise(resolutions, monkeypatch, layers, n_records):
    batch, caches, k_scale = _inputs(layers)
    meta = batch.metadata(k_scale)
    resolutions.clear()
    got = _forward(layers, batch, caches, meta)
    records = meta.resolved_backends()
    assert len(records) == n_records
    assert sum(resolutions.values()) == sum(len(r.sites) for r in records.values()), resolutions
    resolutions.clear()
    assert all(torch.equal(a, b) for a, b in zip(_forward(layers, batch, caches, meta), got))
    assert sum(resolutions.values()) == 0  # the batch's second pass resolves nothing
    for a, b in zip(got, _per_call(monkeypatch, layers, batch, caches, k_scale)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["up_project", "absorbed"])
@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_each_cache_format_resolves_once_and_matches_per_call(resolutions, monkeypatch, fmt, mode):
    layers = [_layer(1, fmt, mode=mode), _layer(2, fmt, mode=mode)]
    _check_once_and_bitwise(resolutions, monkeypatch, layers, n_records=1)


@pytest.mark.parametrize("weight", ["dense", "fp8_tensor", "fp8_channel", "fp8_block", "marlin_fp8", "nvfp4",
                                    "int4_groups"])
def test_each_weight_format_resolves_once_and_matches_per_call(resolutions, monkeypatch, weight):
    layers = [_layer(1, weight=weight), _layer(2, weight=weight)]
    _check_once_and_bitwise(resolutions, monkeypatch, layers, n_records=1)


@pytest.mark.parametrize("differ", ["cache_format", "skipped_layer", "weight_format", "context_path",
                                    "workspace_rows"])
def test_layers_that_differ_never_share_a_record(resolutions, monkeypatch, differ):
    second = {
        "cache_format": lambda: _layer(2, "fp8_ds_mla"),
        "skipped_layer": lambda: _layer(2, skip=(2,)),  # native cache: another gather
        "weight_format": lambda: _layer(2, weight="fp8_block"),
        "context_path": lambda: _layer(2, mode="absorbed"),
        "workspace_rows": lambda: _layer(2, rows=64),  # another chunk plan
    }[differ]()
    _check_once_and_bitwise(resolutions, monkeypatch, [_layer(1), second], n_records=2)


@pytest.mark.parametrize("dispatcher", planned.LAYER_DISPATCHERS, ids=lambda d: d.op)
def test_forcing_any_layer_dispatcher_makes_a_new_key(dispatcher):
    layer = _layer(1)
    batch, (cache,), _ = _inputs([layer])
    key = planned.layer_key(layer, batch.q, batch.kv_c_new, batch.k_pe_new, cache, None)
    with dispatcher.force(dispatcher.backends[-1].name):
        forced = planned.layer_key(layer, batch.q, batch.kv_c_new, batch.k_pe_new, cache, None)
    assert forced != key
    assert planned.layer_key(layer, batch.q, batch.kv_c_new, batch.k_pe_new, cache, None) == key
