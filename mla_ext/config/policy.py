"""Per-layer KV-cache policy (SPEC §3): which format each layer's cache uses.

A `CacheConfig` holds what the user asked for (global format, skip list, block
size, whether to compute per-tensor KV scales). `resolve_layer` turns it into
one immutable `LayerCacheSpec` per layer, and that spec is the only thing
downstream code reads: page size, cache allocation, gather kernel choice,
workspace dtype. The upstream bugs this prevents (the MLA layer ignoring the
skip list, page sizes from the global dtype, a quantized layer left at quant
mode NONE, a skipped layer gathered into an fp8 workspace) all came from some
consumer reading the global dtype string; here no such string reaches them.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, replace

import torch

from mla_ext.config.formats import CacheFormat, QuantMode, ScaleKind, get_format
from mla_ext.config.models import MLAModelConfig

try:  # numpy is optional: its bool scalar is accepted where a bool is expected
    from numpy import bool_ as _np_bool
except ImportError:  # pragma: no cover
    _np_bool = bool

SKIP_ARG = "kv_cache_dtype_skip_layers"
SLIDING_WINDOW = "sliding_window"
_DECIMAL = re.compile(r"[0-9]+")  # ASCII digits only: "١٢" and " 12" are not layer indices
_MAX_INDEX_DIGITS = 9  # no model has a billion layers (models.MAX_NUM_LAYERS)


def check_bool(value, arg: str, *, allow_none: bool = False) -> bool | None:
    """`value` as a Python bool; True/False or a numpy bool only. Truthiness is
    not a bool: `"no"`, `0`, `None` or a tensor would silently pick a branch
    (`bool("no")` is True), so anything else is a ValueError naming `arg`.
    With allow_none=True, None passes through (a documented "auto")."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, _np_bool)):
        return bool(value)
    also = " or None" if allow_none else ""
    raise ValueError(f"{arg}: expected a bool (True or False){also}, got {value!r} "
                     f"({type(value).__name__})")


def parse_skip_entry(entry) -> int | str:
    """One skip-list entry as a layer index (int) or the word `sliding_window`."""
    if isinstance(entry, bool):
        raise ValueError(f"{SKIP_ARG}: entry {entry!r} is a bool, expected a layer index "
                         f"or '{SLIDING_WINDOW}'")
    if isinstance(entry, str):
        if entry == SLIDING_WINDOW:
            return entry
        if not _DECIMAL.fullmatch(entry):
            raise ValueError(
                f"{SKIP_ARG}: entry {entry!r} is not a layer index (decimal digits) "
                f"nor '{SLIDING_WINDOW}'"
            )
        if len(entry) > _MAX_INDEX_DIGITS:
            raise ValueError(f"{SKIP_ARG}: entry {entry[:20]!r}... ({len(entry)} digits) is not "
                             f"a layer index of any model; expected at most "
                             f"{_MAX_INDEX_DIGITS} digits")
        return int(entry)
    try:
        index = operator.index(entry)  # ints and numpy integers, not floats
    except TypeError:
        raise ValueError(
            f"{SKIP_ARG}: entry {entry!r} ({type(entry).__name__}) is not a layer index "
            f"(int or decimal string) nor '{SLIDING_WINDOW}'"
        ) from None
    if index < 0:
        raise ValueError(f"{SKIP_ARG}: entry {entry!r} is negative; layer indices start at 0")
    return index


