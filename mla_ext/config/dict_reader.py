"""mla_ext's own reader of a raw model config (dict): the fallback where transformers
is not importable, and the reader of configs of no transformers MLA family.

For a family config it reads what transformers 5.23's config class of that family
would (mla_ext.config.hf_reader reads through that class itself; tests/config/test_config_readers.py
holds the two equal): the family's defaults where a key is absent (layer patterns,
no-rope layers, rope parameters, DSA fields), the checkpoints' spellings transformers
normalises (kimi_linear's linear_attn_config, bailing_hybrid's layer_group_size,
dots3_note's swa_* and use_dsa, longcat_flash's num_layers, legacy layer-type names,
rope_scaling over rope_parameters, type -> rope_type), and what its modules read
(only mistral_large4's reads no_rope_layers and kv_source_layers). `precheck` runs
before either reader: what mla_ext refuses whichever reader reads.
"""
from __future__ import annotations

import copy

from mla_ext.config.facts import ALLOWED_LAYER_TYPES, LEGACY_LAYER_TYPES, ConfigFacts, LayerFacts
from mla_ext.config.softmax_scale import module_scale, scale_from_config
from mla_ext.config.softmax_scale import nested_rope_keys

# Layer counts bound loops (per-layer specs, plans, sliding-window sets), so a
# corrupt config (num_hidden_layers: 10**9) must fail at once rather than hang.
# Released MLA models have well under a hundred (DeepSeek-V2-Lite 27, DeepSeek-V3/R1
# and Kimi-K2 61); 1024 leaves an order of magnitude of room.
MAX_NUM_LAYERS = 1024

# A head dim, latent rank or head count past this is no model's (DeepSeek-V3: L=512,
# 128 heads) but a corrupt value, refused before anything sizes a tensor by it.
MAX_DIM = 1 << 16

REQUIRED_KEYS = {
    "L": "kv_lora_rank",
    "R": "qk_rope_head_dim",
    "P": "qk_nope_head_dim",
    "V": "v_head_dim",
    "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers",
    "max_model_len": "max_position_embeddings",
}
# Per-layer overrides in a config's per_layer_config -> our dims.
PER_LAYER_KEYS = {"L": "kv_lora_rank", "R": "qk_rope_head_dim", "P": "qk_nope_head_dim",
                  "V": "v_head_dim", "num_heads": "num_attention_heads"}
SPARSE_KEYS = ("index_topk", "index_n_heads", "index_head_dim")

# Other spellings of a required key: LongCat-Flash writes num_layers (its decoder
# layers, two MLA sublayers each), Kimi-Linear and Bailing-hybrid model_max_length
# (their config classes map max_position_embeddings to it). A config of no family
# may use either.
_ALIASES = {"num_hidden_layers": ("num_layers",), "max_position_embeddings": ("model_max_length",)}
_FAMILY_ALIASES = {"longcat_flash": {"num_hidden_layers": ("num_layers",)},
                   "kimi_linear": {"max_position_embeddings": ("model_max_length",)},
                   "bailing_hybrid": {"max_position_embeddings": ("model_max_length",)}}
# Keys a family's config class derives when absent or null (so a config may omit them).
_DERIVED = {"minicpm3": {"v_head_dim"}}

# transformers 5.23's defaults that enter the per-layer facts, per family (the config
# classes' dataclass defaults and __post_init__).
_YARN_MISTRAL4 = {"type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                  "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                  "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
_YARN_MISTRAL_LARGE4 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0,
                        "original_max_position_embeddings": 512, "beta_fast": 32.0,
                        "beta_slow": 1.0, "attention_factor": 1.0}
_DEFAULT_ROPE = {"mistral4": _YARN_MISTRAL4, "mistral_large4": _YARN_MISTRAL_LARGE4}
# index_n_heads defaults (index_topk 2048 and index_head_dim 128 in every one).
_INDEX_HEADS = {"deepseek_v32": 64, "axk2": 16, "dots3_note": 64, "glm5_next": 32,
                "glm_moe_dsa": 32, "hy_v4": 16, "mistral_large4": 32}
