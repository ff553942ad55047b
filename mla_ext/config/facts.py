"""What a model config says about each layer, as either config reader gives it.

Two readers turn a raw config (dict, config.json, built-in excerpt) into these facts:
mla_ext.config.hf_reader (transformers' own config class of the family, used whenever
transformers is importable) and mla_ext.config.dict_reader (mla_ext's reader, the fallback
without transformers and the reader of configs of no transformers family).
mla_ext.config.models builds the MLAModelConfig from the facts, so both readers end in one
place and tests/config/test_config_readers.py can hold them equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mla_ext.config.softmax_scale import SoftmaxScale

# transformers' names of layer types (configuration_utils._LEGACY_LAYER_TYPE_REMAP):
# older checkpoints spell them otherwise; both readers read them the same way.
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                      "deepseek_sparse_attention": "indexed_attention",
                      "qwen_sparse_attention": "indexed_attention"}
# transformers' ALLOWED_ATTN_LAYER_TYPES (5.23): a family config with another entry is refused.
ALLOWED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention",
                       "window_attention", "indexed_attention", "compressed_sparse_attention",
                       "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe", "hybrid",
                       "hybrid_sliding", "reference_sliding_attention", "linear_attention")


@dataclass(frozen=True)
class LayerFacts:
    """One layer: its type (transformers' spelling), its config widths and heads, its
    softmax scale, whether it applies rope (mistral_large4's no_rope_layers)."""

    kind: str
    L: int
    R: int
    P: int
    V: int
    num_heads: int
    scale: SoftmaxScale
    rope: bool = True

    @property
    def mla(self) -> bool:
        """Linear-attention layers (kimi_linear, bailing_hybrid, glm5_next) have no MLA."""
        return self.kind != "linear_attention"

    @property
    def sliding(self) -> bool:
        return "sliding" in self.kind.lower()


@dataclass(frozen=True)
class ConfigFacts:
    layers: tuple  # LayerFacts per layer, in order
    max_model_len: int
    kv_sources: dict = field(default_factory=dict)  # {layer: the layer whose KV it reads}
    # The DSA indexer's fields (index_topk, index_n_heads, index_head_dim, model_type), or None.
    sparse: dict | None = None
    sparse_layers: frozenset = frozenset()  # the layers that run the indexer's selection
    reader: str = ""  # which reader gave these facts (describe())
    attention_per_layer: int = 1  # MLA modules per decoder layer (longcat_flash: 2)