def layer_index_from_prefix(prefix: str, attention_per_layer: int = 1) -> int:
    """The layer index in a module prefix: `model.layers.12.self_attn.attn` -> 12.

    The prefix must have exactly one all-digit component; with none or several
    (e.g. an expert index too) the index is ambiguous and the caller must pass it.
    A model with several MLA modules per decoder layer (LongCat-Flash: 2) may name
    one as `model.layers.{d}.self_attn.{k}`: layer d * attention_per_layer + k, as
    transformers and vLLM (extract_layer_index) number them.
    """
    if not isinstance(prefix, str):
        raise ValueError(f"prefix: expected a module name (str), got {type(prefix).__name__}")
    found = [p for p in prefix.split(".") if _DECIMAL.fullmatch(p)]
    pair = attention_per_layer > 1 and len(found) == 2 and "attn" in prefix
    if len(found) != 1 and not pair:
        raise ValueError(
            f"prefix {prefix!r}: expected exactly one integer component (the layer index)"
            + (f" or two (decoder layer, attention module < {attention_per_layer})"
               if attention_per_layer > 1 else "")
            + f", found {len(found)}; pass the layer index explicitly"
        )
    for part in found:
        if len(part) > 9:  # no model has a billion layers; int() of 5,000 digits raises
            raise ValueError(f"prefix {prefix[:80]!r}: layer index {part[:20]}... has {len(part)} "
                             "digits; expected a layer index below 10**9")
    if not pair:
        return int(found[0])
    decoder, module = int(found[0]), int(found[1])
    if module >= attention_per_layer:
        raise ValueError(f"prefix {prefix!r}: attention module {module} of decoder layer {decoder}; "
                         f"the model has {attention_per_layer} per decoder layer (0..{attention_per_layer - 1})")
    return decoder * attention_per_layer + module


@dataclass(frozen=True)
class CacheConfig:
    """What the user asked for, before it is resolved per layer."""

    kv_cache_dtype: str = "auto"
    skip_layers: tuple = ()
    block_size: int = 16
    calculate_kv_scales: bool = False

    def __post_init__(self):
        get_format(self.kv_cache_dtype, "kv_cache_dtype")
        if isinstance(self.skip_layers, (str, bytes)) or not hasattr(self.skip_layers, "__iter__"):
            raise ValueError(
                f"{SKIP_ARG}: expected a list of entries, got {self.skip_layers!r}"
            )
        entries = tuple(dict.fromkeys(parse_skip_entry(e) for e in self.skip_layers))
        object.__setattr__(self, "skip_layers", entries)
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"block_size: expected an integer > 0, got {b!r}")
        object.__setattr__(self, "calculate_kv_scales",
                           check_bool(self.calculate_kv_scales, "calculate_kv_scales"))

    @property
    def skip_indices(self) -> frozenset:
        return frozenset(e for e in self.skip_layers if isinstance(e, int))

    @property
    def skips_sliding_window(self) -> bool:
        return SLIDING_WINDOW in self.skip_layers

    def check_against(self, model: MLAModelConfig) -> None:
        """Skip indices must name layers of `model`."""
        check_configs(self, model, cache_arg="self", model_arg="model")
        bad = sorted(i for i in self.skip_indices if i >= model.num_layers)
        if bad:
            raise ValueError(
                f"{SKIP_ARG}: layer indices {bad} are out of range for {model.name} "
                f"(layers 0..{model.num_layers - 1})"
            )


