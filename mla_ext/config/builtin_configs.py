"""Built-in configs of the published models of every transformers MLA family
(mla_ext.config.families), as config.json excerpts read by the same reader as a user's
file (mla_ext.config.models.config_from_dict), so their softmax scale and per-layer dims
are derived, not typed in.

Source: the defaults of transformers 5.23.0's config class of each family, which
its docstring ties to the checkpoint named here (e.g. GlmMoeDsaConfig:
zai-org/GLM-5); tests/config/test_family_configs.py checks each excerpt against those
defaults. DeepSeek-V3.2 is DeepSeek-V3's attention (its yarn block) with the DSA
indexer's index_topk. Layer types are written one letter per layer (I indexed,
S sliding, L linear, F full attention) and expanded here.
"""
from __future__ import annotations

import json

_TYPES = {"I": "indexed_attention", "S": "sliding_attention", "L": "linear_attention",
          "F": "full_attention"}


def _expand(raw: dict) -> dict:
    out = dict(raw)
    if isinstance(out.get("layer_types"), str):
        out["layer_types"] = [_TYPES[c] for c in out["layer_types"]]
    if isinstance(out.get("no_rope_layers"), str):
        out["no_rope_layers"] = [int(c) for c in out["no_rope_layers"].removeprefix("NOROPE:")]
    plc = out.get("per_layer_config")
    if isinstance(plc, str):  # the same dims on every sliding layer
        dims = json.loads(plc.removeprefix("SLIDING:"))
        out["per_layer_config"] = {f"{i:02d}": dict(dims) for i, t in enumerate(out["layer_types"])
                                   if t == "sliding_attention"}
    return out


_EXCERPTS = {
    'a.x-k1': {'model_type': 'axk1', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 128, 'v_head_dim': 128, 'num_attention_heads': 64, 'num_hidden_layers': 61, 'max_position_embeddings': 32768, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}},
    'a.x-k2': {'model_type': 'axk2', 'kv_lora_rank': 128, 'qk_rope_head_dim': 32, 'qk_nope_head_dim': 64, 'v_head_dim': 64, 'num_attention_heads': 32, 'num_hidden_layers': 48, 'max_position_embeddings': 131072, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}, 'index_topk': 2048, 'layer_types': 'IIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIII'},
    'ling-3.0-flash': {'model_type': 'bailing_hybrid', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 128, 'v_head_dim': 128, 'num_attention_heads': 32, 'num_hidden_layers': 42, 'model_max_length': 262144, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 6000000.0}, 'layer_types': 'LLLLLFLLLLLFLLLLLFLLLLLFLLLLLFLLLLLFLLLLLF'},
    'dots3-note': {'model_type': 'dots3_note_text', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 128, 'v_head_dim': 128, 'num_attention_heads': 128, 'num_hidden_layers': 46, 'max_position_embeddings': 524288, 'rope_parameters': {'indexed_attention': {'rope_type': 'default', 'rope_theta': 80000000.0, 'partial_rotary_factor': 0.25}, 'sliding_attention': {'rope_type': 'default', 'rope_theta': 50000.0, 'partial_rotary_factor': 0.25}}, 'index_topk': 2048, 'layer_types': 'IISSSISSSISSSISSSISSSISSSISSSISSSISSSISSSISSSI', 'sliding_window': 512, 'per_layer_config': 'SLIDING:{"num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 1024, "qk_nope_head_dim": 192}'},
    'glm4-moe-lite': {'model_type': 'glm4_moe_lite', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 192, 'v_head_dim': 256, 'num_attention_heads': 20, 'num_hidden_layers': 47, 'max_position_embeddings': 202752, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}},
    'glm-5.3-flash': {'model_type': 'glm5_next_text', 'kv_lora_rank': 512, 'qk_rope_head_dim': 0, 'qk_nope_head_dim': 256, 'v_head_dim': 256, 'num_attention_heads': 64, 'num_hidden_layers': 45, 'max_position_embeddings': 1048576, 'index_topk': 2048, 'layer_types': 'LLLILLLILLLILLLILLLILLLILLLILLLILLLILLLILLLIL'},
    'glm-5': {'model_type': 'glm_moe_dsa', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 192, 'v_head_dim': 256, 'num_attention_heads': 64, 'num_hidden_layers': 78, 'max_position_embeddings': 202752, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}, 'index_topk': 2048, 'layer_types': 'IIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIII'},
    'hy4-preview': {'model_type': 'hy_v4', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 192, 'v_head_dim': 256, 'num_attention_heads': 32, 'num_hidden_layers': 34, 'max_position_embeddings': 262144, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}, 'index_topk': 2048, 'layer_types': 'IIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIII'},
    'kimi-linear-48b-a3b': {'model_type': 'kimi_linear', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 128, 'v_head_dim': 128, 'num_attention_heads': 32, 'num_hidden_layers': 27, 'model_max_length': 1048576, 'layer_types': 'LLLLFLLLFLLLFLLLFLLLFLLLFLL'},
    'longcat-flash-chat': {'model_type': 'longcat_flash', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 128, 'v_head_dim': 128, 'num_attention_heads': 64, 'num_layers': 28, 'max_position_embeddings': 131072, 'rope_parameters': {'rope_theta': 10000000.0, 'rope_type': 'default'}},
    'minicpm3-4b': {'model_type': 'minicpm3', 'kv_lora_rank': 256, 'qk_rope_head_dim': 32, 'qk_nope_head_dim': 64, 'v_head_dim': 64, 'num_attention_heads': 40, 'num_hidden_layers': 62, 'max_position_embeddings': 32768, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}},
    'mistral-small-4-119b': {'model_type': 'mistral4', 'kv_lora_rank': 256, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 64, 'v_head_dim': 128, 'num_attention_heads': 32, 'num_hidden_layers': 36, 'max_position_embeddings': 1048576, 'rope_parameters': {'type': 'yarn', 'rope_theta': 10000.0, 'factor': 128.0, 'original_max_position_embeddings': 8192, 'max_position_embeddings': 1048576, 'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale_all_dim': 1.0, 'mscale': 1.0, 'llama_4_scaling_beta': 0.1, 'partial_rotary_factor': 0.5, 'rope_type': 'yarn'}},
    'mistral-large-4': {'model_type': 'mistral_large4_text', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 64, 'v_head_dim': 128, 'num_attention_heads': 64, 'num_hidden_layers': 72, 'max_position_embeddings': 1048576, 'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 2048.0, 'original_max_position_embeddings': 512, 'beta_fast': 32.0, 'beta_slow': 1.0, 'attention_factor': 1.0}, 'index_topk': 2048, 'layer_types': 'IIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIII', 'no_rope_layers': 'NOROPE:111011101110111011101110111011101110111011101110111011101110111011101110'},
    'youtu-llm-2b': {'model_type': 'youtu', 'kv_lora_rank': 512, 'qk_rope_head_dim': 64, 'qk_nope_head_dim': 128, 'v_head_dim': 128, 'num_attention_heads': 16, 'num_hidden_layers': 32, 'max_position_embeddings': 131072, 'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}},
}

FAMILY_BUILTINS: dict[str, dict] = {name: _expand(raw) for name, raw in _EXCERPTS.items()}
