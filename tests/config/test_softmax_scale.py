"""SPEC §10: the softmax scale comes from the model's config (yarn mscale), never a
bare (P+R)^-0.5 when the config says otherwise. Expected values are written out
from DeepSeek's own formula, independently of mla_ext.config.softmax_scale."""
import math

import pytest
import torch

from mla_ext.config.models import BUILTIN_MODELS, config_from_dict, get_model_config

DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "num_attention_heads": 128, "num_hidden_layers": 61,
        "max_position_embeddings": 163840}
YARN_V3 = {"factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
YARN_V2_LITE = {**YARN_V3, "mscale": 0.707, "mscale_all_dim": 0.707}


def deepseek_reference_scale(qk_head_dim, rope_scaling):
    """The scale as DeepSeek's modeling code computes it (softmax_scale *= mscale**2)."""
    scale = qk_head_dim ** -0.5
    if rope_scaling:
        mscale_all_dim = rope_scaling.get("mscale_all_dim", 0)
        factor = rope_scaling["factor"]
        if mscale_all_dim:
            m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return scale


V3_SCALE = 0.13523   # SPEC §10
V2_LITE_SCALE = 0.11472
KIMI_SCALE = 192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2
GLM_SCALE = (192 + 64) ** -0.5


@pytest.mark.parametrize("name,expected", [
    ("deepseek-v3", V3_SCALE),
    ("deepseek-r1", V3_SCALE),
    ("deepseek-v2-lite", V2_LITE_SCALE),
    ("kimi-k2", KIMI_SCALE),
])
def test_builtin_scale(name, expected):
    m = get_model_config(name)
    assert m.softmax_scale == pytest.approx(expected, rel=1e-4)
    assert "mscale" in m.softmax_scale_source and "factor" in m.softmax_scale_source
    assert m.model_dtype == torch.bfloat16 and m.dtype_source == "config torch_dtype"


def test_every_builtin_has_a_derived_scale():
    # DeepSeek's and Kimi-K2's yarn raise the scale; the other families' published
    # configs have no yarn block their attention applies (their base scale, derived
    # the same way: tests/config/test_family_configs.py checks each against transformers).
    for name, m in BUILTIN_MODELS.items():
        base = (m.P + m.R) ** -0.5
        if name.startswith(("deepseek", "kimi-k2")):
            assert m.softmax_scale > base, name
        assert (m.softmax_scale > base) == ("mscale^2" in m.softmax_scale_source), name


# config.json variants in every spelling real MLA checkpoints use -> expected scale.
CASES = {
    "t4 rope_scaling type=yarn (DeepSeek-V3)":
        ({**DIMS, "rope_scaling": {"type": "yarn", **YARN_V3}}, V3_SCALE),
    "t4 rope_scaling rope_type=yarn":
        ({**DIMS, "rope_scaling": {"rope_type": "yarn", **YARN_V3}}, V3_SCALE),
    "t5 rope_parameters (DeepSeek-V3)":
        ({**DIMS, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **YARN_V3}},
         V3_SCALE),
    "t5 rope_parameters wins over stale rope_scaling":
        ({**DIMS, "rope_parameters": {"rope_type": "yarn", **YARN_V3},
          "rope_scaling": {"type": "yarn", **YARN_V2_LITE}}, V3_SCALE),
    "V2-Lite mscale_all_dim 0.707":
        ({**DIMS, "num_attention_heads": 16, "rope_scaling": {"type": "yarn", **YARN_V2_LITE}},
         V2_LITE_SCALE),
    "Kimi-K2 factor 32":
        ({**DIMS, "rope_scaling": {"type": "yarn", **YARN_V3, "factor": 32.0}}, KIMI_SCALE),
    "deepseek_yarn spelling":
        ({**DIMS, "rope_scaling": {"type": "deepseek_yarn", **YARN_V3}}, V3_SCALE),
    "yarn without mscale_all_dim: base":
        ({**DIMS, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0}}, 192 ** -0.5),
    "yarn factor 1: no extension":
        ({**DIMS, "rope_scaling": {"type": "yarn", **YARN_V3, "factor": 1.0}}, 192 ** -0.5),
    "no rope scaling (null)": ({**DIMS, "rope_scaling": None}, 192 ** -0.5),
    "GLM MLA (P=192, V=256), no rope scaling":
        ({**DIMS, "qk_nope_head_dim": 192, "v_head_dim": 256, "num_attention_heads": 64},
         GLM_SCALE),
    "GLM MLA t5 rope_parameters default":
        ({**DIMS, "qk_nope_head_dim": 192, "v_head_dim": 256,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, GLM_SCALE),
    "multimodal text_config (Kimi-VL style)":
        ({"text_config": {**DIMS, "rope_scaling": {"type": "yarn", **YARN_V3}}}, V3_SCALE),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_variant_scale(case):
    raw, expected = CASES[case]
    m = config_from_dict(raw, name=case)
    assert m.softmax_scale == pytest.approx(expected, rel=1e-4)
    inner = raw.get("text_config", raw)
    rope = inner.get("rope_parameters") or inner.get("rope_scaling")
    if rope is not None and rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    assert m.softmax_scale == pytest.approx(
        deepseek_reference_scale(inner["qk_nope_head_dim"] + inner["qk_rope_head_dim"], rope),
        rel=1e-12)


def test_transformers_agrees_on_every_variant():
    """transformers' own DeepSeek-V3 attention computes the same scale from the same
    config (its `scaling` attribute)."""
    cfg_mod = pytest.importorskip("transformers.models.deepseek_v3.configuration_deepseek_v3")
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    for case, (raw, _) in sorted(CASES.items()):
        inner = raw.get("text_config", raw)
        if "deepseek_yarn" in str(inner) or "rope_parameters" in inner and "rope_scaling" in inner:
            continue  # spellings transformers' own config class does not take
        small = {**inner, "hidden_size": 64, "q_lora_rank": None, "n_routed_experts": 4,
                 "num_key_value_heads": inner["num_attention_heads"]}
        cfg = cfg_mod.DeepseekV3Config(**small)
        attn = modeling.DeepseekV3Attention(cfg, layer_idx=0)
        m = config_from_dict(cfg.to_dict(), name=case)
        assert m.softmax_scale == pytest.approx(attn.scaling, rel=1e-6), case


@pytest.mark.parametrize("rope,match", [
    ({"type": "yarn", "mscale_all_dim": 1.0}, "needs 'factor'"),
    ({"type": "yarn", "factor": "40", "mscale_all_dim": 1.0}, "factor must be a finite number"),
    ({"type": "yarn", "factor": 40, "mscale_all_dim": float("nan")}, "mscale_all_dim must be"),
    ({"type": "yarn", "factor": -2, "mscale_all_dim": 1.0}, "factor must be > 0"),
    ("yarn", "rope_scaling must be an object"),
])
def test_bad_rope_scaling_is_an_error_naming_the_key(rope, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({**DIMS, "rope_scaling": rope}, name="cfg.json")


def test_dtype_from_either_key_or_said_to_be_assumed():
    assert config_from_dict({**DIMS, "dtype": "float16"}, "c").model_dtype == torch.float16
    m = config_from_dict({**DIMS, "dtype": "float16"}, "c")
    assert m.dtype_source == "config dtype"
    m = config_from_dict(dict(DIMS), "c")
    assert m.model_dtype == torch.bfloat16 and "assumed" in m.dtype_source
    assert "assumed" in m.describe()
    with pytest.raises(ValueError, match="dtype must be one of"):
        config_from_dict({**DIMS, "dtype": "int8"}, "c")


def test_shard_gives_the_rank_its_heads():
    m = get_model_config("deepseek-v3")
    s = m.shard(8, 3)
    assert (s.num_heads, s.total_heads, s.tp_size, s.tp_rank) == (16, 128, 8, 3)
    assert s.softmax_scale == m.softmax_scale and s.L == m.L
    assert "TP rank 3 of 8" in s.describe()
    with pytest.raises(ValueError, match="tp_size must divide num_heads=128"):
        m.shard(3, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\)"):
        m.shard(8, 8)
    with pytest.raises(ValueError, match="already a tensor-parallel shard"):
        s.shard(2, 0)
    with pytest.raises(ValueError, match="tp_size must be an integer"):
        m.shard(2.0, 0)
