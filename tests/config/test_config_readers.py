"""The two config readers agree with each other and with transformers, for every family.

The same raw config goes three ways: mla_ext with transformers (mla_ext.config.hf_reader: the
family's own config class), mla_ext without it (mla_ext.config.dict_reader, forced with
`transformers_reader(False)`), and transformers itself (its config class, then the
attention module built tiny for each MLA layer). All three must give the same layer set,
dims, rope/no-rope, sliding layers, KV sharing, DSA fields and softmax scale (the module's
`scaling`), on seeded random configs in the spellings and defaults published checkpoints
use (tests/helpers/config_variants.py) and on the built-in configs.
"""
from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test dependency")

from transformers import CONFIG_MAPPING  # noqa: E402

from helpers.config_variants import random_config  # noqa: E402
from mla_ext.config.hf_reader import set_transformers_reader, transformers_reader, transformers_reader_enabled  # noqa: E402
from mla_ext.config.families import FAMILIES  # noqa: E402
from mla_ext.config.models import _BUILTIN_JSON, BUILTIN_MODELS, config_from_dict, config_from_hf  # noqa: E402
from mla_ext.config.models import get_model_config  # noqa: E402

SEEDS = range(8)


def facts(m) -> dict:
    """What a model config says per layer (what the plan, the layer and the kernels use)."""
    out = {"num_layers": m.num_layers, "non_mla": sorted(m.non_mla_layers),
           "sliding": sorted(m.sliding_window_layers), "kv_source": dict(m.kv_source_layers),
           "max_model_len": m.max_model_len, "sparse": m.sparse, "sparse_layers": sorted(m.sparse_layers)}
    for i in range(m.num_layers):
        if i not in m.non_mla_layers:
            f = m.for_layer(i)
            out[i] = (f.L, f.R, f.P, f.V, f.num_heads, f.softmax_scale, f.sparse is not None)
    return out


def _text_class(model_type: str):
    cls = CONFIG_MAPPING[model_type]
    return (getattr(cls, "sub_configs", None) or {}).get("text_config") or cls


def transformers_config(raw: dict):
    """The config transformers itself makes of `raw` (its text config)."""
    top = raw.get("model_type")
    if "text_config" in raw:  # the multimodal config builds its text config from this dict
        d = raw["text_config"]
        return _text_class(top if top in CONFIG_MAPPING else d["model_type"]).from_dict(dict(d))
    return _text_class(raw["model_type"]).from_dict(dict(raw))


def check_against_transformers(family: str, raw: dict, model) -> None:
    """The model config against transformers' config object and each MLA layer's module."""
    cfg = transformers_config(raw)
    cfg._attn_implementation = "eager"
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    assert model.num_layers == n
    assert model.non_mla_layers == {i for i, t in enumerate(types) if t == "linear_attention"}
    assert model.sliding_window_layers == {i for i, t in enumerate(types) if t == "sliding_attention"}
    f = FAMILIES[family]
    lib = importlib.import_module(f"transformers.models.{f.module}.modeling_{f.module}")
    for i in range(n):
        if i in model.non_mla_layers:
            continue
        with torch.device("meta"):  # only its attributes are read: no weights (real dims are large)
            module = getattr(lib, f.attention)(cfg, layer_idx=i)
        ours = model.for_layer(i)
        assert ours.softmax_scale == pytest.approx(module.scaling, rel=1e-12), (i, ours.softmax_scale_source)
        P, R = module.qk_nope_head_dim, module.qk_rope_head_dim
        if not getattr(module, "use_rope", True):  # mistral_large4's no-rope layer
            P, R = P + R, 0
        assert (ours.L, ours.R, ours.P, ours.V, ours.num_heads) == (
            module.kv_lora_rank, R, P, module.v_head_dim, module.num_heads), i
        assert (ours.sparse is not None) == (getattr(module, "indexer", None) is not None
                                             or getattr(module, "skip_topk", False)), i
        if ours.sparse is not None:
            assert (ours.sparse.index_topk, ours.sparse.index_n_heads, ours.sparse.index_head_dim) == (
                cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim)
    sources = getattr(cfg, "kv_source_layers", None) if f.reads_kv_source_layers else None
    assert dict(model.kv_source_layers) == {i: j for i, j in enumerate(sources or ()) if j != i}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_configs_read_the_same_three_ways(family):
    for seed in SEEDS:
        raw = random_config(family, seed)
        with transformers_reader(True):
            theirs = config_from_dict(raw, f"{family}/{seed}")
        with transformers_reader(False):
            ours = config_from_dict(raw, f"{family}/{seed}")
        assert theirs.reader.startswith("transformers") and ours.reader.startswith("mla_ext"), raw
        assert facts(ours) == facts(theirs), (seed, raw)
        check_against_transformers(family, raw, theirs)


@pytest.mark.parametrize("name", sorted(_BUILTIN_JSON))
def test_builtin_configs_read_the_same_three_ways(name):
    raw = _BUILTIN_JSON[name]
    with transformers_reader(False):
        ours = config_from_dict(raw, name)
    assert facts(ours) == facts(get_model_config(name))
    family = raw["model_type"].removesuffix("_text")
    check_against_transformers(family, raw, get_model_config(name))


def test_every_family_has_a_builtin_read_by_transformers():
    read = {b.reader for b in BUILTIN_MODELS.values()}
    assert all(r.startswith("transformers") for r in read), read
    families = {_BUILTIN_JSON[n]["model_type"].removesuffix("_text") for n in _BUILTIN_JSON}
    assert families == set(FAMILIES)


def test_a_transformers_config_object_reads_as_its_dict():
    for family in sorted(FAMILIES):
        raw = random_config(family, 0)
        cfg = transformers_config(raw)
        assert facts(config_from_hf(cfg, family)) == facts(config_from_dict(raw, family)), family
        assert facts(config_from_dict(cfg, family)) == facts(config_from_dict(cfg.to_dict(), family)), family


