"""The attention softmax scale of an MLA model, derived from its config (SPEC §10).

DeepSeek-V2/V3/R1 and Kimi-K2 extend their context with yarn rope scaling, and
their attention multiplies the base scale `(P + R) ** -0.5` by `m**2`, with
`m = 0.1 * mscale_all_dim * ln(factor) + 1` (for factor > 1). Leaving that out
is silent: DeepSeek-V3's scale is 0.1352, not 0.0722, and the output is 30-39%
off. The plain `mscale` key scales the rotary cos/sin, which is applied before
this library sees q and k_pe, so it does not enter the softmax scale.

Config spellings read here (all seen in real checkpoints' config.json):
- transformers 4: `rope_scaling = {"type" | "rope_type": "yarn", "factor", "mscale",
  "mscale_all_dim", ...}` (DeepSeek-V2, V2-Lite, V3, R1, Kimi-K2);
- transformers 5: `rope_parameters = {"rope_type": "yarn", "factor", ...}`, where
  `rope_type` "default" (or no dict at all, as in GLM's MLA configs) means no scaling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

@dataclass(frozen=True)
class SoftmaxScale:
    value: float
    source: str  # how it was derived, for explain() and the CLI


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn magnitude correction: 0.1 * mscale * ln(factor) + 1, or 1
    when the context is not extended (factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _base_text(P: int, R: int) -> str:
    return f"(P+R)^-0.5 = ({P}+{R})^-0.5 = {(P + R) ** -0.5:.5f}"


def base_scale(P: int, R: int) -> SoftmaxScale:
    return SoftmaxScale((P + R) ** -0.5, f"{_base_text(P, R)} (no rope scaling)")


def nested_rope_keys(rope: dict, layer_types) -> list[str]:
    """The keys a per-layer-type rope dict is nested under, by transformers' own rule
    (PreTrainedConfig.nested_rope_parameter_keys): the keys that name a layer type the
    config declares. Without layer_types, a dict whose values are all dicts is nested.
    Other entries beside them (strings, numbers) do not make it flat."""
    if layer_types:
        return [k for k in rope if k in set(map(str, layer_types))]
    return list(rope) if rope and all(isinstance(v, dict) for v in rope.values()) else []


def _rope_dict(raw: dict, name: str, layer_type: str | None = None) -> tuple[str | None, dict | None]:
    """The rope-scaling dict and the key it came from; transformers 5's
    `rope_parameters` wins over a leftover `rope_scaling`. transformers 5 also
    writes one dict per layer type ({"full_attention": {...}, "sliding_attention":
    {...}}): then the dict of `layer_type` (default: the first non-sliding one)."""
    types = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else None
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"model config {name}: {key} must be an object (dict) or null; "
                             f"got {value!r}")
        kinds = nested_rope_keys(value, types)
        if kinds:
            if not all(isinstance(value[k], dict) for k in kinds):
                raise ValueError(f"model config {name}: {key}[{kinds[0]!r}] entries must be objects "
                                 f"(dicts) per layer type; got {value!r}"[:300])
            pick = layer_type if layer_type in kinds else \
                next((k for k in kinds if "sliding" not in k), kinds[0])
            return f"{key}[{pick!r}]", value[pick]
        return key, value
    return None, None


def _number(d: dict, key: str, where: str) -> float:
    value = d.get(key)
    if value is None:
        raise ValueError(f"model config {where}: yarn rope scaling needs {key!r}; got none")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"model config {where}: {key} must be a finite number; got {value!r}")
    return float(value)


def scale_from_config(raw: dict, P: int, R: int, name: str, *, layer_type: str | None = None,
                      family=None) -> SoftmaxScale:
    """The softmax scale the model's own attention uses, with its derivation.

    `layer_type` picks the rope dict of a per-layer-type `rope_parameters`;
    `family` (mla_ext.config.families.Family) decides whether the yarn correction applies
    at all: dots3_note, glm5_next and kimi_linear never apply it in their attention."""
    base = base_scale(P, R)
    key, rope = _rope_dict(raw, name, layer_type)
    if rope is None:
        return base
    if family is not None and not family.yarn_in_scale:
        return SoftmaxScale(base.value, f"{_base_text(P, R)} ({family.model_type}'s attention "
                                        f"never applies a yarn correction to its scale)")
    kind = str(rope.get("rope_type", rope.get("type", "default"))).lower()
    # As in DeepSeek's own modeling code (and transformers'): the correction
    # applies whenever the rope dict carries a non-zero mscale_all_dim, whatever
    # its type is called ("yarn", "deepseek_yarn"); transformers 5 writes a
    # rope_parameters dict for every model, with rope_type "default" when plain.
    if kind == "default" or not rope.get("mscale_all_dim"):
        return SoftmaxScale(base.value, f"{_base_text(P, R)} ({key} type {kind!r} without "
                                        "mscale_all_dim: no softmax correction)")
    return _yarn_scale(rope, P, R, kind, key, f"{name} {key}")


def _yarn_scale(rope: dict, P: int, R: int, kind: str, key: str, where: str) -> SoftmaxScale:
    """(P+R)^-0.5 x yarn_mscale(factor, mscale_all_dim)^2, with its derivation."""
    factor = _number(rope, "factor", where)
    if factor <= 0:
        raise ValueError(f"model config {where}: factor must be > 0; got {factor!r}")
    mscale_all_dim = _number(rope, "mscale_all_dim", where)
    m = yarn_mscale(factor, mscale_all_dim)
    value = (P + R) ** -0.5 * m * m
    return SoftmaxScale(
        value,
        f"(P+R)^-0.5 x mscale^2 = ({P}+{R})^-0.5 x {m:.6g}^2 = {value:.5f} "
        f"({kind} from {key}: factor {factor:g}, mscale_all_dim {mscale_all_dim:g})",
    )


def module_scale(rope, qk_nope: int, qk_rope: int, family, where: str, *,
                 layer_types=None) -> SoftmaxScale:
    """The scale a transformers MLA family's attention module sets (`self.scaling`):
    `qk_head_dim ** -0.5`, times `yarn_get_mscale(factor, mscale_all_dim) ** 2` when
    the family applies it (`yarn_apply_mscale(config.rope_parameters, ...)`: the
    config's own rope dict, standardised, whose `rope_type` is not "default" and whose
    `mscale_all_dim` is non-zero). `rope` is that dict as transformers holds it (both
    config readers pass it standardised: mla_ext.config.hf_reader, mla_ext.config.dict_reader).
    `qk_nope`/`qk_rope` are the layer's config widths (a no-rope layer keeps them)."""
    base = base_scale(qk_nope, qk_rope)
    if not family.yarn_in_scale:
        return SoftmaxScale(base.value, f"{_base_text(qk_nope, qk_rope)} ({family.model_type}'s "
                                        "attention never applies a yarn correction to its scale)")
    if not isinstance(rope, dict):
        return base
    nested = [k for k, v in rope.items() if isinstance(v, dict) and
              (k in (layer_types or ()) or k.endswith("_attention"))]
    if nested:
        # Its rotary embedding and its scale read rope_parameters["rope_type"]: one dict, not
        # one per layer type. transformers reads such a dict as a flat "default" one (its
        # class declares no layer types), silently dropping the yarn inside: refused.
        raise ValueError(f"model config {where}: rope_parameters is per layer type ({nested}), but "
                         f"{family.model_type}'s attention reads one rope dict (rope_parameters"
                         "['rope_type'], 'factor', 'mscale_all_dim'); write that one dict")
    kind = rope.get("rope_type", "default")
    if kind == "default" or not rope.get("mscale_all_dim", 0):
        return SoftmaxScale(base.value, f"{_base_text(qk_nope, qk_rope)} (rope_parameters type "
                                        f"{kind!r} without mscale_all_dim: no softmax correction)")
    return _yarn_scale(rope, qk_nope, qk_rope, kind, "rope_parameters", f"{where} rope_parameters")
