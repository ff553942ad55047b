"""MLA model dimensions: built-in configurations and a reader for HF `config.json`.

Only what the KV-cache policy, the planner and the kernels need: latent and
rope widths (L, R), head dims (P, V), heads, layer count, which layers have a
sliding window (for the `sliding_window` skip entry of SPEC §3), the model
dtype and the maximum model length.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from mla_ext.formats import MODEL_DTYPES

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
class MLAModelConfig:
    """The dimensions of one MLA model (symbols as in SPEC §0)."""

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

    def __post_init__(self):
        for arg in ("L", "P", "V", "num_heads", "num_layers", "max_model_len"):
            _check_int(arg, getattr(self, arg), minimum=1, where=self.name)
        _check_int("R", self.R, minimum=0, where=self.name)
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(
                f"{self.name}: model_dtype must be one of torch.bfloat16, torch.float16, "
                f"torch.float32; got {self.model_dtype}"
            )
        layers = frozenset(self.sliding_window_layers)
        bad = sorted(i for i in layers if not _is_int(i) or not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(
                f"{self.name}: sliding_window_layers must be layer indices in "
                f"[0, {self.num_layers}); got {bad}"
            )
        object.__setattr__(self, "sliding_window_layers", layers)

    @property
    def E(self) -> int:
        """Cache entry width L + R."""
        return self.L + self.R


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(arg: str, value, minimum: int, where: str) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{where}: {arg} must be an integer >= {minimum}; got {value!r}")


_DEEPSEEK_V3 = dict(L=512, R=64, P=128, V=128, num_layers=61, max_model_len=163840)

BUILTIN_MODELS: dict[str, MLAModelConfig] = {
    c.name: c
    for c in (
        MLAModelConfig("deepseek-v2-lite", L=512, R=64, P=128, V=128, num_heads=16,
                       num_layers=27, max_model_len=163840),
        MLAModelConfig("deepseek-v3", num_heads=128, **_DEEPSEEK_V3),
        # R1 is a DeepSeek-V3 checkpoint: same architecture, listed under its own name.
        MLAModelConfig("deepseek-r1", num_heads=128, **_DEEPSEEK_V3),
        MLAModelConfig("kimi-k2", num_heads=64,
                       **{**_DEEPSEEK_V3, "max_model_len": 131072}),
    )
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
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model config {path}: cannot read JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model config {path}: expected a JSON object at top level")
    return config_from_dict(raw, name=path)


def config_from_dict(raw: dict, name: str) -> MLAModelConfig:
    # Multimodal checkpoints (e.g. Kimi-VL style) keep the language model's
    # fields under text_config; the MLA dims live there.
    if "kv_lora_rank" not in raw and isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}
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
            raise ValueError(f"model config {name}: {key} must be an integer; got {value!r}")
        dims[arg] = value
    dtype = _parse_dtype(raw.get("torch_dtype", raw.get("dtype", "bfloat16")), name)
    sliding = sliding_window_layers_from_dict(raw, dims["num_layers"], name)
    return MLAModelConfig(name=name, model_dtype=dtype, sliding_window_layers=sliding, **dims)


def _parse_dtype(value, name: str) -> torch.dtype:
    if isinstance(value, str):
        dtype = _DTYPE_NAMES.get(value.removeprefix("torch.").lower())
        if dtype is not None:
            return dtype
    raise ValueError(
        f"model config {name}: torch_dtype must be one of {sorted(_DTYPE_NAMES)}; got {value!r}"
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
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(
                f"model config {name}: layer_types must be a list of {num_layers} entries "
                f"(num_hidden_layers); got {types!r}"
            )
        return frozenset(i for i, t in enumerate(types) if "sliding" in str(t).lower())
    if raw.get("sliding_window") is None or raw.get("use_sliding_window") is False:
        return frozenset()
    first = raw.get("max_window_layers")
    if first is not None:
        if not _is_int(first) or first < 0:
            raise ValueError(
                f"model config {name}: max_window_layers must be an integer >= 0; got {first!r}"
            )
        return frozenset(range(min(first, num_layers), num_layers))
    pattern = raw.get("sliding_window_pattern")
    if pattern is not None:
        if not _is_int(pattern) or pattern < 1:
            raise ValueError(
                f"model config {name}: sliding_window_pattern must be an integer >= 1; "
                f"got {pattern!r}"
            )
        return frozenset(i for i in range(num_layers) if (i + 1) % pattern != 0)
    return frozenset(range(num_layers))
