"""A family's config read by transformers' own config class (where transformers is importable).

A raw config of a transformers MLA family (mla_ext.config.families) is first turned into that
family's `PretrainedConfig` (CONFIG_MAPPING[model_type], its text config for the
multimodal ones), so its defaults, normalisations, layer patterns, per-layer configs,
rope parameters and refusals are transformers'. The per-layer facts (dims, layer type,
rope or not, KV sharing, DSA fields, softmax scale by the module's own formula) are then
read from that object. mla_ext.config.dict_reader reads the same facts without transformers.

`set_transformers_reader(False)` (or the `transformers_reader(False)` context) forces
mla_ext's own reader, for tests and for a process that must not import transformers;
None (the default) uses transformers when it imports.
"""
from __future__ import annotations

import contextlib
import copy

from mla_ext.config.dict_reader import PER_LAYER_KEYS, SPARSE_KEYS, check_kv_sources, check_no_rope, is_int, \
    short, sparse_layers
from mla_ext.config.facts import ConfigFacts, LayerFacts
from mla_ext.config.softmax_scale import module_scale

_FORCED: bool | None = None
_AVAILABLE: bool | None = None


def set_transformers_reader(enabled: bool | None) -> None:
    """True: read family configs through transformers (ImportError if it is missing);
    False: mla_ext's own reader; None (default): transformers when importable."""
    global _FORCED
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected True, False or None, got {enabled!r}")
    if enabled and not _importable():
        raise ImportError("set_transformers_reader(True): transformers cannot be imported")
    _FORCED = enabled


@contextlib.contextmanager
def transformers_reader(enabled: bool | None):
    """`with transformers_reader(False): ...` reads configs with mla_ext's own reader."""
    before = _FORCED
    set_transformers_reader(enabled)
    try:
        yield
    finally:
        set_transformers_reader(before)


def _importable() -> bool:
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import transformers  # noqa: F401
            from transformers import CONFIG_MAPPING  # noqa: F401
            _AVAILABLE = True
        except Exception:  # ImportError, or a broken install: mla_ext's own reader then
            _AVAILABLE = False
    return _AVAILABLE


def transformers_reader_enabled() -> bool:
    """Whether family configs are read through transformers now."""
    return _FORCED if _FORCED is not None else _importable()


def config_class(model_type: str):
    """The family's config class for a text-level dict: CONFIG_MAPPING[model_type], or its
    text_config class for a multimodal one (Dots3NoteConfig -> Dots3NoteTextConfig)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    text = (getattr(cls, "sub_configs", None) or {}).get("text_config")
    return text if text is not None else cls


def hf_config_from_dict(raw: dict, family, name: str):
    """The family's PretrainedConfig of a text-level config dict (a ValueError naming
    the config and transformers' complaint when its class refuses the dict)."""
    model_type = raw.get("model_type") if isinstance(raw.get("model_type"), str) else family.model_type
    try:
        cls = config_class(model_type.strip().lower())
    except KeyError:
        cls = config_class(family.model_type)
    try:
        return cls.from_dict(copy.deepcopy(raw))
    except Exception as exc:  # strict-dataclass validation, or a crash on a bad value
        msg = " ".join(str(exc).split())
        raise ValueError(f"model config {name}: transformers' {cls.__name__} refuses it "
                         f"({type(exc).__name__}: {msg[:400]})") from None


def _text(cfg):
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if callable(get) else cfg


def _int(cfg, key: str, name: str, where: str) -> int:
    value = getattr(cfg, key, None)
    if not is_int(value):
        raise ValueError(f"model config {name}: {where}{key} must be an integer; transformers' "
                         f"{type(cfg).__name__} gives {short(value)}")
    return value


def facts_from_hf(cfg, family, name: str) -> ConfigFacts:
    """The per-layer facts of a transformers config of `family` (what its modules read)."""
    text = _text(cfg)
    n = _int(text, "num_hidden_layers", name, "")  # longcat_flash: 2 x num_layers
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise ValueError(f"model config {name}: layer_types must be a list of {n} entries; got "
                         f"{short(types)}")
    hetero = bool(getattr(text, "is_heterogeneous", False))
    no_rope = getattr(text, "no_rope_layers", None) if family.reads_no_rope_layers else None
    if no_rope is not None:
        check_no_rope(list(no_rope), n, name)
    layers = []
    for i in range(n):
        lc = text.per_layer_config[i] if hetero else text
        where = f"layer {i}'s " if hetero else ""
        d = {arg: _int(lc, key, name, where) for arg, key in PER_LAYER_KEYS.items()}
        scale = module_scale(getattr(lc, "rope_parameters", None), d["P"], d["R"], family, name,
                             layer_types=types)
        layers.append(LayerFacts(str(types[i]), d["L"], d["R"], d["P"], d["V"], d["num_heads"], scale,
                                 rope=no_rope is None or bool(no_rope[i])))
    sources = {}
    if family.reads_kv_source_layers and getattr(text, "kv_source_layers", None) is not None:
        sources = check_kv_sources(list(text.kv_source_layers), n, name)
    sparse = sparse_fields_hf(text, family)
    max_len = _int(text, "max_position_embeddings", name, "")
    return ConfigFacts(tuple(layers), max_len, sources, sparse, sparse_layers(layers, family),
                       reader=f"transformers' {type(text).__name__}",
                       attention_per_layer=family.attention_per_layer)


def sparse_fields_hf(cfg, family) -> dict | None:
    """The DSA indexer's fields of a family's transformers config (None: a dense family)."""
    if not family.sparse:
        return None
    text = _text(cfg)
    return {**{k: getattr(text, k, None) for k in SPARSE_KEYS}, "model_type": family.model_type}
