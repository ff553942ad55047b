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
from dataclasses import dataclass, field, replace

import torch

from mla_ext.builtin_configs import FAMILY_BUILTINS
from mla_ext.families import family_of
from mla_ext.formats import MODEL_DTYPES
from mla_ext.softmax_scale import base_scale, scale_from_config

# Layer counts bound loops (per-layer specs, plans, sliding-window sets), so a
# corrupt config (num_hidden_layers: 10**9) must fail at once rather than hang.
# Released MLA models have well under a hundred (DeepSeek-V2-Lite 27, DeepSeek-V3/R1
# and Kimi-K2 61); 1024 leaves an order of magnitude of room.
MAX_NUM_LAYERS = 1024
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

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ValueError(f"name: expected a str (the model's name), got "
                             f"{type(self.name).__name__}")
        for arg in ("L", "P", "V", "num_heads", "num_layers", "max_model_len", "tp_size"):
            _check_int(arg, getattr(self, arg), minimum=1, where=self.name)
        if self.num_layers > MAX_NUM_LAYERS:
            raise ValueError(f"{self.name}: num_layers must be an integer <= {MAX_NUM_LAYERS} "
                             f"(models.MAX_NUM_LAYERS); got {_short(self.num_layers)}")
        _check_int("R", self.R, minimum=0, where=self.name)
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
                             f"got {_short(self.sliding_window_layers)}")
        layers = frozenset(self.sliding_window_layers)
        bad = sorted(i for i in layers if not _is_int(i) or not 0 <= i < self.num_layers)
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
            if not _is_int(j) or not 0 <= j < self.num_layers or j == i or j in dict(src):
                raise ValueError(f"{self.name}: kv_source_layers[{i}] must name another layer "
                                 f"that keeps its own KV; got {_short(j)}")
        object.__setattr__(self, "kv_source_layers", src)
        if isinstance(self.non_mla_layers, (str, bytes)) or not hasattr(self.non_mla_layers, "__iter__"):
            raise ValueError(f"{self.name}: non_mla_layers must be a set of layer indices; got "
                             f"{_short(self.non_mla_layers)}")
        others = frozenset(self.non_mla_layers)
        bad = sorted(i for i in others if not _is_int(i) or not 0 <= i < self.num_layers)
        if bad or len(others) >= self.num_layers:
            raise ValueError(f"{self.name}: non_mla_layers must be layer indices in "
                             f"[0, {self.num_layers}), not all of them; got {sorted(others, key=str)}")
        object.__setattr__(self, "non_mla_layers", others)

    def _layer_pairs(self, arg: str, value) -> tuple:
        """A {layer: x} dict (or pairs) as sorted pairs, every layer in range."""
        try:
            pairs = sorted((value.items() if isinstance(value, dict) else value), key=lambda p: p[0])
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: {arg} must be a dict {{layer: ...}}; got "
                             f"{_short(value)}") from None
        bad = [i for i, _ in pairs if not _is_int(i) or not 0 <= i < self.num_layers]
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
        if d is None:
            return self if not self.layer_dims else replace(self, layer_dims=())
        scale, source = d.softmax_scale, d.softmax_scale_source
        if scale is None:
            base = base_scale(d.P, d.R)
            scale, source = base.value, f"{base.source}, layer {layer}'s own dims"
        return replace(self, L=d.L, R=d.R, P=d.P, V=d.V, num_heads=d.num_heads, layer_dims=(),
                       softmax_scale=scale, softmax_scale_source=source or f"layer {layer}")

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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(arg: str, value, minimum: int, where: str) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{where}: {arg} must be an integer >= {minimum}; got {_short(value)}")


# The built-in models are excerpts of their real config.json, read by the same
# reader as a user's file, so their softmax scale is derived, not typed in.
_DEEPSEEK_V3_JSON = {
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "num_attention_heads": 128, "num_hidden_layers": 61, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}
_BUILTIN_JSON = {
    "deepseek-v2-lite": {
        **_DEEPSEEK_V3_JSON, "num_attention_heads": 16, "num_hidden_layers": 27,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1},
    },
    "deepseek-v3": _DEEPSEEK_V3_JSON,
    # R1 is a DeepSeek-V3 checkpoint: same architecture, listed under its own name.
    "deepseek-r1": _DEEPSEEK_V3_JSON,
    # DeepSeek-V3.2(-Exp): V3's attention and yarn, plus the DSA indexer (dense
    # attention equals it only up to index_topk keys per query).
    "deepseek-v3.2": {**_DEEPSEEK_V3_JSON, "model_type": "deepseek_v32", "index_topk": 2048},
    # One per transformers MLA family: mla_ext/builtin_configs.py.
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