def test_the_reader_switch():
    assert transformers_reader_enabled()  # transformers is installed here
    with transformers_reader(False):
        assert not transformers_reader_enabled()
        assert config_from_dict(_BUILTIN_JSON["glm-5"], "g").reader == "mla_ext's config reader"
    assert transformers_reader_enabled()
    with pytest.raises(ValueError, match="enabled"):
        set_transformers_reader("yes")


def tiny(family: str, **kw) -> dict:
    """A small raw config of `family` (4 layers unless `num_hidden_layers` says otherwise)."""
    return {"model_type": family, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
            "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "q_lora_rank": 48, "num_hidden_layers": 4, "max_position_embeddings": 4096, **kw}


# The spellings and defaults the readers once read differently from transformers, each
# pinned (both readers, so the fallback cannot drift either).
SPELLINGS = {
    # kimi_linear's checkpoint: 1-based layer numbers under linear_attn_config.
    "kimi_linear": ({"linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3, 5, 6, 7, 8]}},
                    dict(non_mla=[0, 2, 4, 5, 6, 7])),
    "kimi_linear/default": ({}, dict(non_mla=[0, 1, 2, 3, 5, 6, 7])),  # full every 4th from layer 4
    "bailing_hybrid": ({"layer_group_size": 3}, dict(non_mla=[0, 1, 3, 4, 6, 7])),
    "glm5_next": ({"qk_rope_head_dim": 0, "index_kpool": 4}, dict(non_mla=[0, 1, 2, 4, 5, 6])),
    "mistral_large4": ({}, dict(no_rope=[3, 7])),  # every 4th layer has no rope by default
    "dots3_note": ({"sliding_window": 64, "head_dim": 48, "swa_kv_lora_rank": 96, "swa_num_attention_heads": 4,
                    "swa_num_key_value_heads": 4, "swa_head_dim": 48, "swa_qk_nope_head_dim": 32,
                    "swa_v_head_dim": 16}, dict(sliding=[2, 3, 4, 6, 7], sliding_L=96)),
    "longcat_flash": ({"num_layers": 4, "head_dim": 16}, dict(num_layers=8)),
}


@pytest.mark.parametrize("key", sorted(SPELLINGS))
@pytest.mark.parametrize("reader", [True, False], ids=["transformers", "fallback"])
def test_checkpoint_spellings_and_defaults(key, reader):
    family = key.split("/")[0]
    extra, want = SPELLINGS[key]
    raw = tiny(family, num_hidden_layers=8, **extra)
    if "num_layers" in extra:
        del raw["num_hidden_layers"]
    with transformers_reader(reader):
        m = config_from_dict(raw, key)
    if "non_mla" in want:
        assert sorted(m.non_mla_layers) == want["non_mla"]
    if "no_rope" in want:
        assert [i for i in range(8) if m.for_layer(i).R == 0] == want["no_rope"]
        assert m.for_layer(3).P == 48 and m.for_layer(3).softmax_scale == m.softmax_scale
    if "sliding" in want:
        assert sorted(m.sliding_window_layers) == want["sliding"]
        assert m.for_layer(2).L == want["sliding_L"] and m.for_layer(2).num_heads == 4
        assert m.for_layer(2).sparse is None and m.for_layer(0).sparse is not None  # no indexer on sliding
    if "num_layers" in want:
        assert m.num_layers == want["num_layers"] and m.attention_per_layer == 2


@pytest.mark.parametrize("reader", [True, False], ids=["transformers", "fallback"])
def test_mistral4_default_rope_is_its_yarn(reader):
    raw = tiny("mistral4")
    with transformers_reader(reader):
        m = config_from_dict(raw, "m4")
    m4 = 0.1 * __import__("math").log(128.0) + 1
    assert m.softmax_scale == pytest.approx(48 ** -0.5 * m4 * m4)


@pytest.mark.parametrize("reader", [True, False], ids=["transformers", "fallback"])
def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(reader):
    yarn = {"type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
    raw = {**_BUILTIN_JSON["youtu-llm-2b"], "rope_scaling": yarn}
    with transformers_reader(reader):
        m = config_from_dict(raw, "y")
    assert m.softmax_scale > 192 ** -0.5 * 1.5


@pytest.mark.parametrize("reader", [True, False], ids=["transformers", "fallback"])
def test_refusals_both_readers_share(reader):
    base = tiny("mistral_large4")
    with transformers_reader(reader):
        # transformers refuses a KV source after the layer, or one that reads another's KV.
        for src in ([0, 1, 3, 3], [0, 0, 1, 3]):
            with pytest.raises(ValueError, match="kv_source_layers"):
                config_from_dict({**base, "kv_source_layers": src}, "ml4")
        with pytest.raises(ValueError, match="num_hidden_layers.*even"):
            config_from_dict({**_BUILTIN_JSON["longcat-flash-chat"], "num_hidden_layers": 57}, "lc")
        with pytest.raises(ValueError, match="linear_attn_config.kda_layers"):
            config_from_dict({**{k: v for k, v in _BUILTIN_JSON["kimi-linear-48b-a3b"].items() if k != "layer_types"},
                              "linear_attn_config": {"full_attn_layers": [1], "kda_layers": [0]}}, "k")
        with pytest.raises(ValueError, match="rope_parameters is per layer type"):
            config_from_dict({**{k: v for k, v in _BUILTIN_JSON["deepseek-v3"].items() if k != "rope_scaling"},
                              "layer_types": ["full_attention"] * 61,
                              "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 40.0,
                                                                   "original_max_position_embeddings": 4096}}}, "v3")