# The families whose every layer is DSA unless layer_types says otherwise.
_ALL_INDEXED = {"deepseek_v32", "axk2", "glm_moe_dsa", "hy_v4", "mistral_large4"}
# dots3_note's sliding-window layers when the config has no per_layer_config (swa_* keys).
_DOTS3_SWA = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024,
              "kv_lora_rank": 1024, "head_dim": 256, "qk_nope_head_dim": 192, "v_head_dim": 128}


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def short(value) -> str:
    """repr of a config value, cut to a readable length (an int of 5,000 digits
    cannot even be printed: Python refuses str() of it)."""
    if is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def text_dict(raw: dict) -> dict:
    """The language model's config: multimodal checkpoints (Kimi-VL style, dots3_note,
    glm5_next, mistral_large4) keep its fields under text_config; those win."""
    if "kv_lora_rank" not in raw and isinstance(raw.get("text_config"), dict):
        out = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config", "audio_config")}
        return {**out, **raw["text_config"]}
    return raw


def _spellings(key: str, family) -> tuple:
    if family is None:
        return (key,) + _ALIASES.get(key, ())
    return (key,) + _FAMILY_ALIASES.get(family.model_type, {}).get(key, ())


def _get(raw: dict, key: str, family):
    for k in _spellings(key, family):
        if raw.get(k) is not None:
            return k, raw[k]
    return key, None


def precheck(raw: dict, family, name: str) -> None:
    """What mla_ext refuses whichever reader reads: an MLA config states its MLA dims
    (transformers would fill a family default in: a guess about the checkpoint), as
    integers in range; layer patterns transformers would misread (longcat_flash's odd
    layer counts, kimi_linear's layer numbers out of range)."""
    derived = _DERIVED.get(family.model_type, set()) if family else set()
    missing = [k for k in REQUIRED_KEYS.values() if k not in derived and _get(raw, k, family)[1] is None]
    if missing:
        raise ValueError(f"model config {name}: missing or null keys {missing} (an MLA config needs all "
                         "of " + ", ".join(REQUIRED_KEYS.values()) + ")")
    for arg, key in REQUIRED_KEYS.items():
        spelled, value = _get(raw, key, family)
        if value is None:
            continue
        if not is_int(value):
            raise ValueError(f"model config {name}: {spelled} must be an integer; got {short(value)}")
        if arg not in ("num_layers", "max_model_len"):
            check_dim(spelled, value, name, low=0 if arg == "R" else 1)
        elif value < 1:
            raise ValueError(f"model config {name}: {spelled} must be an integer >= 1; got {short(value)}")
    n = num_layers(raw, family, name)
    if not 1 <= n <= MAX_NUM_LAYERS:
        raise ValueError(f"model config {name}: num_hidden_layers must be an integer >= 1 and <= "
                         f"{MAX_NUM_LAYERS} (models.MAX_NUM_LAYERS); got {short(n)}")
    if family is not None and family.model_type == "longcat_flash":
        _check_longcat(raw, name)
    if family is not None and family.model_type == "kimi_linear":
        _kimi_layer_types(raw, n, name)  # its checks
    if family is not None and family.reads_kv_source_layers and raw.get("kv_source_layers") is not None:
        check_kv_sources(raw["kv_source_layers"], n, name)
    if family is not None and family.reads_no_rope_layers and raw.get("no_rope_layers") is not None:
        check_no_rope(raw["no_rope_layers"], n, name)
    if family is not None:
        _check_patterns(raw, family, n, name)
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"model config {name}: {key} must be an object (dict) or null; got "
                             f"{short(raw[key])}")


def check_dim(key: str, value, name: str, low: int = 1) -> None:
    if not is_int(value) or not low <= value <= MAX_DIM:
        raise ValueError(f"model config {name}: {key} must be an integer in [{low}, {MAX_DIM}] "
                         f"(config_dict.MAX_DIM); got {short(value)}")


