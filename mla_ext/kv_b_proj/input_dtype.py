"""The dtype the MLA prefill path casts kv_c to before kv_b_proj (SPEC §5 table).

A pure function of the layer. It works on this package's weight formats and
`KvBProj`, and on any duck-typed upstream layer (`.weight` and/or
`params_dtype`), because users pass upstream layers too.

Return value: a torch.dtype to cast the activation to, or None meaning "do not
cast" (the activation already is in the model dtype and the linear handles it,
e.g. it quantizes the input itself).

The storage dtype of `.weight` only selects the table row; the compute dtype of
packed formats always comes from the layer's declared `compute_dtype` or
`params_dtype`. Deriving it from storage is the upstream bug this prevents:
Marlin repacks fp8 weights into int32, and casting the activation to int32 made
the kernel fail with "unsupported 'a' scalar_type"; GPTQ/AWQ layers have no
`.weight` at all (AttributeError).

| stored weight dtype      | FP8 prefill off | FP8 prefill on          |
|--------------------------|-----------------|-------------------------|
| int32 (Marlin-packed)    | params dtype    | params dtype            |
| uint8 (NVFP4)            | None (no cast)  | params dtype, never fp8 |
| fp8                      | None (no cast)  | the weight's fp8 dtype  |
| bf16 / fp16 / fp32       | that dtype      | that dtype              |
| no `.weight`             | params dtype    | params dtype            |
Other integer storage (int8, int16, ... packed layouts) follows the int32 row:
a packed integer dtype says nothing about the compute dtype.
"""
from __future__ import annotations

import torch

from mla_ext.config.policy import check_bool

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def declared_compute_dtype(layer) -> torch.dtype | None:
    """`compute_dtype` if the layer states one, else `params_dtype`, else None."""
    for attr in ("compute_dtype", "params_dtype"):
        value = getattr(layer, attr, None)
        if isinstance(value, torch.dtype):
            return value
    return None


def _params_dtype(layer, why: str) -> torch.dtype:
    dt = declared_compute_dtype(layer)
    if dt is None:
        raise ValueError(
            f"kv_b_proj layer {type(layer).__name__}: {why}, so the activation dtype must come from "
            "its `params_dtype` (or `compute_dtype`) attribute, which it lacks; expected a torch.dtype "
            "such as torch.bfloat16"
        )
    if dt not in FLOAT_DTYPES:
        raise ValueError(
            f"kv_b_proj layer {type(layer).__name__}: params_dtype/compute_dtype must be one of "
            f"{FLOAT_DTYPES} (the model dtype), got {dt}"
        )
    return dt


def kv_b_proj_input_dtype(layer, use_fp8_prefill: bool) -> torch.dtype | None:
    """The dtype to cast kv_c to before `layer`, or None for "no cast" (see module doc).

    `use_fp8_prefill` must be a bool (or numpy bool): "no" or 0 is a ValueError, since
    truthiness would turn FP8 prefill on for "no"."""
    use_fp8_prefill = check_bool(use_fp8_prefill, "use_fp8_prefill")
    weight = getattr(layer, "weight", None)
    if weight is None:
        return _params_dtype(layer, "it has no `.weight` (GPTQ/AWQ-style weight-only layer)")
    wd = getattr(weight, "dtype", None)
    if not isinstance(wd, torch.dtype):
        raise ValueError(
            f"kv_b_proj layer {type(layer).__name__}: `.weight` must be a tensor (with a torch "
            f"dtype), got {type(weight).__name__}"
        )
    if wd in FLOAT_DTYPES:
        return wd
    if wd in FP8_DTYPES:
        return wd if use_fp8_prefill else None
    if wd == torch.uint8:
        # NVFP4 is W4A16 here: it never accepts fp8. Under FP8 prefill the
        # workspace holds fp8, so "no cast" would hand fp8 to the linear.
        return _params_dtype(layer, "it stores NVFP4 (uint8) weights under FP8 prefill") if use_fp8_prefill else None
    if not wd.is_floating_point and not wd.is_complex and wd != torch.bool:
        return _params_dtype(layer, f"its weight is stored as {wd} (a packed layout)")
    raise ValueError(
        f"kv_b_proj layer {type(layer).__name__}: unsupported stored weight dtype {wd}; expected "
        f"bf16/fp16/fp32, an fp8 dtype, uint8 (NVFP4) or a packed integer dtype"
    )
