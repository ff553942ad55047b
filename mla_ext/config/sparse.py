"""A sparse (DSA) model's indexer facts: `SparseConfig` and the reader of its fields from any
model config (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa` and kin). The layer that runs
it is mla_ext/prefill/sparse.py; the index cache's formats are config/index_formats.py."""
from __future__ import annotations

from dataclasses import dataclass, replace

from mla_ext.config.dict_reader import sparse_fields as dict_sparse_fields
from mla_ext.config.dict_reader import text_dict
from mla_ext.config.families import family_of
from mla_ext.config.hf_reader import hf_config_from_dict, sparse_fields_hf, transformers_reader_enabled
from mla_ext.config.index_formats import get_index_format

# Indexer keys scored per step of the chunked top-k (bounds its workspace; mla_ext/sparse/topk.py).
DEFAULT_CHUNK = 4096


def _is_model_config(config) -> bool:
    """An mla_ext MLAModelConfig (config/models.py, which builds on this module: recognised by its
    fields rather than imported, so the arrow points down)."""
    return hasattr(config, "sparse_layers") and hasattr(config, "layer_dims")


SPARSE_KEYS = ("index_topk", "index_n_heads", "index_head_dim")


# model_type -> whether the indexer pairs its RoPE dims interleaved (the families with parity tests).
ROPE_INTERLEAVED = {"deepseek_v32": False, "glm_moe_dsa": True}


def _pos_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class SparseConfig:
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_interleaved: bool | None = None  # the indexer's RoPE pairing (the layer takes rotated inputs)
    index_cache_dtype: str = "bfloat16"
    chunk: int = DEFAULT_CHUNK  # indexer keys scored per step (bounds the top-k workspace)

    def __post_init__(self):
        for k in SPARSE_KEYS + ("chunk",):
            _pos_int(getattr(self, k), k)
        get_index_format(self.index_cache_dtype)

    @classmethod
    def from_config(cls, config, **overrides) -> "SparseConfig | None":
        """From any model config: a config dict (DSA fields at top level or under text_config),
        a transformers PretrainedConfig, an mla_ext MLAModelConfig (its own `sparse`); None for
        a dense model. A sparse family's config reads its config class's defaults where a field
        is absent (sparse_fields). A ValueError naming `config` for anything else."""
        if _is_model_config(config):
            own = config.sparse
            return own if own is None or not overrides else replace(own, **overrides)
        fields = sparse_fields(config, "config")
        return None if fields is None else cls.from_facts(fields, "config", **overrides)

    @classmethod
    def from_facts(cls, fields: dict, name: str, **overrides) -> "SparseConfig":
        """From the indexer's fields a config reader gives (mla_ext.config.facts.ConfigFacts.sparse)."""
        kw = {k: fields[k] for k in SPARSE_KEYS}
        for k, v in kw.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model config {name}: {k} must be a positive integer; got {v!r}")
        kw["rope_interleaved"] = ROPE_INTERLEAVED.get(fields.get("model_type"))
        kw.update(overrides)
        return cls(**kw)

    def drops(self, context_lens, query_lens) -> bool:
        """Whether some request with new tokens has more tokens than index_topk (the indexer then
        drops some)."""
        return any(q > 0 and c + q > self.index_topk for c, q in zip(context_lens, query_lens))

    def describe(self) -> str:
        rope = {None: "rope pairing not stated", False: "half-split rope", True: "interleaved rope"}
        return (f"sparse (DSA): index_topk={self.index_topk}, indexer {self.index_n_heads} heads x "
                f"{self.index_head_dim} ({rope[self.rope_interleaved]}), index cache {self.index_cache_dtype} "
                f"({get_index_format(self.index_cache_dtype).bytes_per_token(self.index_head_dim, self.index_head_dim)}"
                f" B/token), chunked top-k over {self.chunk} keys; dense while context + new <= index_topk")


def sparse_fields(config, name: str = "config") -> dict | None:
    """The DSA indexer's fields (index_topk, index_n_heads, index_head_dim, model_type) of
    any model config, None for a dense model: an MLAModelConfig's, a transformers
    config's, a config dict's (at top level or under text_config; a sparse family's
    defaults from its config class where absent). Only these fields are read, so a
    partial dict will do. A ValueError naming `name` for anything else."""
    if _is_model_config(config):
        s = config.sparse
        return None if s is None else {"index_topk": s.index_topk, "index_n_heads": s.index_n_heads,
                                       "index_head_dim": s.index_head_dim, "model_type": None}
    if not isinstance(config, dict) and callable(getattr(config, "to_dict", None)) \
            and hasattr(config, "model_type"):
        get_text = getattr(config, "get_text_config", None)
        text = get_text(decoder=True) if callable(get_text) else config
        family = family_of(getattr(text, "model_type", None)) or family_of(config.model_type)
        if family is not None and transformers_reader_enabled():
            return sparse_fields_hf(text, family)
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a model config (a config dict, a transformers "
                         f"PretrainedConfig or an mla_ext MLAModelConfig), got {type(config).__name__}")
    raw = text_dict(config)
    family = family_of(raw.get("model_type"))
    if family is not None and family.sparse and transformers_reader_enabled():
        return sparse_fields_hf(hf_config_from_dict(raw, family, name), family)
    return dict_sparse_fields(raw, family, name)