_REQUIRED_KEYS = {
    "L": "kv_lora_rank",
    "R": "qk_rope_head_dim",
    "P": "qk_nope_head_dim",
    "V": "v_head_dim",
    "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers",
    "max_model_len": "max_position_embeddings",
}


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


# Other spellings of a required key in published configs: LongCat-Flash writes
# num_layers, Kimi-Linear and Bailing-hybrid model_max_length.
_ALIASES = {"num_hidden_layers": ("num_layers",),
            "max_position_embeddings": ("model_max_length",)}


def _with_aliases(raw: dict) -> dict:
    out = dict(raw)
    for key, others in _ALIASES.items():
        if out.get(key) is None:
            for other in others:
                if out.get(other) is not None:
                    out[key] = out[other]
                    break
    return out


def config_from_dict(raw: dict, name: str) -> MLAModelConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"model config {name}: expected a JSON object (dict), got "
                         f"{type(raw).__name__}")
    # Multimodal checkpoints (e.g. Kimi-VL style, dots3_note, glm5_next,
    # mistral_large4) keep the language model's fields under text_config.
    if "kv_lora_rank" not in raw and isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}
    raw = _with_aliases(raw)
    missing = [k for k in _REQUIRED_KEYS.values() if raw.get(k) is None]
    if missing:
        raise ValueError(
            f"model config {name}: missing or null keys {missing} "
            "(an MLA config needs all of " + ", ".join(_REQUIRED_KEYS.values()) + ")"
        )
    dims = {}
    for arg, key in _REQUIRED_KEYS.items():
        value = raw[key]
        if not _is_int(value):
            raise ValueError(f"model config {name}: {key} must be an integer; got "
                             f"{_short(value)}")
        dims[arg] = value
    # Before anything loops over the layers (sliding_window_layers_from_dict).
    if not 1 <= dims["num_layers"] <= MAX_NUM_LAYERS:
        raise ValueError(f"model config {name}: num_hidden_layers must be an integer >= 1 "
                         f"and <= {MAX_NUM_LAYERS} (models.MAX_NUM_LAYERS); got "
                         f"{_short(dims['num_layers'])}")
    dtype, dtype_source = _model_dtype(raw, name)
    family = family_of(raw.get("model_type"))
    types = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else None
    main_type = _main_layer_type(types)
    scale = scale_from_config(raw, dims["P"], dims["R"], name, layer_type=main_type, family=family)
    sliding = sliding_window_layers_from_dict(raw, dims["num_layers"], name)
    layer_dims = _layer_dims_from_dict(raw, dims, scale.value, name, family)
    sources = _kv_sources_from_dict(raw, dims["num_layers"], name)
    # layer_types is checked (a list of num_layers entries) by sliding_window_layers_from_dict.
    others = frozenset(i for i, t in enumerate(types or ()) if "linear" in str(t).lower())
    return MLAModelConfig(name=name, model_dtype=dtype, sliding_window_layers=sliding,
                          softmax_scale=scale.value, softmax_scale_source=scale.source,
                          dtype_source=dtype_source, layer_dims=layer_dims,
                          kv_source_layers=sources, non_mla_layers=others, **dims)


def _main_layer_type(types) -> str | None:
    """The layer type whose rope parameters give the model's own scale: the first
    type that is not a sliding window (dots3_note: "indexed_attention")."""
    if not types:
        return None
    full = [t for t in types if "sliding" not in str(t)]
    return str((full or types)[0])


# Per-layer overrides in a config's per_layer_config (dots3_note) -> our dims.
_PER_LAYER_KEYS = {"L": "kv_lora_rank", "R": "qk_rope_head_dim", "P": "qk_nope_head_dim",
                   "V": "v_head_dim", "num_heads": "num_attention_heads"}


