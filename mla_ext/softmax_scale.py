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


def _rope_dict(raw: dict, name: str, layer_type: str | None = None) -> tuple[str | None, dict | None]:
    """The rope-scaling dict and the key it came from; transformers 5's
    `rope_parameters` wins over a leftover `rope_scaling`. transformers 5 also
    writes one dict per layer type ({"full_attention": {...}, "sliding_attention":
    {...}}): then the dict of `layer_type` (default: the first non-sliding one)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"model config {name}: {key} must be an object (dict) or null; "
                             f"got {value!r}")
        if value and all(isinstance(v, dict) for v in value.values()):
            kinds = list(value)
            pick = layer_type if layer_type in value else \
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
    `family` (mla_ext.families.Family) decides whether the yarn correction applies
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
    where = f"{name} {key}"
    factor = _number(rope, "factor", where)
    if factor <= 0:
        raise ValueError(f"model config {where}: factor must be > 0; got {factor!r}")
    mscale_all_dim = _number(rope, "mscale_all_dim", where)
    m = yarn_mscale(factor, mscale_all_dim)
    value = base.value * m * m
    return SoftmaxScale(
        value,
        f"(P+R)^-0.5 x mscale^2 = ({P}+{R})^-0.5 x {m:.6g}^2 = {value:.5f} "
        f"({kind} from {key}: factor {factor:g}, mscale_all_dim {mscale_all_dim:g})",
    )
