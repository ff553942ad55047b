"""Built-in MLA model configs and the HF config.json reader."""
import json

import pytest
import torch

from mla_ext.config.models import (
    BUILTIN_MODELS,
    MLAModelConfig,
    get_model_config,
    known_model_names,
    load_hf_config,
)

# A trimmed DeepSeek-V3 config.json with the fields the reader needs.
V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 163840,
}


def write(tmp_path, doc, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


@pytest.mark.parametrize(
    "name,L,R,P,V,heads,layers",
    [
        ("deepseek-v2-lite", 512, 64, 128, 128, 16, 27),
        ("deepseek-v3", 512, 64, 128, 128, 128, 61),
        ("deepseek-r1", 512, 64, 128, 128, 128, 61),
        ("kimi-k2", 512, 64, 128, 128, 64, 61),
    ],
)
def test_builtin_dims(name, L, R, P, V, heads, layers):
    m = get_model_config(name)
    assert (m.L, m.R, m.P, m.V, m.num_heads, m.num_layers) == (L, R, P, V, heads, layers)
    assert m.E == L + R
    assert m.model_dtype == torch.bfloat16
    assert m.sliding_window_layers == frozenset()


@pytest.mark.parametrize("spelling", ["DeepSeek-V3", "deepseek_v3", " deepseek-v3 "])
def test_name_spellings(spelling):
    assert get_model_config(spelling) is BUILTIN_MODELS["deepseek-v3"]


def test_unknown_name_lists_known_models():
    with pytest.raises(ValueError) as e:
        get_model_config("deepseek-v9")
    for name in known_model_names():
        assert name in str(e.value)
    assert "deepseek-v9" in str(e.value)


def test_non_string_model():
    with pytest.raises(ValueError, match="model"):
        get_model_config(3)


def test_hf_config_file_and_directory(tmp_path):
    path = write(tmp_path, V3_JSON)
    for arg in (path, str(path), tmp_path, str(tmp_path)):
        m = get_model_config(arg)
        assert (m.L, m.R, m.P, m.V, m.num_heads, m.num_layers) == (512, 64, 128, 128, 128, 61)
        assert m.max_model_len == 163840 and m.model_dtype == torch.bfloat16
        assert m.name == str(path)


@pytest.mark.parametrize("key,value,dtype", [
    ("torch_dtype", "float16", torch.float16),
    ("torch_dtype", "float32", torch.float32),
    ("torch_dtype", "torch.bfloat16", torch.bfloat16),
    ("dtype", "float16", torch.float16),  # newer transformers spell it `dtype`
])
def test_hf_dtype(tmp_path, key, value, dtype):
    doc = {k: v for k, v in V3_JSON.items() if k != "torch_dtype"}
    doc[key] = value
    assert load_hf_config(write(tmp_path, doc)).model_dtype == dtype


def test_hf_dtype_defaults_to_bf16(tmp_path):
    doc = {k: v for k, v in V3_JSON.items() if k != "torch_dtype"}
    assert load_hf_config(write(tmp_path, doc)).model_dtype == torch.bfloat16


def test_hf_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="torch_dtype.*int8"):
        load_hf_config(write(tmp_path, {**V3_JSON, "torch_dtype": "int8"}))


def test_hf_missing_keys_are_all_named(tmp_path):
    doc = {k: v for k, v in V3_JSON.items() if k not in ("kv_lora_rank", "v_head_dim")}
    with pytest.raises(ValueError) as e:
        load_hf_config(write(tmp_path, doc))
    msg = str(e.value)
    assert "kv_lora_rank" in msg and "v_head_dim" in msg and "config.json" in msg


def test_hf_null_kv_lora_rank(tmp_path):
    with pytest.raises(ValueError, match="kv_lora_rank"):
        load_hf_config(write(tmp_path, {**V3_JSON, "kv_lora_rank": None}))


@pytest.mark.parametrize("value", [512.0, "512", True])
def test_hf_non_integer_dim(tmp_path, value):
    with pytest.raises(ValueError, match="kv_lora_rank"):
        load_hf_config(write(tmp_path, {**V3_JSON, "kv_lora_rank": value}))


def test_hf_not_json(tmp_path):
    with pytest.raises(ValueError, match="cannot read JSON"):
        load_hf_config(write(tmp_path, "{not json"))
    with pytest.raises(ValueError, match="JSON object"):
        load_hf_config(write(tmp_path, "[1, 2]"))


def test_hf_text_config_nesting(tmp_path):
    doc = {"architectures": ["KimiVL"], "text_config": {**V3_JSON, "num_attention_heads": 64}}
    assert load_hf_config(write(tmp_path, doc)).num_heads == 64


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="neither a known model"):
        get_model_config(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="neither a known model"):
        get_model_config(str(tmp_path))  # a directory without config.json


N = 8


@pytest.mark.parametrize("extra,expect", [
    ({"layer_types": ["sliding_attention", "full_attention"] * 4}, {0, 2, 4, 6}),
    ({"sliding_window": 4096}, set(range(N))),
    ({"sliding_window": 4096, "use_sliding_window": False}, set()),
    ({"sliding_window": None, "max_window_layers": 2}, set()),
    ({"sliding_window": 4096, "max_window_layers": 5}, {5, 6, 7}),
    ({"sliding_window": 4096, "max_window_layers": 99}, set()),
    ({"sliding_window": 4096, "sliding_window_pattern": 4}, {0, 1, 2, 4, 5, 6}),
])
def test_hf_sliding_window_layers(tmp_path, extra, expect):
    doc = {**V3_JSON, "num_hidden_layers": N, **extra}
    assert load_hf_config(write(tmp_path, doc)).sliding_window_layers == frozenset(expect)


@pytest.mark.parametrize("extra,match", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"layer_types": "sliding_attention"}, "layer_types"),
    ({"sliding_window": 4096, "max_window_layers": -1}, "max_window_layers"),
    ({"sliding_window": 4096, "sliding_window_pattern": 0}, "sliding_window_pattern"),
])
def test_hf_bad_sliding_window_fields(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        load_hf_config(write(tmp_path, {**V3_JSON, "num_hidden_layers": N, **extra}))


@pytest.mark.parametrize("kwargs,match", [
    (dict(L=0), "L must be"),
    (dict(R=-1), "R must be"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_heads=2.0), "num_heads"),
    (dict(model_dtype=torch.int8), "model_dtype"),
    (dict(sliding_window_layers={4}), "sliding_window_layers"),
    (dict(sliding_window_layers={-1}), "sliding_window_layers"),
])
def test_config_validation(kwargs, match):
    base = dict(name="m", L=64, R=16, P=32, V=32, num_heads=2, num_layers=4)
    with pytest.raises(ValueError, match=match):
        MLAModelConfig(**{**base, **kwargs})


def test_config_is_frozen_and_hashable():
    m = MLAModelConfig("m", L=64, R=0, P=32, V=32, num_heads=2, num_layers=4,
                       sliding_window_layers=[1, 3])
    assert m.sliding_window_layers == frozenset({1, 3})
    hash(m)
    with pytest.raises(Exception):
        m.L = 1