@dataclass(frozen=True)
class LayerCacheSpec:
    """Everything one layer's cache consumers need; consistent by construction
    (`__post_init__` rejects a spec whose fields disagree with its format)."""

    layer_index: int
    format: CacheFormat
    requested_format: str  # canonical name of the global kv_cache_dtype
    skipped: bool
    skip_reason: str | None
    quant_mode: QuantMode
    calculate_kv_scales: bool
    block_size: int
    model_dtype: torch.dtype
    L: int
    R: int
    storage_dtype: torch.dtype
    entry_elems: int
    bytes_per_token: int
    workspace_dtype: torch.dtype  # dtype the gather writes: model dtype
    # The layer whose cache this one reads (KV sharing, mistral_large4), or None.
    # Such a layer has its source's format and entry and no cache of its own.
    kv_source: int | None = None

    def __post_init__(self):
        f = self.format
        expect = {
            "quant_mode": f.quant_mode,
            "storage_dtype": f.storage_dtype(self.model_dtype),
            "entry_elems": f.entry_elems(self.L, self.R),
            "bytes_per_token": f.bytes_per_token(self.L, self.R, self.model_dtype),
            "workspace_dtype": self.model_dtype,
        }
        for arg, want in expect.items():
            if getattr(self, arg) != want:
                raise ValueError(
                    f"layer {self.layer_index}: {arg} {getattr(self, arg)} does not match "
                    f"format {f.name!r} (expected {want})"
                )
        if f.is_native and self.storage_dtype != self.model_dtype:
            # A native cache holds exactly the model dtype; gathering it into another
            # dtype would reinterpret bytes (SPEC §2).
            raise ValueError(
                f"layer {self.layer_index}: kv_cache_dtype {f.name!r} stores "
                f"{self.storage_dtype} but the model runs in {self.model_dtype}; a native "
                "cache must hold the model dtype (use 'auto')"
            )
        if self.skipped != (self.skip_reason is not None):
            raise ValueError(
                f"layer {self.layer_index}: skipped={self.skipped} needs a skip_reason exactly "
                f"when skipped; got {self.skip_reason!r}"
            )
        if self.skipped and (f.is_quantized or self.calculate_kv_scales):
            raise ValueError(
                f"layer {self.layer_index}: a skipped layer keeps the native dtype and "
                f"computes no KV scales; got format {f.name!r}, "
                f"calculate_kv_scales={self.calculate_kv_scales}"
            )
        if self.calculate_kv_scales and f.scale_kind != ScaleKind.PER_TENSOR:
            raise ValueError(
                f"layer {self.layer_index}: calculate_kv_scales needs a per-tensor fp8 format, "
                f"got {f.name!r}"
            )

    @property
    def kv_cache_dtype(self) -> str:
        """The resolved format name (`auto` for a skipped layer)."""
        return self.format.name

    @property
    def is_quantized(self) -> bool:
        return self.format.is_quantized

    def page_bytes(self, alignment: int | None = None) -> int:
        """Bytes of one block (SPEC §4), rounded up to `alignment` when given."""
        raw = self.block_size * self.bytes_per_token
        if alignment is None:
            return raw
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"alignment: expected an integer > 0 or None, got {alignment!r}")
        return -(-raw // alignment) * alignment

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return (num_blocks, self.block_size, self.entry_elems)


def _skip_reason(cfg: CacheConfig, model: MLAModelConfig, layer: int) -> str | None:
    if layer in cfg.skip_indices:
        return f"layer {layer} in skip list"
    if cfg.skips_sliding_window and layer in model.sliding_window_layers:
        return SLIDING_WINDOW
    return None


def _layer_index(model: MLAModelConfig, layer, prefix) -> int:
    if layer is None and prefix is None:
        raise ValueError("resolve_layer: pass the layer index (layer=) or a module prefix (prefix=)")
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"layer: expected an integer index, got {layer!r}")
    from_prefix = None if prefix is None else layer_index_from_prefix(prefix, model.attention_per_layer)
    if layer is not None and from_prefix is not None and layer != from_prefix:
        raise ValueError(f"layer {layer} disagrees with prefix {prefix!r} (layer {from_prefix})")
    index = layer if layer is not None else from_prefix
    if not 0 <= index < model.num_layers:
        where = f" (from prefix {prefix!r})" if prefix is not None else ""
        raise ValueError(
            f"layer {index}{where} is out of range for {model.name} "
            f"(layers 0..{model.num_layers - 1})"
        )
    return index


def _check_kv_source(model: MLAModelConfig, layer: int, source: int) -> None:
    """A KV-sharing layer reads its source layer's latent rows as its own kv_c (L) and
    k_pe (R): refused here, naming both layers, when the source is not MLA or its entry
    has other dims (the gather would read rows of the wrong width)."""
    if source in model.non_mla_layers:
        raise ValueError(f"layer {layer} of {model.name} reads layer {source}'s KV cache (kv_source_layers), "
                         f"but layer {source} is not an MLA layer (linear attention): it has no MLA cache")
    own, theirs = model.for_layer(layer), model.for_layer(source)
    if (own.L, own.R) != (theirs.L, theirs.R):
        raise ValueError(f"layer {layer} of {model.name} reads layer {source}'s KV cache (kv_source_layers), "
                         f"but its dims L={own.L} R={own.R} differ from layer {source}'s L={theirs.L} "
                         f"R={theirs.R}: a shared cache needs the same latent and rope widths")