def _check_patterns(raw: dict, family, n: int, name: str) -> None:
    """A family config's layer pattern and per-layer dims, checked before transformers
    reads them (its refusals of these name no field, or come from deep inside)."""
    kinds = _given_layer_types(raw, n, name)
    if kinds is not None:
        if all(t == "linear_attention" for t in kinds):
            raise ValueError(f"model config {name}: layer_types has no MLA layer (every entry is "
                             "linear_attention)")
    if family.model_type == "dots3_note":
        for key in tuple(PER_LAYER_KEYS.values()) + ("head_dim",):
            if raw.get(f"swa_{key}") is not None:
                check_dim(f"swa_{key}", raw[f"swa_{key}"], name, low=0 if key == "qk_rope_head_dim" else 1)
    for i, over in _per_layer(raw, family, ["full_attention"] * n, n, name).items():
        for key in PER_LAYER_KEYS.values():
            if over.get(key) is not None:
                check_dim(f"per_layer_config[{i}].{key}", over[key], name, low=0 if key == "qk_rope_head_dim" else 1)


def num_layers(raw: dict, family, name: str) -> int:
    """The attention layers: longcat_flash's num_layers counts decoder layers of two
    MLA sublayers each (transformers' num_hidden_layers = 2 * num_layers)."""
    if family is not None and family.model_type == "longcat_flash":
        if raw.get("num_hidden_layers") is not None:
            return raw["num_hidden_layers"]
        return 2 * raw["num_layers"] if is_int(raw.get("num_layers")) else raw.get("num_layers")
    return _get(raw, "num_hidden_layers", family)[1]


def _check_longcat(raw: dict, name: str) -> None:
    hidden, decoder = raw.get("num_hidden_layers"), raw.get("num_layers")
    if hidden is not None and hidden % 2:
        raise ValueError(f"model config {name}: num_hidden_layers of longcat_flash counts two MLA "
                         f"sublayers per decoder layer and must be even; got {hidden}")
    if hidden is not None and decoder is not None and hidden != 2 * decoder:
        raise ValueError(f"model config {name}: num_hidden_layers ({hidden}) must be 2 x num_layers "
                         f"({decoder}) in longcat_flash (two MLA sublayers per decoder layer)")
    qk = raw.get("qk_head_dim")
    if qk is not None and qk != raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]:
        raise ValueError(f"model config {name}: qk_head_dim must be qk_nope_head_dim + qk_rope_head_dim "
                         f"= {raw['qk_nope_head_dim'] + raw['qk_rope_head_dim']}; got {short(qk)}")


def _kimi_layer_types(raw: dict, n: int, name: str) -> list | None:
    """kimi_linear's checkpoint spelling: linear_attn_config {full_attn_layers,
    kda_layers}, 1-based layer numbers covering every layer."""
    lac = raw.get("linear_attn_config")
    if raw.get("layer_types") is not None or not isinstance(lac, dict) or \
            not ("full_attn_layers" in lac and "kda_layers" in lac):
        if lac is not None and not isinstance(lac, dict):
            raise ValueError(f"model config {name}: linear_attn_config must be an object; got {short(lac)}")
        return None
    types: list = [None] * n
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
        layers = lac[key]
        if not isinstance(layers, list) or not all(is_int(i) and 1 <= i <= n for i in layers):
            raise ValueError(f"model config {name}: linear_attn_config.{key} must be a list of layer "
                             f"numbers in [1, {n}] (1-based); got {short(layers)}")
        for i in layers:
            types[i - 1] = kind
    if None in types:
        raise ValueError(f"model config {name}: linear_attn_config.full_attn_layers and kda_layers must "
                         f"cover every layer; layers {[i + 1 for i, t in enumerate(types) if t is None]} "
                         "(1-based) are in neither")
    return types


def _given_layer_types(raw: dict, n: int, name: str) -> list | None:
    """A family config's own layer_types, in transformers' names (legacy ones remapped),
    or None where it has none."""
    types = raw.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"model config {name}: layer_types must be a list of {n} entries "
                         f"(num_hidden_layers); got {short(types)}")
    types = [LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types]
    bad = sorted({short(t) for t in types if t not in ALLOWED_LAYER_TYPES})
    if bad:
        raise ValueError(f"model config {name}: layer_types entries must be in {ALLOWED_LAYER_TYPES}; "
                         f"got {bad}")
    return types


