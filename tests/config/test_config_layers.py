"""What a config says about layers beyond their dims: LongCat-Flash's two MLA modules per
decoder layer, a sparse (DSA) model's SparseConfig from every config source, and KV
sharing between layers of other dims refused at planning."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mla_ext.config.hf_reader import transformers_reader
from mla_ext.config.models import _BUILTIN_JSON, LayerDims, MLAModelConfig, config_from_dict, get_model_config
from mla_ext.config.planner import plan_model, plan_pool
from mla_ext.config.policy import CacheConfig, resolve_layer, resolve_model
from mla_ext.prefill.sparse import SparseConfig

READERS = pytest.mark.parametrize("reader", [True, False], ids=["transformers", "fallback"])


@READERS
def test_longcat_plans_both_mla_sublayers_of_every_decoder_layer(reader):
    with transformers_reader(reader):
        model = config_from_dict(_BUILTIN_JSON["longcat-flash-chat"], "longcat")
    assert model.num_layers == 56 and model.attention_per_layer == 2  # 28 decoder layers x 2
    plan = plan_model(CacheConfig("auto", block_size=16), model, 1 << 30)
    assert [p.layer_index for p in plan.layers] == list(range(56))
    assert resolve_layer(CacheConfig("auto"), model, layer=55).layer_index == 55
    # vLLM's and transformers' module names: decoder layer d, attention module k -> 2*d + k.
    assert resolve_layer(CacheConfig("auto"), model, prefix="model.layers.27.self_attn.1").layer_index == 55
    assert resolve_layer(CacheConfig("auto"), model, prefix="model.layers.3.self_attn.0").layer_index == 6
    with pytest.raises(ValueError, match="attention module 2 of decoder layer 3"):
        resolve_layer(CacheConfig("auto"), model, prefix="model.layers.3.self_attn.2")
    with pytest.raises(ValueError, match="layer 56"):
        resolve_layer(CacheConfig("auto"), model, layer=56)


def test_longcat_layer_index_is_the_transformers_modules():
    pytest.importorskip("transformers")
    from transformers.models.longcat_flash import modeling_longcat_flash as lib

    from mla_ext.integrations.transformers_random import tiny_config

    cfg = tiny_config("longcat_flash", num_hidden_layers=6)  # 3 decoder layers
    model = config_from_dict(cfg, "tiny longcat")
    assert model.num_layers == 6
    with torch.device("meta"):
        for d in range(3):
            layer = lib.LongcatFlashDecoderLayer(cfg, d)
            assert [a.layer_idx for a in layer.self_attn] == [2 * d, 2 * d + 1]


def _sources(tmp_path):
    glm5 = _BUILTIN_JSON["glm-5"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(glm5))
    return {"name glm-5": "glm-5", "name deepseek-v3.2": "deepseek-v3.2", "path": str(path),
            "directory": str(tmp_path), "dict": glm5,
            "text_config": {"model_type": "some_vl", "architectures": ["X"], "text_config": glm5}}


@READERS
def test_a_sparse_model_carries_its_sparse_config_from_every_source(tmp_path, reader):
    with transformers_reader(reader):
        for what, source in _sources(tmp_path).items():
            model = get_model_config(source) if isinstance(source, str) else config_from_dict(source, what)
            assert model.sparse is not None, what
            assert model.sparse.index_topk == 2048 and model.sparse_layers, what
            assert model.for_layer(min(model.sparse_layers)).sparse == model.sparse, what
            assert SparseConfig.from_config(model) == model.sparse
            if not isinstance(source, str):
                assert SparseConfig.from_config(source) == model.sparse, what
    assert get_model_config("deepseek-v3.2").sparse.index_n_heads == 64
    assert get_model_config("deepseek-v3").sparse is None


def test_a_transformers_config_object_carries_its_sparse_config():
    pytest.importorskip("transformers")
    from mla_ext.integrations.transformers_random import tiny_config

    for family in ("deepseek_v32", "glm_moe_dsa", "dots3_note", "glm5_next", "mistral_large4", "hy_v4", "axk2"):
        cfg = tiny_config(family)
        model = config_from_dict(cfg, family)
        assert model.sparse is not None and model.sparse.index_topk == cfg.index_topk, family
        assert SparseConfig.from_config(cfg) == model.sparse, family
    assert config_from_dict(tiny_config("deepseek_v3"), "v3").sparse is None


@pytest.mark.parametrize("bad", [3, None, "glm-5", object(), [1, 2]])
def test_sparse_config_from_a_non_config_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"^config: expected a model config"):
        SparseConfig.from_config(bad)


def test_a_dense_family_stays_dense_whatever_keys_its_dict_has():
    raw = {**_BUILTIN_JSON["deepseek-v3"], "index_topk": 64, "index_n_heads": 2, "index_head_dim": 32}
    assert config_from_dict(raw, "v3").sparse is None  # DeepseekV3Attention has no indexer
    assert SparseConfig.from_config(raw) is None


def _shared(layer_dims):
    return MLAModelConfig("shared", L=64, R=16, P=32, V=32, num_heads=2, num_layers=4,
                          layer_dims=layer_dims, kv_source_layers={2: 0, 3: 1})


def test_kv_sharing_across_other_dims_is_refused_at_planning_naming_both_layers():
    ok = _shared({})
    assert [s.kv_source for s in resolve_model(CacheConfig("auto"), ok)] == [None, None, 0, 1]
    bad = _shared({3: LayerDims(32, 16, 32, 32, 2)})  # layer 3: L=32, its source layer 1: L=64
    with pytest.raises(ValueError, match=r"layer 3 of shared reads layer 1's KV cache .* L=32 R=16 differ "
                                         r"from layer 1's L=64 R=16"):
        plan_model(CacheConfig("auto"), bad, 1 << 24)
    no_rope = _shared({0: LayerDims(64, 0, 48, 32, 2)})  # a no-rope source, a rope reader
    with pytest.raises(ValueError, match="layer 2 of shared reads layer 0's KV cache"):
        resolve_layer(CacheConfig("auto"), no_rope, layer=2)


def test_plan_pool_refuses_a_kv_source_spec_of_other_dims():
    specs = list(resolve_model(CacheConfig("auto"), _shared({})))
    specs[2] = replace(specs[2], L=32, entry_elems=48, bytes_per_token=96)
    with pytest.raises(ValueError, match="layer_specs: layer 2 reads layer 0's KV cache"):
        plan_pool(specs, 1 << 24)


def test_without_transformers_every_builtin_reads_with_mla_ext_s_reader(monkeypatch):
    import mla_ext.config.hf_reader as hf

    monkeypatch.setattr(hf, "_AVAILABLE", False)  # as if transformers did not import
    monkeypatch.setattr(hf, "_FORCED", None)
    assert not hf.transformers_reader_enabled()
    with pytest.raises(ImportError, match="transformers cannot be imported"):
        hf.set_transformers_reader(True)
    models = {name: config_from_dict(raw, name) for name, raw in _BUILTIN_JSON.items()}
    assert {m.reader for m in models.values()} == {"mla_ext's config reader"}
    assert models["glm-5"].sparse is not None and models["longcat-flash-chat"].num_layers == 56
