"""Fuzz cases of bad model configs, per transformers MLA family (mla_ext.config.families: a new
family gets them by construction). Each family's published config (its built-in excerpt,
mla_ext.config.models) is spoiled one field at a time: a dim missing, of the wrong type, zero or
negative; a huge layer count; bad rope parameters; bad layer patterns (wrong length,
unknown entry, not a list, no MLA layer at all); a per-layer config out of range. Each
must be refused with a ValueError naming the field (never a crash, a vague error or a
silent default), through transformers' reader and through mla_ext's own (forced).
Also the valid config of each family (accepted, sparse exactly where the family is) and
the other config entry points (config_from_hf, sparse_fields)."""
from __future__ import annotations

import copy

from fuzz_harness import QUICK, Call, add
from mla_ext.config import models
from mla_ext.config.dict_reader import _DERIVED, _FAMILY_ALIASES
from mla_ext.config.hf_reader import config_class, transformers_reader, transformers_reader_enabled
from mla_ext.config.families import FAMILIES

CFD = "mla_ext.config.models:config_from_dict"
DIMS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
READERS = {"hf": True, "own": False} if transformers_reader_enabled() else {"own": False}

# A family's published config: the built-in excerpt whose model_type is the family's.
BASES = {f: next(raw for raw in models._BUILTIN_JSON.values()
                 if raw.get("model_type", "").removesuffix("_text") == f) for f in FAMILIES}
for _f in FAMILIES:  # import each config class now, not in every forked case
    if transformers_reader_enabled():
        config_class(BASES[_f]["model_type"])


def _spoiled(family: str, **changes) -> dict:
    """The family's config with `changes` applied (a value of ... deletes the key)."""
    raw = copy.deepcopy(BASES[family])
    for k, v in changes.items():
        if v is ...:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


def _read(raw, reader: bool):
    def fn():
        with transformers_reader(reader):
            return models.config_from_dict(raw, name="cfg")
    return fn


def _case(family, name, raw, args, expect="reject", check=None):
    for tag, reader in READERS.items():
        add(CFD, f"{family}_{name}_{tag}", lambda g, raw=raw, reader=reader: Call(_read(raw, reader), check),
            expect, args, timeout=QUICK)


def _valid_check(family):
    f = FAMILIES[family]

    def check(m):
        assert isinstance(m, models.MLAModelConfig), type(m)
        assert (m.sparse is not None) == f.sparse, m.sparse
        assert m.num_layers % f.attention_per_layer == 0
    return check


def _layer_key(family) -> str:
    return "num_layers" if "num_layers" in BASES[family] else "num_hidden_layers"


for family in sorted(FAMILIES):
    base = BASES[family]
    n = models.config_from_dict(base, "base").num_layers
    _case(family, "valid", base, (), "accept", _valid_check(family))
    for key in DIMS + ("num_hidden_layers", "max_position_embeddings"):
        spellings = (key,) + _FAMILY_ALIASES.get(family, {}).get(key, ())
        gone = {k: ... for k in spellings}
        if key in _DERIVED.get(family, ()):  # its config class derives it: accepted
            _case(family, f"missing_{key}", _spoiled(family, **gone), (), "accept", _valid_check(family))
        else:
            _case(family, f"missing_{key}", _spoiled(family, **gone), spellings)
    for key in DIMS:
        for label, value in (("str", "64"), ("float", 64.0), ("negative", -1), ("huge", 10**30)):
            _case(family, f"{key}_{label}", _spoiled(family, **{key: value}), (key,))
        if key != "qk_rope_head_dim":
            _case(family, f"{key}_zero", _spoiled(family, **{key: 0}), (key,))
    lk = _layer_key(family)
    _case(family, "layers_1e9", _spoiled(family, **{lk: 10**9}), ("num_hidden_layers", lk))
    _case(family, "layers_zero", _spoiled(family, **{lk: 0}), ("num_hidden_layers", lk))
    _case(family, "layers_bool", _spoiled(family, **{lk: True}), ("num_hidden_layers", lk))
    # Rope parameters: not a dict; yarn without its factor; a non-number factor.
    _case(family, "rope_not_a_dict", _spoiled(family, rope_parameters="yarn", rope_scaling=...),
          ("rope_parameters",))
    if FAMILIES[family].yarn_in_scale:
        yarn = {"rope_type": "yarn", "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                "rope_theta": 10000.0}
        _case(family, "yarn_without_factor", _spoiled(family, rope_parameters=yarn, rope_scaling=...),
              ("factor", "rope_parameters"))
        _case(family, "yarn_factor_str", _spoiled(family, rope_parameters={**yarn, "factor": "40"},
                                                   rope_scaling=...), ("factor", "rope_parameters"))
    # Layer patterns.
    _case(family, "layer_types_short", _spoiled(family, layer_types=["full_attention"] * (n - 1)),
          ("layer_types",))
    _case(family, "layer_types_unknown", _spoiled(family, layer_types=["banana_attention"] * n),
          ("layer_types",))
    _case(family, "layer_types_str", _spoiled(family, layer_types="full_attention"), ("layer_types",))
    _case(family, "layer_types_all_linear", _spoiled(family, layer_types=["linear_attention"] * n),
          ("layer_types",))
    _case(family, "per_layer_config_out_of_range",
          _spoiled(family, per_layer_config={str(n + 3): {"kv_lora_rank": 64}}), ("per_layer_config",))
    _case(family, "per_layer_config_dim_str",
          _spoiled(family, per_layer_config={"0": {"kv_lora_rank": "64"}}), ("kv_lora_rank",))

_case("kimi_linear", "linear_attn_config_layer_0",
      _spoiled("kimi_linear", layer_types=..., linear_attn_config={"full_attn_layers": [0], "kda_layers": []}),
      ("linear_attn_config",))
_case("mistral_large4", "kv_source_later_layer",
      _spoiled("mistral_large4", kv_source_layers=[1] + list(range(1, 72))), ("kv_source_layers",))
_case("mistral_large4", "no_rope_layers_short", _spoiled("mistral_large4", no_rope_layers=[1, 0]),
      ("no_rope_layers",))
_case("longcat_flash", "odd_num_hidden_layers", _spoiled("longcat_flash", num_layers=..., num_hidden_layers=57),
      ("num_hidden_layers",))

# The other config entry points.
CFH = "mla_ext.config.models:config_from_hf"
SF = "mla_ext.config.sparse:sparse_fields"
if transformers_reader_enabled():
    add(CFH, "glm5_config_object", lambda g: Call(
        lambda: models.config_from_hf(config_class("glm_moe_dsa").from_dict(BASES["glm_moe_dsa"])),
        lambda m: m.sparse is not None or (_ for _ in ()).throw(AssertionError("dense"))), "accept")
add(CFH, "not_a_config", lambda g: Call(lambda: models.config_from_hf(3, "cfg")), "reject", ("cfg",),
    timeout=QUICK)
add(SF, "glm5_dict", lambda g: Call(lambda: models.sparse_fields(BASES["glm_moe_dsa"]),
                                    lambda d: d["index_topk"] == 2048 or (_ for _ in ()).throw(AssertionError(d))),
    "accept")
for _label, _bad in (("int", 3), ("str", "glm-5"), ("none", None), ("list", [1])):
    add(SF, _label, lambda g, bad=_bad: Call(lambda: models.sparse_fields(bad, "config")), "reject", ("config",),
        timeout=QUICK)
add(SF, "partial_dsa_fields", lambda g: Call(lambda: models.sparse_fields({"index_topk": 16})), "reject",
    ("index_n_heads", "index_head_dim"), timeout=QUICK)