def _layer_types(raw: dict, family, n: int, name: str) -> list[str]:
    """Every layer's type as the family's config class sets it (its defaults and spellings)."""
    mt = family.model_type
    types = _given_layer_types(raw, n, name)
    if types is not None:  # written out: the family's default patterns below do not apply
        types = list(types)
    elif mt == "kimi_linear":
        types = _kimi_layer_types(raw, n, name) or \
            ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    elif mt == "bailing_hybrid":
        g = raw.get("layer_group_size", 6)
        if not is_int(g) or g < 1:
            raise ValueError(f"model config {name}: layer_group_size must be an integer >= 1; got {short(g)}")
        types = ["full_attention" if (i + 1) % g == 0 else "linear_attention" for i in range(n)]
    elif mt == "glm5_next":
        types = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    elif mt == "dots3_note":
        full = "full_attention" if _dots3_use_dsa(raw) is False else "indexed_attention"
        sliding = raw.get("use_sliding_window", True)
        types = [full if not sliding or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(n)]
    elif mt in _ALL_INDEXED:
        types = ["indexed_attention"] * n
    else:
        types = ["full_attention"] * n
    if mt == "glm5_next":
        types = ["indexed_attention" if t == "full_attention" else t for t in types]
    if mt == "dots3_note" and _dots3_use_dsa(raw) is not None:
        old, new = ("full_attention", "indexed_attention") if _dots3_use_dsa(raw) else \
            ("indexed_attention", "full_attention")
        types = [new if t == old else t for t in types]
    return [str(t) for t in types]


def _dots3_use_dsa(raw: dict):
    # Legacy dots3_note checkpoints call the DSA layers "full_attention".
    return raw.get("use_dsa", None if "per_layer_config" in raw else True)


def _per_layer(raw: dict, family, types: list, n: int, name: str) -> dict:
    """{layer: {key: value}}: per_layer_config (transformers' heterogeneous configs: any
    family), or dots3_note's swa_* spelling of its sliding layers' dims."""
    plc = raw.get("per_layer_config")
    if plc is None and family is not None and family.model_type == "dots3_note":
        swa = {k: raw.get(f"swa_{k}", v) for k, v in _DOTS3_SWA.items()}
        swa["qk_rope_head_dim"] = raw.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        return {i: dict(swa) for i, t in enumerate(types) if t == "sliding_attention"}
    if plc is None:
        return {}
    if not isinstance(plc, dict):
        raise ValueError(f"model config {name}: per_layer_config must be an object {{layer: {{key: value}}}}; "
                         f"got {short(plc)}")
    out = {}
    for key, over in plc.items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"model config {name}: per_layer_config keys must be layer indices; got "
                             f"{short(key)}") from None
        if not 0 <= i < n:
            raise ValueError(f"model config {name}: per_layer_config keys must be layer indices in "
                             f"[0, {n}); got {i}")
        if not isinstance(over, dict):
            raise ValueError(f"model config {name}: per_layer_config[{i}] must be an object; got {short(over)}")
        out[i] = over
    return out


def _rope(raw: dict, family, types: list, name: str) -> dict:
    """The rope dict the family's config class ends with: rope_scaling wins over
    rope_parameters (convert_rope_params_to_dict; dots3_note the other way round), the
    family default where both are absent (mistral4's yarn), `type` read as rope_type."""
    rs, rp = raw.get("rope_scaling"), raw.get("rope_parameters")
    if family.model_type == "dots3_note":
        rope = rp if rp is not None else (rs or {})
    else:
        if rp is None and family.model_type in _DEFAULT_ROPE:
            rp = _DEFAULT_ROPE[family.model_type]
        rope = rs or rp or {}
    rope = copy.deepcopy(rope)

    if not nested_rope_keys(rope, types):
        rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _dims(raw: dict, family, name: str, over: dict | None, i: int) -> dict:
    d = {}
    for arg, key in PER_LAYER_KEYS.items():
        value = raw.get(key)
        if over and over.get(key) is not None:
            value = over[key]
            if not is_int(value):
                raise ValueError(f"model config {name}: per_layer_config[{i}].{key} must be an integer; "
                                 f"got {short(value)}")
        d[arg] = value
    if d["V"] is None and family is not None and "v_head_dim" in _DERIVED.get(family.model_type, ()):
        hidden = raw.get("hidden_size", 2560)  # MiniCPM3Config: hidden_size // num_attention_heads
        if not is_int(hidden) or hidden < d["num_heads"]:
            raise ValueError(f"model config {name}: v_head_dim is null, so hidden_size // "
                             f"num_attention_heads gives it; hidden_size must be an integer >= "
                             f"num_attention_heads; got {short(hidden)}")
        d["V"] = hidden // d["num_heads"]
    return d