def check_configs(cache_config, model_config, cache_arg: str = "cache_config",
                  model_arg: str = "model_config") -> None:
    """The two config objects are what they claim to be (a dict or a model name
    instead would fail later, vaguely, with an AttributeError)."""
    if not isinstance(cache_config, CacheConfig):
        raise ValueError(f"{cache_arg}: expected a CacheConfig (mla_ext.config.policy), got "
                         f"{type(cache_config).__name__}")
    if not isinstance(model_config, MLAModelConfig):
        raise ValueError(f"{model_arg}: expected an MLAModelConfig (e.g. "
                         f"mla_ext.config.models.get_model_config('deepseek-v3')), got "
                         f"{type(model_config).__name__}")


def resolve_layer(
    cache_config: CacheConfig,
    model_config: MLAModelConfig,
    layer: int | None = None,
    prefix: str | None = None,
) -> LayerCacheSpec:
    """The cache spec of one layer, given its index or its module prefix."""
    check_configs(cache_config, model_config)
    cache_config.check_against(model_config)
    index = _layer_index(model_config, layer, prefix)
    if index in model_config.non_mla_layers:
        raise ValueError(f"layer {index} of {model_config.name} is not an MLA layer (its "
                         "layer_types entry is linear attention): it has no MLA cache")
    source = model_config.kv_source(index)
    if source is not None:  # it reads its source's cache: the source's format and entry
        _check_kv_source(model_config, index, source)
        return replace(resolve_layer(cache_config, model_config, layer=source),
                       layer_index=index, kv_source=source)
    full, model_config = model_config, model_config.for_layer(index)  # its own L, R size its entry
    requested = get_format(cache_config.kv_cache_dtype, "kv_cache_dtype")
    reason = _skip_reason(cache_config, model_config, index)
    fmt = get_format("auto") if reason is not None else requested
    dtype = model_config.model_dtype
    if not fmt.supports_dims(model_config.L, model_config.R):
        try:
            fmt.check_dims(model_config.L, model_config.R)
        except ValueError as exc:
            hint = ""
            if (model_config.L, model_config.R) != (full.L, full.R):
                hint = (f" (this layer's own dims; skip it to keep it native: skip_layers "
                        f"{'sliding_window or ' if index in full.sliding_window_layers else ''}"
                        f"{index})")
            raise ValueError(f"layer {index} of {model_config.name}: {exc}{hint}") from None
    return LayerCacheSpec(
        layer_index=index,
        format=fmt,
        requested_format=requested.name,
        skipped=reason is not None,
        skip_reason=reason,
        quant_mode=fmt.quant_mode,
        # Only per-tensor fp8 layers have a K scale to compute; fp8_ds_mla stores its
        # tile scales inside each row and native layers have none.
        calculate_kv_scales=(
            cache_config.calculate_kv_scales and fmt.scale_kind == ScaleKind.PER_TENSOR
        ),
        block_size=cache_config.block_size,
        model_dtype=dtype,
        L=model_config.L,
        R=model_config.R,
        storage_dtype=fmt.storage_dtype(dtype),
        entry_elems=fmt.entry_elems(model_config.L, model_config.R),
        bytes_per_token=fmt.bytes_per_token(model_config.L, model_config.R, dtype),
        workspace_dtype=dtype,
    )


def resolve_model(
    cache_config: CacheConfig, model_config: MLAModelConfig
) -> tuple[LayerCacheSpec, ...]:
    """The cache spec of every MLA layer, in layer order (O(num_layers): the model
    config bounds it, models.MAX_NUM_LAYERS); layers that are not MLA (linear
    attention) have none."""
    check_configs(cache_config, model_config)
    return tuple(
        resolve_layer(cache_config, model_config, layer=i) for i in range(model_config.num_layers)
        if i not in model_config.non_mla_layers
    )