def _layer_dims_from_dict(raw: dict, dims: dict, model_scale: float, name: str, family) -> dict:
    """{layer: LayerDims} for the layers whose dims or scale differ from the model's:
    `per_layer_config` entries (dots3_note's sliding layers), `no_rope_layers`
    zeros (mistral_large4, smollm3 convention: 1 = rope; a no-rope layer moves the
    rope width into P and keeps the model's scale), and per-layer-type
    `rope_parameters` that give a layer type another softmax scale."""
    n = dims["num_layers"]
    per_layer = raw.get("per_layer_config")
    if per_layer is not None and not isinstance(per_layer, dict):
        raise ValueError(f"model config {name}: per_layer_config must be an object {{layer: "
                         f"{{key: value}}}}; got {_short(per_layer)}")
    per_layer = per_layer or {}
    no_rope = raw.get("no_rope_layers")
    if no_rope is not None and (not isinstance(no_rope, list) or len(no_rope) < n
                                or not all(v in (0, 1) for v in no_rope)):
        raise ValueError(f"model config {name}: no_rope_layers must be a list of {n} entries "
                         f"0 (no rope) or 1 (rope); got {_short(no_rope)}")
    types = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else None
    out = {}
    for i in range(n):
        over = per_layer.get(str(i), per_layer.get(f"{i:02d}", per_layer.get(i)))
        if over is not None and not isinstance(over, dict):
            raise ValueError(f"model config {name}: per_layer_config[{i}] must be an object; got "
                             f"{_short(over)}")
        d = dict(dims)
        if isinstance(over, dict):
            for arg, key in _PER_LAYER_KEYS.items():
                if over.get(key) is not None:
                    if not _is_int(over[key]):
                        raise ValueError(f"model config {name}: per_layer_config[{i}].{key} must "
                                         f"be an integer; got {_short(over[key])}")
                    d[arg] = over[key]
        scale, source = None, ""
        layer_type = str(types[i]) if types and i < len(types) else None
        if isinstance(over, dict) or (layer_type and layer_type != _main_layer_type(types)):
            s = scale_from_config(raw, d["P"], d["R"], name, layer_type=layer_type, family=family)
            scale, source = s.value, f"layer {i}: {s.source}"
        if isinstance(no_rope, list) and i < len(no_rope) and no_rope[i] == 0 and d["R"]:
            # transformers keeps qk_head_dim (so the scale) and widens q_pass/k_pass.
            d["P"], d["R"] = d["P"] + d["R"], 0
            scale, source = scale or model_scale, source or f"layer {i}: no rope, the model's scale"
        changed = any(d[k] != dims[k] for k in _PER_LAYER_KEYS)
        if changed or (scale is not None and not math.isclose(scale, model_scale, rel_tol=1e-12)):
            out[i] = LayerDims(d["L"], d["R"], d["P"], d["V"], d["num_heads"],
                               softmax_scale=scale, softmax_scale_source=source)
    return out


def _kv_sources_from_dict(raw: dict, num_layers: int, name: str) -> dict:
    """{layer: source} from `kv_source_layers` (mistral_large4: each layer's entry
    names the layer whose latent cache it reads; its own index = its own cache)."""
    src = raw.get("kv_source_layers")
    if src is None:
        return {}
    if not isinstance(src, list) or len(src) != num_layers or not all(_is_int(j) for j in src):
        raise ValueError(f"model config {name}: kv_source_layers must be a list of "
                         f"{num_layers} layer indices; got {_short(src)}")
    return {i: j for i, j in enumerate(src) if j != i}


def _short(value) -> str:
    """repr of a config value, cut to a readable length (an int of 5,000 digits
    cannot even be printed: Python refuses str() of it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
        f"model config {name}: {key} must be one of {sorted(_DTYPE_NAMES)}; got {_short(value)}"
    )


def sliding_window_layers_from_dict(raw: dict, num_layers: int, name: str) -> frozenset:
    """Which layers have a sliding window, from the HF conventions in use:

    - `layer_types`: one entry per layer; "sliding_attention" (any entry naming
      "sliding") marks a windowed layer (newer transformers configs);
    - otherwise a non-null `sliding_window` (and `use_sliding_window` not false):
      with `max_window_layers` the layers at or above it are windowed (Qwen2
      convention), with `sliding_window_pattern` n every layer except each n-th
      (Gemma convention), else every layer.
    """
    if not _is_int(num_layers) or not 1 <= num_layers <= MAX_NUM_LAYERS:
        raise ValueError(f"model config {name}: num_hidden_layers must be an integer >= 1 "
                         f"and <= {MAX_NUM_LAYERS}; got {_short(num_layers)}")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(
                f"model config {name}: layer_types must be a list of {num_layers} entries "
                f"(num_hidden_layers); got {_short(types)}"
            )
        return frozenset(i for i, t in enumerate(types) if "sliding" in str(t).lower())
    if raw.get("sliding_window") is None or raw.get("use_sliding_window") is False:
        return frozenset()
    first = raw.get("max_window_layers")
    if first is not None:
        if not _is_int(first) or first < 0:
            raise ValueError(
                f"model config {name}: max_window_layers must be an integer >= 0; got {_short(first)}"
            )
        return frozenset(range(min(first, num_layers), num_layers))
    pattern = raw.get("sliding_window_pattern")
    if pattern is not None:
        if not _is_int(pattern) or pattern < 1:
            raise ValueError(
                f"model config {name}: sliding_window_pattern must be an integer >= 1; "
                f"got {_short(pattern)}"
            )
        return frozenset(i for i in range(num_layers) if (i + 1) % pattern != 0)
    return frozenset(range(num_layers))


BUILTIN_MODELS: dict[str, MLAModelConfig] = {
    name: config_from_dict(raw, name=name) for name, raw in _BUILTIN_JSON.items()
}