def facts_from_dict(raw: dict, family, name: str) -> ConfigFacts:
    """The per-layer facts of a (text-level, prechecked) config dict."""
    n = num_layers(raw, family, name)
    max_len = _get(raw, "max_position_embeddings", family)[1]
    if family is None:
        return _generic_facts(raw, n, max_len, name)
    mt = family.model_type
    types = _layer_types(raw, family, n, name)
    per_layer = _per_layer(raw, family, types, n, name)
    rope = _rope(raw, family, types, name)
    no_rope = None
    if family.reads_no_rope_layers:
        no_rope = raw.get("no_rope_layers")
        if no_rope is None:
            k = raw.get("no_rope_layer_interval", 4)
            if not is_int(k) or k < 1:
                raise ValueError(f"model config {name}: no_rope_layer_interval must be an integer >= 1; "
                                 f"got {short(k)}")
            no_rope = [int((i + 1) % k != 0) for i in range(n)]
        check_no_rope(no_rope, n, name)
    layers = []
    for i in range(n):
        d = _dims(raw, family, name, per_layer.get(i), i)
        scale = module_scale(rope, d["P"], d["R"], family, name, layer_types=types)
        layers.append(LayerFacts(types[i], d["L"], d["R"], d["P"], d["V"], d["num_heads"], scale,
                                 rope=no_rope is None or bool(no_rope[i])))
    sources = {}
    if family.reads_kv_source_layers and raw.get("kv_source_layers") is not None:
        sources = check_kv_sources(raw["kv_source_layers"], n, name)
    return ConfigFacts(tuple(layers), max_len, sources, sparse_fields(raw, family, name),
                       sparse_layers(layers, family), reader="mla_ext's config reader",
                       attention_per_layer=family.attention_per_layer)


def sparse_fields(raw: dict, family, name: str) -> dict | None:
    """The DSA indexer's fields of a (text-level) config dict, None for a dense model:
    a sparse family's, its config class's defaults where absent; a dense family has
    none (its modules have no indexer, whatever keys the dict carries); a config of no
    family has them when it states all three."""
    if family is not None:
        if not family.sparse:
            return None
        defaults = {"index_topk": 2048, "index_n_heads": _INDEX_HEADS[family.model_type],
                    "index_head_dim": 128}
        return {**{k: raw[k] if raw.get(k) is not None else defaults[k] for k in SPARSE_KEYS},
                "model_type": family.model_type}
    present = [k for k in SPARSE_KEYS if raw.get(k) is not None]
    if not present:
        return None
    if len(present) != len(SPARSE_KEYS):
        raise ValueError(f"model config {name}: a sparse (DSA) config needs all of {SPARSE_KEYS}, "
                         f"has only {present}")
    return {**{k: raw[k] for k in SPARSE_KEYS}, "model_type": raw.get("model_type")}


def sparse_layers(layers, family) -> frozenset:
    """The MLA layers that run the DSA indexer's selection: every MLA layer of a sparse
    family, or (dots3_note) its indexed_attention layers only."""
    if family is None or not family.sparse:
        return frozenset()
    return frozenset(i for i, f in enumerate(layers)
                     if f.mla and (family.sparse_layers == "mla" or f.kind == "indexed_attention"))


def check_no_rope(no_rope, n: int, name: str) -> None:
    if not isinstance(no_rope, list) or len(no_rope) != n or not all(v in (0, 1) for v in no_rope) \
            or any(isinstance(v, float) for v in no_rope):
        raise ValueError(f"model config {name}: no_rope_layers must be a list of {n} entries 0 (no rope) "
                         f"or 1 (rope); got {short(no_rope)}")


