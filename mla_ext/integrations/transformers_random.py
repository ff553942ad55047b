"""Tiny random-weight attention layers of every transformers MLA family, built
locally from transformers' own config and attention classes (no hub): the test
client of the integration (tests/integrations/test_integration_families.py) and a quick way to
try a family.

`random_family_attention("hy_v4", layer_idx=1)` builds the family's config with
small dims (`tiny_config_kwargs`: hidden 64, 2 heads, L=64, R=16, P=V=32 unless
overridden) and each family's layer layout (an MLA layer where the family mixes in
linear-attention layers, a sliding layer with its own dims for dots3_note, no-rope
and KV-sharing layers for mistral_large4), then the attention module of layer
`layer_idx` with random weights in eval mode: linears with unit-variance outputs
(q projections x2, so attention is peaked), norm gains around 1, sinks and other
vectors small.
"""
from __future__ import annotations

import importlib
import math

import torch

from mla_ext.config.families import FAMILIES

_COMMON = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=64,
               qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=48,
               num_hidden_layers=4, max_position_embeddings=4096, index_head_dim=32,
               index_n_heads=2, index_topk=2048, intermediate_size=64, moe_intermediate_size=32,
               vocab_size=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)

# Per family: the layer layout of the tiny model (layer 1 is the interesting one).
_LAYOUT = {
    # MLA on full_attention layers only; the others are linear attention.
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "glm5_next": dict(qk_rope_head_dim=0, index_kpool=4,
                      layer_types=["linear_attention", "indexed_attention"] * 2),
    # Layers 2 and 3 slide, with their own (smaller) dims: L=32, P=24, R=8, 4 heads.
    "dots3_note": dict(layer_types=["indexed_attention", "indexed_attention",
                                    "sliding_attention", "sliding_attention"],
                       sliding_window=64, swa_num_attention_heads=4, swa_num_key_value_heads=4,
                       swa_q_lora_rank=48, swa_kv_lora_rank=32, swa_head_dim=32,
                       swa_qk_nope_head_dim=24, swa_v_head_dim=24),
    # Its rotary embedding is sized by head_dim (= R in the published configs).
    "longcat_flash": dict(head_dim=16),
    # Layer 1 without rope; layer 2 reads layer 0's KV, layer 3 layer 1's.
    "mistral_large4": dict(no_rope_layers=[1, 0, 1, 0], kv_source_layers=[0, 1, 0, 1]),
}


def config_class(family: str):
    """The family's text config class (e.g. MistralLarge4TextConfig)."""
    f = FAMILIES[family]
    lib = importlib.import_module(f"transformers.models.{f.module}.configuration_{f.module}")
    names = [n for n in dir(lib) if n.endswith("Config") and n != "PreTrainedConfig"]
    text = [n for n in names if "Text" in n]
    plain = [n for n in names if not any(k in n for k in ("Vision", "Audio", "Text"))]
    return getattr(lib, (text or plain)[0])


def tiny_config_kwargs(family: str, **overrides) -> dict:
    return {**_COMMON, **_LAYOUT.get(family, {}), **overrides}


def tiny_config(family: str, **overrides):
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    cfg = config_class(family)(**tiny_config_kwargs(family, **overrides))
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for pname, p in module.named_parameters():
        if pname == "sinks":  # logits comparable to the scores, so they matter
            p.copy_(1.5 * torch.randn(p.shape, generator=gen))
        elif "norm" in pname:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2:
            gain = 2.0 if pname.startswith("q_") else 1.0
            p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return module


def random_family_attention(family: str, *, layer_idx: int = 1, dtype: torch.dtype = torch.float32,
                            seed: int = 0, config=None, **overrides):
    """The attention module of layer `layer_idx` of a tiny `family` model (or of
    `config`), random weights, in eval mode and `dtype`."""
    cfg = config if config is not None else tiny_config(family, **overrides)
    f = FAMILIES[family]
    lib = importlib.import_module(f"transformers.models.{f.module}.modeling_{f.module}")
    module = getattr(lib, f.attention)(cfg, layer_idx=layer_idx)
    return randomize_(module, seed).to(dtype).eval()
