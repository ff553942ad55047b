"""Random raw configs of every transformers MLA family, in the spellings and with the
defaults published checkpoints use (for tests/config/test_config_readers.py and the fuzz
cases of bad configs, tests/fuzz/fuzz_cases_config.py).

`random_config(family, seed)` draws small dims and, per family, one of the ways its
checkpoints spell a layer pattern (layer_types written out or absent so the family's
default applies, kimi_linear's linear_attn_config, bailing_hybrid's layer_group_size,
glm5_next's full_attention, dots3_note's swa_* and use_dsa, mistral_large4's
no_rope_layer_interval and kv_source_layers, longcat_flash's num_layers), one rope
spelling (absent, default, yarn under rope_parameters/rope_type or rope_scaling/type,
with or without mscale_all_dim), and sometimes nests it under text_config.
"""
from __future__ import annotations

import random

from mla_ext.config.families import FAMILIES

HYBRID = {"kimi_linear", "bailing_hybrid", "glm5_next"}


def _rope(rng: random.Random, family: str, dsa=None) -> dict:
    """{} (absent) or one rope spelling."""
    if family == "glm5_next":  # no rope at all (R = 0)
        return {}
    pick = rng.randrange(5)
    factor = rng.choice([1.0, 4.0, 40.0])
    yarn = {"factor": factor, "original_max_position_embeddings": 64, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "rope_theta": 10000.0}
    if rng.random() < 0.7:
        yarn["mscale_all_dim"] = rng.choice([0.707, 1.0])
    if family == "dots3_note":  # transformers writes one dict per layer type here
        if pick < 2:
            return {}
        full = "full_attention" if dsa is False else "indexed_attention"
        return {"rope_parameters": {full: {"rope_type": "yarn", **yarn},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}}
    if pick == 0:
        return {}
    if pick == 1:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if pick == 2:
        return {"rope_parameters": {"rope_type": "yarn", **yarn}}
    if pick == 3:
        return {"rope_scaling": {"type": "yarn", **yarn}}
    return {"rope_parameters": {"type": "yarn", **yarn}}


def _pattern(rng: random.Random, family: str, n: int) -> dict:
    """The family's layer pattern in one of its spellings (or none: its default)."""
    if family == "kimi_linear":
        pick = rng.randrange(3)
        full = sorted(rng.sample(range(n), rng.randint(1, n)))
        if pick == 0 and n >= 5:  # the default: full attention on layers 4, 8, ...
            return {}
        if pick == 1:
            return {"layer_types": ["full_attention" if i in full else "linear_attention" for i in range(n)]}
        return {"linear_attn_config": {"full_attn_layers": [i + 1 for i in full],
                                       "kda_layers": [i + 1 for i in range(n) if i not in full]}}
    if family == "bailing_hybrid":
        pick = rng.randrange(3)
        if pick == 0 and n >= 6:  # the default group of 6
            return {}
        if pick < 2:
            return {"layer_group_size": rng.randint(1, n)}
        full = set(rng.sample(range(n), rng.randint(1, n)))
        return {"layer_types": ["full_attention" if i in full else "linear_attention" for i in range(n)]}
    if family == "glm5_next":
        if rng.random() < 0.4 and n >= 4:  # the default: every 4th layer is MLA
            return {}
        full = set(rng.sample(range(n), rng.randint(1, n)))
        kind = rng.choice(["indexed_attention", "full_attention"])  # the latter is normalised
        return {"layer_types": [kind if i in full else "linear_attention" for i in range(n)]}
    if family == "dots3_note":
        out = {"sliding_window": 64}
        swa = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 48,
               "swa_kv_lora_rank": rng.choice([32, 64]), "swa_qk_nope_head_dim": 24,
               "swa_head_dim": 32, "swa_v_head_dim": rng.choice([16, 24])}
        if rng.random() < 0.8:
            out.update(swa)
        pick = rng.randrange(3)
        if pick == 1:
            out["use_sliding_window"] = rng.random() < 0.5
        elif pick == 2:
            out["layer_types"] = [rng.choice(["indexed_attention", "sliding_attention"]) for _ in range(n)]
            out["layer_types"][0] = "indexed_attention"
        if rng.random() < 0.3:
            out["use_dsa"] = False
        return out
    if family == "mistral_large4":
        out = {}
        if rng.random() < 0.5:
            out["no_rope_layers"] = [rng.randint(0, 1) for _ in range(n)]
        elif rng.random() < 0.5:
            out["no_rope_layer_interval"] = rng.randint(1, 4)
        if rng.random() < 0.5:  # each layer: its own KV, or an earlier owner's
            src = []
            for i in range(n):
                owners = [j for j in range(i) if src[j] == j]
                src.append(rng.choice(owners) if owners and rng.random() < 0.5 else i)
            out["kv_source_layers"] = src
        return out
    if FAMILIES[family].sparse and rng.random() < 0.3:  # the legacy name of indexed_attention
        return {"layer_types": ["deepseek_sparse_attention"] * n}
    return {}


def random_config(family: str, seed: int) -> dict:
    """A valid raw config dict of `family` (as a checkpoint's config.json would hold it)."""
    rng = random.Random(f"{family}/{seed}")
    f = FAMILIES[family]
    n = rng.randint(2, 9)
    heads = rng.choice([1, 2, 4])
    R = 0 if family == "glm5_next" else rng.choice([8, 16, 32])
    raw = {"model_type": family, "hidden_size": 64, "num_attention_heads": heads, "num_key_value_heads": heads,
           "kv_lora_rank": rng.choice([32, 64, 128]), "qk_rope_head_dim": R,
           "qk_nope_head_dim": rng.choice([16, 32, 64]), "v_head_dim": rng.choice([16, 32]),
           "q_lora_rank": 48, "num_hidden_layers": n, "max_position_embeddings": rng.choice([4096, 65536]),
           "intermediate_size": 64, "moe_intermediate_size": 32, "vocab_size": 64, "pad_token_id": None,
           "bos_token_id": None, "eos_token_id": None}
    if f.sparse:
        raw.update(index_topk=rng.choice([64, 2048]), index_n_heads=2, index_head_dim=32)
        if rng.random() < 0.3:  # the family's defaults fill them in
            del raw["index_n_heads"], raw["index_head_dim"]
    if family == "glm5_next":
        raw["index_kpool"] = 4
    if family in ("mistral4", "longcat_flash"):
        raw["head_dim"] = raw["qk_nope_head_dim"] + R if family == "mistral4" else R
    if family == "dots3_note":
        raw["head_dim"] = raw["qk_nope_head_dim"] + R
    if family == "minicpm3" and rng.random() < 0.4:
        raw["v_head_dim"] = None  # MiniCPM3Config: hidden_size // num_attention_heads
    if family == "longcat_flash" and rng.random() < 0.6:  # its checkpoints count decoder layers
        raw["num_layers"] = raw.pop("num_hidden_layers")
    if family in ("kimi_linear", "bailing_hybrid") and rng.random() < 0.5:
        raw["model_max_length"] = raw.pop("max_position_embeddings")
    raw.update(_pattern(rng, family, raw.get("num_hidden_layers") or 2 * raw["num_layers"]))
    raw.update(_rope(rng, family, raw.get("use_dsa")))
    if rng.random() < 0.25:  # a multimodal checkpoint's text_config
        top = family if family in ("dots3_note", "glm5_next", "mistral_large4") else "some_vl_model"
        raw = {"model_type": top, "architectures": ["SomeVL"], "text_config": raw}
    return raw
