"""MLA model dimensions: built-in configurations and a reader for HF `config.json`.

Only what the KV-cache policy, the planner and the kernels need: latent and
rope widths (L, R), head dims (P, V), heads, layer count, which layers have a
sliding window (for the `sliding_window` skip entry of SPEC §3), the model
dtype and the maximum model length.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from mla_ext.config.builtin_configs import FAMILY_BUILTINS
from mla_ext.config.dict_reader import MAX_NUM_LAYERS, facts_from_dict, is_int, precheck, short, text_dict
from mla_ext.config import dict_reader as config_dict
from mla_ext.config.hf_reader import facts_from_hf, hf_config_from_dict, transformers_reader_enabled
from mla_ext.config.families import family_of
from mla_ext.config.formats import MODEL_DTYPES
from mla_ext.config.softmax_scale import base_scale
from mla_ext.config.sparse import SparseConfig, sparse_fields  # noqa: F401  (sparse_fields re-exported)

# A config.json is a few KiB; anything past this is not one (and is not read).
MAX_CONFIG_BYTES = 16 * 2**20

_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True)
class LayerDims:
    """One layer's own attention dims, where they differ from the model's
    (dots3_note's sliding-window layers: another L, P and head count;
    mistral_large4's no-rope layers: R = 0 with the rope width moved into P).
    `num_heads` counts the heads the config computes (one rank's after `shard`);
    `softmax_scale` None: that layer's base (P+R)^-0.5."""

    L: int
    R: int
    P: int
    V: int
    num_heads: int
    softmax_scale: float | None = None
    softmax_scale_source: str = ""


@dataclass(frozen=True)
class MLAModelConfig:
    """The dimensions of one MLA model (symbols as in SPEC §0) and the attention
    math that comes from its config: the softmax scale (SPEC §10) and the model dtype,
    each with a note on where it came from.

    `num_heads` is the heads this config computes: all of them, or one rank's
    share after `shard(tp_size, rank)`.
    """

    name: str
    L: int  # kv_lora_rank
    R: int  # qk_rope_head_dim
    P: int  # qk_nope_head_dim
    V: int  # v_head_dim
    num_heads: int
    num_layers: int
    sliding_window_layers: frozenset = field(default_factory=frozenset)
    model_dtype: torch.dtype = torch.bfloat16
    max_model_len: int = 163840
    # None: the base (P+R)^-0.5. A config read from config.json carries the
    # model's own (yarn-corrected) value.
    softmax_scale: float | None = None
    softmax_scale_source: str = ""
    dtype_source: str = "given"
    tp_size: int = 1
    tp_rank: int = 0
    # Per-layer dims where a layer differs from the fields above: a dict
    # {layer: LayerDims} (kept as sorted (layer, LayerDims) pairs, hashable).
    layer_dims: tuple = ()
    # Layers that keep no KV of their own and read another layer's cache
    # (mistral_large4's KV sharing): {layer: source layer}, as sorted pairs.
    kv_source_layers: tuple = ()
    # Layers that are not MLA attention at all (linear attention in kimi_linear,
    # bailing_hybrid, glm5_next): they have no MLA cache and no MLA layer.
    non_mla_layers: frozenset = field(default_factory=frozenset)
    # A sparse (DSA) model's indexer (mla_ext.config.sparse.SparseConfig), None for a
    # dense one, and the MLA layers that run its selection (default: every MLA layer).
    # `for_layer(i)` keeps it only on those layers.
    sparse: object = None
    sparse_layers: frozenset = field(default_factory=frozenset)
    reader: str = ""  # which config reader read it (mla_ext.config.hf_reader / config_dict), or ""
    # MLA modules per decoder layer. LongCat-Flash has two (self_attn[0] and [1] of each
    # decoder layer); transformers (layer_idx = 2*d + k) and vLLM (extract_layer_index with
    # num_attn_module=2) number them 2*d + k, and so does mla_ext: num_layers counts MLA
    # modules (transformers' num_hidden_layers = 2 * num_layers), a layer index is 2*d + k,
    # a prefix "model.layers.{d}.self_attn.{k}" names layer 2*d + k (policy._layer_index).
    attention_per_layer: int = 1

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ValueError(f"name: expected a str (the model's name), got "
                             f"{type(self.name).__name__}")
        for arg in ("L", "P", "V", "num_heads", "num_layers", "max_model_len", "tp_size",
                    "attention_per_layer"):
            _check_int(arg, getattr(self, arg), minimum=1, where=self.name)
        if self.num_layers > MAX_NUM_LAYERS:
            raise ValueError(f"{self.name}: num_layers must be an integer <= {MAX_NUM_LAYERS} "
                             f"(models.MAX_NUM_LAYERS); got {short(self.num_layers)}")
        _check_int("R", self.R, minimum=0, where=self.name)
        if self.num_layers % self.attention_per_layer:
            raise ValueError(f"{self.name}: num_layers ({self.num_layers}) must be a multiple of "
                             f"attention_per_layer ({self.attention_per_layer})")
        _check_int("tp_rank", self.tp_rank, minimum=0, where=self.name)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"{self.name}: tp_rank must be in [0, {self.tp_size}); "
                             f"got {self.tp_rank}")
        if self.softmax_scale is None:
            base = base_scale(self.P, self.R)
            object.__setattr__(self, "softmax_scale", base.value)
            object.__setattr__(self, "softmax_scale_source", base.source)
        else:
            s = self.softmax_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) \
                    or s <= 0:
                raise ValueError(f"{self.name}: softmax_scale must be a finite number > 0; "
                                 f"got {s!r}")
            object.__setattr__(self, "softmax_scale", float(s))
            if not self.softmax_scale_source:
                object.__setattr__(self, "softmax_scale_source", "given")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(
                f"{self.name}: model_dtype must be one of torch.bfloat16, torch.float16, "
                f"torch.float32; got {self.model_dtype}"
            )
        if isinstance(self.sliding_window_layers, (str, bytes)) or \
                not hasattr(self.sliding_window_layers, "__iter__"):
            raise ValueError(f"{self.name}: sliding_window_layers must be a set of layer indices; "
                             f"got {short(self.sliding_window_layers)}")
        layers = frozenset(self.sliding_window_layers)
        bad = sorted(i for i in layers if not is_int(i) or not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(
                f"{self.name}: sliding_window_layers must be layer indices in "
                f"[0, {self.num_layers}); got {bad}"
            )
        object.__setattr__(self, "sliding_window_layers", layers)
        object.__setattr__(self, "layer_dims", self._layer_pairs("layer_dims", self.layer_dims))
        for i, d in self.layer_dims:
            if not isinstance(d, LayerDims):
                raise ValueError(f"{self.name}: layer_dims[{i}] must be a LayerDims; got "
                                 f"{type(d).__name__}")
            for arg in ("L", "P", "V", "num_heads"):
                _check_int(f"layer_dims[{i}].{arg}", getattr(d, arg), minimum=1, where=self.name)
            _check_int(f"layer_dims[{i}].R", d.R, minimum=0, where=self.name)
        src = self._layer_pairs("kv_source_layers", self.kv_source_layers)
        for i, j in src:
            if not is_int(j) or not 0 <= j < self.num_layers or j == i or j in dict(src):
                raise ValueError(f"{self.name}: kv_source_layers[{i}] must name another layer "
                                 f"that keeps its own KV; got {short(j)}")
        object.__setattr__(self, "kv_source_layers", src)
        if isinstance(self.non_mla_layers, (str, bytes)) or not hasattr(self.non_mla_layers, "__iter__"):
            raise ValueError(f"{self.name}: non_mla_layers must be a set of layer indices; got "
                             f"{short(self.non_mla_layers)}")
        others = frozenset(self.non_mla_layers)
        bad = sorted(i for i in others if not is_int(i) or not 0 <= i < self.num_layers)
        if bad or len(others) >= self.num_layers:
            raise ValueError(f"{self.name}: non_mla_layers must be layer indices in "
                             f"[0, {self.num_layers}), not all of them; got {sorted(others, key=str)}")
        object.__setattr__(self, "non_mla_layers", others)
        self._check_sparse()

    def _check_sparse(self) -> None:
        if self.sparse is None:
            if self.sparse_layers:
                raise ValueError(f"{self.name}: sparse_layers {sorted(self.sparse_layers)} given without "
                                 "a sparse (SparseConfig)")
            object.__setattr__(self, "sparse_layers", frozenset())
            return
        if not isinstance(self.sparse, SparseConfig):
            raise ValueError(f"{self.name}: sparse must be an mla_ext.config.sparse.SparseConfig or None; "
                             f"got {type(self.sparse).__name__}")
        if isinstance(self.sparse_layers, (str, bytes)) or not hasattr(self.sparse_layers, "__iter__"):
            raise ValueError(f"{self.name}: sparse_layers must be a set of layer indices; got "
                             f"{short(self.sparse_layers)}")
        mla = frozenset(range(self.num_layers)) - self.non_mla_layers
        layers = frozenset(self.sparse_layers) or mla
        bad = sorted((i for i in layers if not is_int(i) or i not in mla), key=str)
        if bad:
            raise ValueError(f"{self.name}: sparse_layers must be MLA layer indices in [0, "
                             f"{self.num_layers}); got {bad}")
        object.__setattr__(self, "sparse_layers", layers)

    def _layer_pairs(self, arg: str, value) -> tuple:
        """A {layer: x} dict (or pairs) as sorted pairs, every layer in range."""
        try:
            pairs = sorted((value.items() if isinstance(value, dict) else value), key=lambda p: p[0])
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: {arg} must be a dict {{layer: ...}}; got "
                             f"{short(value)}") from None
        bad = [i for i, _ in pairs if not is_int(i) or not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{self.name}: {arg} keys must be layer indices in "
                             f"[0, {self.num_layers}); got {bad}")
        return tuple((i, x) for i, x in pairs)

    @property
    def has_layer_dims(self) -> bool:
        """True when some layer's dims differ from the model's (see `for_layer`)."""
        return bool(self.layer_dims)

    def kv_source(self, layer: int) -> int | None:
        """The layer whose cache `layer` reads (KV sharing), or None: its own."""
        return dict(self.kv_source_layers).get(layer)

    def for_layer(self, layer: int) -> "MLAModelConfig":
        """This model as one layer sees it: that layer's L, R, P, V, heads and
        softmax scale (the model's own where the layer has no LayerDims entry)."""
        d = dict(self.layer_dims).get(layer)
        own = {} if self.sparse is None or layer in self.sparse_layers else \
            {"sparse": None, "sparse_layers": frozenset()}
        if d is None:
            return self if not self.layer_dims and not own else replace(self, layer_dims=(), **own)
        scale, source = d.softmax_scale, d.softmax_scale_source
        if scale is None:
            base = base_scale(d.P, d.R)
            scale, source = base.value, f"{base.source}, layer {layer}'s own dims"
        return replace(self, L=d.L, R=d.R, P=d.P, V=d.V, num_heads=d.num_heads, layer_dims=(),
                       softmax_scale=scale, softmax_scale_source=source or f"layer {layer}", **own)

    @property
    def E(self) -> int:
        """Cache entry width L + R."""
        return self.L + self.R

    @property
    def total_heads(self) -> int:
        """Attention heads of the whole model (all tensor-parallel ranks)."""
        return self.num_heads * self.tp_size

    def shard(self, tp_size: int, rank: int) -> "MLAModelConfig":
        """This model as tensor-parallel rank `rank` of `tp_size` sees it: heads
        [rank*n, (rank+1)*n) with n = num_heads / tp_size (SPEC §10). Everything
        else (dims, scale, dtype, layers) is the model's."""
        if self.tp_size != 1:
            raise ValueError(f"{self.name}: already a tensor-parallel shard "
                             f"(rank {self.tp_rank} of {self.tp_size}); shard the full config")
        _check_int("tp_size", tp_size, minimum=1, where=self.name)
        _check_int("rank", rank, minimum=0, where=self.name)
        if self.num_heads % tp_size:
            raise ValueError(f"{self.name}: tp_size must divide num_heads={self.num_heads}; "
                             f"got {tp_size}")
        if rank >= tp_size:
            raise ValueError(f"{self.name}: rank must be in [0, {tp_size}); got {rank}")
        for i, d in self.layer_dims:
            if d.num_heads % tp_size:
                raise ValueError(f"{self.name}: tp_size must divide layer {i}'s "
                                 f"num_heads={d.num_heads}; got {tp_size}")
        dims = tuple((i, replace(d, num_heads=d.num_heads // tp_size)) for i, d in self.layer_dims)
        return replace(self, num_heads=self.num_heads // tp_size, tp_size=tp_size, tp_rank=rank,
                       layer_dims=dims)

    def describe(self) -> str:
        """Dims, heads, dtype and softmax scale, each with where it came from."""
        tp = f" (TP rank {self.tp_rank} of {self.tp_size}, {self.total_heads} in all)" \
            if self.tp_size > 1 else ""
        return (
            f"{self.name}: L={self.L} R={self.R} P={self.P} V={self.V}, {self.num_heads} heads{tp}, "
            f"{self.num_layers} layers, max_model_len {self.max_model_len}\n"
            f"  model dtype {str(self.model_dtype).removeprefix('torch.')} ({self.dtype_source})\n"
            f"  softmax scale {self.softmax_scale:.5f}: {self.softmax_scale_source}"
            + "".join(f"\n  layer{'s' if len(ix) > 1 else ''} {_ranges(ix)}: L={d.L} R={d.R} "
                      f"P={d.P} V={d.V}, {d.num_heads} heads, softmax scale {d.softmax_scale or 0:.5f}"
                      for d, ix in _grouped(self.layer_dims))
            + "".join(f"\n  layer {i}: reads layer {j}'s KV cache (KV sharing)"
                      for i, j in self.kv_source_layers)
            + (f"\n  layers {_ranges(sorted(self.non_mla_layers))}: not MLA (linear attention), "
               "no MLA cache" if self.non_mla_layers else "")
            + (f"\n  layers {_ranges(sorted(self.sparse_layers))}: {self.sparse.describe()}"
               if self.sparse is not None else "")
            + (f"\n  config read by {self.reader}" if self.reader else "")
        )


def _grouped(pairs) -> list[tuple]:
    """[(value, [layers])] for (layer, value) pairs, equal values together."""
    groups: dict = {}
    for i, d in pairs:  # the scale's source names its layer: group without it
        groups.setdefault(replace(d, softmax_scale_source=""), []).append(i)
    return list(groups.items())


def _ranges(ix: list[int]) -> str:
    """[2, 3, 4, 7] -> "2-4 7"."""
    out, start = [], None
    for k, i in enumerate(ix):
        if start is None:
            start = i
        if k + 1 == len(ix) or ix[k + 1] != i + 1:
            out.append(f"{start}-{i}" if i > start else f"{i}")
            start = None
    return " ".join(out)


def _check_int(arg: str, value, minimum: int, where: str) -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{where}: {arg} must be an integer >= {minimum}; got {short(value)}")


# The built-in models are excerpts of their real config.json, read by the same
# reader as a user's file, so their softmax scale is derived, not typed in.
_DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "num_attention_heads": 128, "num_hidden_layers": 61, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}
_BUILTIN_JSON = {
    "deepseek-v2-lite": {
        **_DEEPSEEK_V3_JSON, "model_type": "deepseek_v2", "num_attention_heads": 16, "num_hidden_layers": 27,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1},
    },
    "deepseek-v3": _DEEPSEEK_V3_JSON,
    # R1 is a DeepSeek-V3 checkpoint: same architecture, listed under its own name.
    "deepseek-r1": _DEEPSEEK_V3_JSON,
    # DeepSeek-V3.2(-Exp): V3's attention and yarn, plus the DSA indexer (dense
    # attention equals it only up to index_topk keys per query).
    "deepseek-v3.2": {**_DEEPSEEK_V3_JSON, "model_type": "deepseek_v32", "index_topk": 2048,
                      "index_n_heads": 64, "index_head_dim": 128},
    # One per transformers MLA family: mla_ext/config/builtin_configs.py.
    **FAMILY_BUILTINS,
    "kimi-k2": {
        **_DEEPSEEK_V3_JSON, "num_attention_heads": 64, "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                         "beta_slow": 1.0},
    },
}


def known_model_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def get_model_config(name_or_path: str | os.PathLike) -> MLAModelConfig:
    """A built-in config by name (case-insensitive, '_' or '-'), or one read from a
    local HF `config.json` (the file itself or the directory holding it)."""
    if isinstance(name_or_path, MLAModelConfig):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(
            f"model: expected a model name or a path to config.json, got "
            f"{type(name_or_path).__name__}"
        )
    text = os.fspath(name_or_path)
    key = text.strip().lower().replace("_", "-")
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if os.path.isfile(path):
        return load_hf_config(path)
    raise ValueError(
        f"model: {text!r} is neither a known model nor an existing config.json "
        f"(or a directory holding one); known models: {', '.join(known_model_names())}"
    )


def load_hf_config(path: str | os.PathLike) -> MLAModelConfig:
    """MLA dims from a HF `config.json`; a ValueError naming the file and every missing key."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path: expected a path to config.json (str or os.PathLike), got "
                         f"{type(path).__name__}")
    path = os.fspath(path)
    try:
        size = os.stat(path).st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"model config {path}: {size:,} bytes, more than the "
                             f"{MAX_CONFIG_BYTES:,} of any config.json; not read")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as exc:
        raise ValueError(f"model config {path}: cannot read JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"model config {path}: cannot read JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 5,000 digits
        if str(exc).startswith(f"model config {path}:"):
            raise
        raise ValueError(f"model config {path}: cannot read JSON ({type(exc).__name__}: "
                         f"{exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model config {path}: expected a JSON object at top level")
    return config_from_dict(raw, name=path)


def config_from_dict(raw, name: str = "") -> MLAModelConfig:
    """The MLA model a raw config describes (a config.json dict, or a transformers
    PretrainedConfig). A config of a transformers MLA family is read by that family's
    own config class where transformers is importable (mla_ext.config.hf_reader: its
    defaults, spellings, layer patterns and refusals), else by mla_ext's reader
    (mla_ext.config.dict_reader), which reads the same; other configs by mla_ext's reader."""
    if not isinstance(raw, dict) and callable(getattr(raw, "to_dict", None)) \
            and hasattr(raw, "model_type"):
        return config_from_hf(raw, name)
    if not isinstance(raw, dict):
        raise ValueError(f"model config {name}: expected a JSON object (dict) or a transformers "
                         f"config, got {type(raw).__name__}")
    if not isinstance(name, str):
        raise ValueError(f"name: expected a str (the model's name), got {type(name).__name__}")
    raw = text_dict(raw)
    family = family_of(raw.get("model_type"))
    precheck(raw, family, name)
    if family is not None and transformers_reader_enabled():
        facts = facts_from_hf(hf_config_from_dict(raw, family, name), family, name)
    else:
        facts = facts_from_dict(raw, family, name)
    dtype, dtype_source = _model_dtype(raw, name)
    return _assemble(name, facts, dtype, dtype_source)


def config_from_hf(cfg, name: str = "") -> MLAModelConfig:
    """The MLA model of a transformers config object (e.g. `module.config`): read from
    the object itself for a family's config, from its to_dict() otherwise."""
    if not callable(getattr(cfg, "to_dict", None)) or not hasattr(cfg, "model_type"):
        raise ValueError(f"cfg: expected a transformers PretrainedConfig (with model_type and "
                         f"to_dict), got {type(cfg).__name__}")
    get_text = getattr(cfg, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else cfg
    family = family_of(getattr(text, "model_type", None)) or family_of(getattr(cfg, "model_type", None))
    name = name or f"{getattr(cfg, 'model_type', '')} {getattr(cfg, 'name_or_path', '')}".strip()
    if family is None or not transformers_reader_enabled():
        return config_from_dict(cfg.to_dict(), name)
    facts = facts_from_hf(cfg, family, name)
    dtype = getattr(text, "dtype", None)
    if isinstance(dtype, torch.dtype):
        dtype, dtype_source = (dtype, "config dtype") if dtype in MODEL_DTYPES else \
            (_parse_dtype(str(dtype), name, "dtype"), "config dtype")
    else:
        dtype, dtype_source = _model_dtype({"dtype": dtype}, name)
    return _assemble(name, facts, dtype, dtype_source)


def _assemble(name: str, facts, dtype: torch.dtype, dtype_source: str) -> MLAModelConfig:
    """The MLAModelConfig of either reader's facts: the model's dims and scale are its
    first full (not sliding) MLA layer's; layers that differ get their own LayerDims.
    A no-rope layer (mistral_large4) moves its rope width into P and keeps its scale:
    transformers' module keeps qk_head_dim and widens q_pass/k_pass."""
    layers = facts.layers
    mla = [i for i, f in enumerate(layers) if f.mla]
    if not mla:
        raise ValueError(f"model config {name}: no MLA layer (every layer_types entry is linear attention)")
    main = next((i for i in mla if not layers[i].sliding), mla[0])

    def dims(f):
        P, R = (f.P, f.R) if f.rope else (f.P + f.R, 0)
        return f.L, R, P, f.V, f.num_heads

    model, top = layers[main], dims(layers[main])
    layer_dims = {}
    for i in mla:
        f = layers[i]
        if dims(f) != top or not math.isclose(f.scale.value, model.scale.value, rel_tol=1e-12):
            note = "" if f.rope else " (no rope: the rope width joins P, the scale stays)"
            layer_dims[i] = LayerDims(*dims(f), softmax_scale=f.scale.value,
                                      softmax_scale_source=f"layer {i}: {f.scale.source}{note}")
    sparse = None
    if facts.sparse is not None and facts.sparse_layers:  # (no layer with an indexer: dense)
        sparse = SparseConfig.from_facts(facts.sparse, name)
    L, R, P, V, heads = top
    return MLAModelConfig(
        name=name, L=L, R=R, P=P, V=V, num_heads=heads, num_layers=len(layers),
        max_model_len=facts.max_model_len, model_dtype=dtype, dtype_source=dtype_source,
        sliding_window_layers=frozenset(i for i, f in enumerate(layers) if f.sliding),
        softmax_scale=model.scale.value, softmax_scale_source=model.scale.source,
        layer_dims=layer_dims, kv_source_layers=facts.kv_sources,
        non_mla_layers=frozenset(i for i, f in enumerate(layers) if not f.mla),
        sparse=sparse, sparse_layers=facts.sparse_layers if sparse is not None else frozenset(),
        reader=facts.reader, attention_per_layer=facts.attention_per_layer)


def _model_dtype(raw: dict, name: str) -> tuple[torch.dtype, str]:
    # transformers 4 writes torch_dtype, transformers 5 writes dtype.
    for key in ("torch_dtype", "dtype"):
        if raw.get(key) is not None:
            return _parse_dtype(raw[key], name, key), f"config {key}"
    return torch.bfloat16, "assumed: the config has neither torch_dtype nor dtype"


def _parse_dtype(value, name: str, key: str = "torch_dtype") -> torch.dtype:
    if isinstance(value, str):
        dtype = _DTYPE_NAMES.get(value.removeprefix("torch.").lower())
        if dtype is not None:
            return dtype
    raise ValueError(
        f"model config {name}: {key} must be one of {sorted(_DTYPE_NAMES)}; got {short(value)}"
    )


def sliding_window_layers_from_dict(raw: dict, num_layers: int, name: str) -> frozenset:
    """Which layers of a config of no transformers family have a sliding window
    (mla_ext.config.dict_reader.sliding_window_layers_from_dict: the HF conventions)."""
    return config_dict.sliding_window_layers_from_dict(raw, num_layers, name)


class _Builtins(Mapping):
    """The built-in configs by name, each read on first use (through transformers
    where it is importable: reading all of them at import would import it)."""

    def __init__(self, raws: dict):
        self._raws, self._done = raws, {}

    def __getitem__(self, key: str) -> MLAModelConfig:
        if key not in self._done:
            self._done[key] = config_from_dict(self._raws[key], name=key)
        return self._done[key]

    def __iter__(self):
        return iter(self._raws)

    def __len__(self) -> int:
        return len(self._raws)


BUILTIN_MODELS: Mapping[str, MLAModelConfig] = _Builtins(_BUILTIN_JSON)
