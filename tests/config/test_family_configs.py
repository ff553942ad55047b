"""Config spellings of every transformers MLA family, each
checked against transformers' own attention module: the softmax scale mla_ext
derives from `config.to_dict()` must be the module's `scaling`, per layer.

Spellings covered: `num_layers` (longcat_flash), `model_max_length` (kimi_linear,
bailing_hybrid), per-layer-type `rope_parameters` (dots3_note), `rope_type` and
`type`, yarn blocks in families whose attention applies the correction and in
those that never do (dots3_note, glm5_next, kimi_linear), text_config nesting,
per_layer_config (dots3_note), no_rope_layers and kv_source_layers
(mistral_large4). Also the built-in configs of each family's published model
against transformers' config-class defaults for it.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test dependency")

from mla_ext.config.builtin_configs import FAMILY_BUILTINS  # noqa: E402
from mla_ext.config.families import FAMILIES, family_name  # noqa: E402
from mla_ext.integrations.transformers_random import (config_class, random_family_attention,  # noqa: E402
                                                       tiny_config)
from mla_ext.config.models import config_from_dict, get_model_config  # noqa: E402
from mla_ext.config.planner import plan_model  # noqa: E402
from mla_ext.config.policy import CacheConfig  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1}
NO_YARN = {"dots3_note", "glm5_next", "kimi_linear"}


def _rope(family: str) -> dict:
    if family == "dots3_note":  # transformers 5 writes one rope dict per layer type here
        return {"indexed_attention": dict(YARN),
                "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}
    return YARN


CASES = [(f, i) for f in sorted(FAMILIES) for i in ((1, 2) if f == "dots3_note" else
                                                   (1, 3) if f == "mistral_large4" else (1,))]


@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
@pytest.mark.parametrize("family,layer", CASES, ids=[f"{f}-L{i}" for f, i in CASES])
def test_scale_and_dims_match_the_transformers_module(family, layer, yarn):
    cfg = tiny_config(family, **({"rope_parameters": _rope(family)} if yarn else {}))
    module = random_family_attention(family, layer_idx=layer, config=cfg)
    model = config_from_dict(cfg.to_dict(), name=family).for_layer(layer)
    assert model.softmax_scale == pytest.approx(module.scaling, rel=1e-12), model.softmax_scale_source
    assert (model.L, model.R, model.P, model.V, model.num_heads) == (
        module.kv_lora_rank, module.qk_rope_head_dim, module.qk_nope_head_dim,
        module.v_head_dim, module.num_heads)
    base = (module.qk_nope_head_dim + module.qk_rope_head_dim) ** -0.5
    # mistral4's default config carries its own yarn block (mscale_all_dim 1).
    corrected = (yarn or family == "mistral4") and family not in NO_YARN
    if family == "mistral_large4" and layer == 3:  # no rope: the rope width moved into P
        base = (module.qk_nope_head_dim) ** -0.5
    assert (model.softmax_scale > base * 1.5) == corrected
    if yarn and family in NO_YARN:
        assert "never applies a yarn correction" in model.softmax_scale_source


def test_key_spellings():
    base = {"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "num_attention_heads": 2}
    m = config_from_dict({**base, "num_layers": 28, "max_position_embeddings": 4096}, "longcat")
    assert m.num_layers == 28
    m = config_from_dict({**base, "num_hidden_layers": 3, "model_max_length": 1 << 20}, "kimi")
    assert m.max_model_len == 1 << 20
    # rope_type or the older type; a per-layer-type dict picks the full-attention one.
    for key in ("rope_type", "type"):
        m = config_from_dict({**base, "num_hidden_layers": 2, "max_position_embeddings": 64,
                              "rope_parameters": {**YARN, key: "yarn"}}, "x")
        assert m.softmax_scale == pytest.approx(48 ** -0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)
    nested = {**base, "num_hidden_layers": 2, "max_position_embeddings": 64,
              "layer_types": ["sliding_attention", "full_attention"],
              "rope_parameters": {"sliding_attention": {"rope_type": "default"},
                                  "full_attention": dict(YARN)}}
    m = config_from_dict(nested, "x")
    assert "rope_parameters['full_attention']" in m.softmax_scale_source
    assert m.for_layer(1).softmax_scale == m.softmax_scale
    assert m.for_layer(0).softmax_scale == pytest.approx(48 ** -0.5)  # its own (plain) rope dict
    # The family decides: kimi_linear's attention never applies yarn.
    m = config_from_dict({**nested, "model_type": "kimi_linear"}, "x")
    assert m.softmax_scale == pytest.approx(48 ** -0.5)


def test_family_names():
    assert family_name("dots3_note_text") == "dots3_note" and family_name("llama") is None
    assert family_name(None) is None


# Built-in name -> family, for the published model of each family.
BUILTIN_FAMILY = {"a.x-k1": "axk1", "a.x-k2": "axk2", "ling-3.0-flash": "bailing_hybrid",
                  "dots3-note": "dots3_note", "glm4-moe-lite": "glm4_moe_lite",
                  "glm-5.3-flash": "glm5_next", "glm-5": "glm_moe_dsa", "hy4-preview": "hy_v4",
                  "kimi-linear-48b-a3b": "kimi_linear", "longcat-flash-chat": "longcat_flash",
                  "minicpm3-4b": "minicpm3", "mistral-small-4-119b": "mistral4",
                  "mistral-large-4": "mistral_large4", "youtu-llm-2b": "youtu"}


def test_builtins_cover_every_family():
    assert sorted(BUILTIN_FAMILY) == sorted(FAMILY_BUILTINS)
    covered = set(BUILTIN_FAMILY.values()) | {"deepseek_v2", "deepseek_v3", "deepseek_v32"}
    assert covered == set(FAMILIES)
    assert get_model_config("deepseek-v3.2").softmax_scale == get_model_config("deepseek-v3").softmax_scale


@pytest.mark.parametrize("name", sorted(BUILTIN_FAMILY))
def test_builtin_is_transformers_defaults_for_the_family(name):
    ours = get_model_config(name)
    theirs = config_from_dict(config_class(BUILTIN_FAMILY[name])().to_dict(), name)
    for attr in ("L", "R", "P", "V", "num_heads", "num_layers", "max_model_len", "softmax_scale",
                 "layer_dims", "sliding_window_layers", "kv_source_layers"):
        got, want = getattr(ours, attr), getattr(theirs, attr)
        if attr == "layer_dims":  # the sources name the config they came from
            got, want = ([(i, (d.L, d.R, d.P, d.V, d.num_heads, d.softmax_scale)) for i, d in x]
                         for x in (got, want))
        assert got == want, attr


def test_per_layer_dims_plan_their_own_pages():
    """dots3_note's sliding layers hold L=1024 + R=64 = 1088 values per token, the
    others 576 (the issue's example); GLM-5's layers are all 576."""
    plan = plan_model(CacheConfig("auto", block_size=64), get_model_config("dots3-note"), 1 << 30)
    entries = {p.layer_index: p.shape[2] for p in plan.layers}
    assert entries[0] == 576 and entries[2] == 1088 and entries[5] == 576
    assert get_model_config("mistral-large-4").for_layer(3).E == 512
    assert torch.bfloat16 == get_model_config("glm-5").model_dtype


def test_a_layer_whose_own_dims_a_format_cannot_hold_says_how_to_skip_it():
    with pytest.raises(ValueError, match=r"layer 2 of dots3-note: .*got L=1024, R=64 \(this layer's own "
                                         r"dims; skip it to keep it native: skip_layers sliding_window or 2\)"):
        plan_model(CacheConfig("fp8_ds_mla"), get_model_config("dots3-note"), 1 << 30)
    plan = plan_model(CacheConfig("fp8_ds_mla", skip_layers=("sliding_window",)),
                      get_model_config("dots3-note"), 1 << 30)
    assert {p.layer_index: p.shape[2] for p in plan.layers}[2] == 1088


def test_linear_attention_layers_have_no_mla_cache():
    """kimi_linear, bailing_hybrid and glm5_next mix MLA layers with linear attention:
    only the MLA layers are planned; allocate() keeps layer indices (None for the others);
    an MLA layer cannot be built for a linear one."""
    model = get_model_config("kimi-linear-48b-a3b")
    assert model.non_mla_layers == frozenset(range(27)) - {4, 8, 12, 16, 20, 24}
    assert "not MLA (linear attention)" in model.describe()
    plan = plan_model(CacheConfig("auto", block_size=16), model, 1 << 24)
    assert [p.layer_index for p in plan.layers] == [4, 8, 12, 16, 20, 24]
    caches = plan.allocate()
    assert len(caches) == 27 and caches[0] is None and caches[4].shape[2] == 576
    assert "not MLA:         layers 0-3 5-7" in plan.format_table()
    with pytest.raises(ValueError, match="layer 0 of kimi-linear-48b-a3b is not an MLA layer"):
        from mla_ext.config.policy import resolve_layer
        resolve_layer(CacheConfig("auto"), model, layer=0)
    assert len(get_model_config("glm-5.3-flash").non_mla_layers) > 0