def check_kv_sources(src, n: int, name: str) -> dict:
    """{layer: source} from kv_source_layers (mistral_large4: each layer's entry names
    the layer whose latent cache it reads; its own index = its own cache), with
    transformers' rule: an earlier layer that owns its cache."""
    if not isinstance(src, list) or len(src) != n or not all(is_int(j) for j in src):
        raise ValueError(f"model config {name}: kv_source_layers must be a list of {n} layer indices; "
                         f"got {short(src)}")
    for i, j in enumerate(src):
        if not 0 <= j <= i or src[j] != j:
            raise ValueError(f"model config {name}: kv_source_layers[{i}] must name layer {i} itself or "
                             f"an earlier layer that owns its KV cache; got {j}")
    return {i: j for i, j in enumerate(src) if j != i}


def _generic_facts(raw: dict, n: int, max_len: int, name: str) -> ConfigFacts:
    """A config of no transformers MLA family: the HF conventions in general."""
    types = raw.get("layer_types")
    sliding = sliding_window_layers_from_dict(raw, n, name)
    per_layer = _per_layer(raw, None, [], n, name)
    no_rope = raw.get("no_rope_layers")
    if no_rope is not None:
        check_no_rope(no_rope, n, name)
    layers = []
    for i in range(n):
        d = _dims(raw, None, name, per_layer.get(i), i)
        kind = str(types[i]) if types else ("sliding_attention" if i in sliding else "full_attention")
        kind = "linear_attention" if "linear" in kind.lower() else kind
        scale = scale_from_config(raw, d["P"], d["R"], name, layer_type=str(types[i]) if types else None)
        layers.append(LayerFacts(kind, d["L"], d["R"], d["P"], d["V"], d["num_heads"], scale,
                                 rope=no_rope is None or bool(no_rope[i])))
    sources = {}
    if raw.get("kv_source_layers") is not None:
        sources = check_kv_sources(raw["kv_source_layers"], n, name)
    sparse = sparse_fields(raw, None, name)
    mla = [i for i, f in enumerate(layers) if f.mla]
    return ConfigFacts(tuple(layers), max_len, sources, sparse,
                       frozenset(mla) if sparse else frozenset(), reader="mla_ext's config reader")


def sliding_window_layers_from_dict(raw: dict, num_layers: int, name: str) -> frozenset:
    """Which layers have a sliding window, from the HF conventions in use:

    - `layer_types`: one entry per layer; "sliding_attention" (any entry naming
      "sliding") marks a windowed layer (newer transformers configs);
    - otherwise a non-null `sliding_window` (and `use_sliding_window` not false):
      with `max_window_layers` the layers at or above it are windowed (Qwen2
      convention), with `sliding_window_pattern` n every layer except each n-th
      (Gemma convention), else every layer.
    """
    if not is_int(num_layers) or not 1 <= num_layers <= MAX_NUM_LAYERS:
        raise ValueError(f"model config {name}: num_hidden_layers must be an integer >= 1 "
                         f"and <= {MAX_NUM_LAYERS}; got {short(num_layers)}")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(
                f"model config {name}: layer_types must be a list of {num_layers} entries "
                f"(num_hidden_layers); got {short(types)}"
            )
        return frozenset(i for i, t in enumerate(types) if "sliding" in str(t).lower())
    if raw.get("sliding_window") is None or raw.get("use_sliding_window") is False:
        return frozenset()
    first = raw.get("max_window_layers")
    if first is not None:
        if not is_int(first) or first < 0:
            raise ValueError(
                f"model config {name}: max_window_layers must be an integer >= 0; got {short(first)}"
            )
        return frozenset(range(min(first, num_layers), num_layers))
    pattern = raw.get("sliding_window_pattern")
    if pattern is not None:
        if not is_int(pattern) or pattern < 1:
            raise ValueError(
                f"model config {name}: sliding_window_pattern must be an integer >= 1; "
                f"got {short(pattern)}"
            )
        return frozenset(i for i in range(num_layers) if (i + 1) % pattern != 0)
    return frozenset(range(num_layers))
