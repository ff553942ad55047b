"""kv_b_proj weight formats read from modules and checkpoint-style objects (SPEC §5).

`weight_format_from_module(module, params_dtype=None, *, scale_layout=None)`
detects the format from the tensors an `nn.Linear`, an upstream (vLLM-style)
layer or any object with the checkpoint's attribute names holds:

| tensors                                            | format                          |
|----------------------------------------------------|---------------------------------|
| `weight` bf16/fp16/fp32 (nn.Linear; `bias` None)     | DenseWeight                     |
| `weight` fp8 e4m3 + `weight_scale_inv`              | Fp8BlockWeight (DeepSeek)       |
| `weight` fp8 e4m3 + `weight_scale` [ceil(N/128), ceil(K/128)], or `weight_block_size` set | Fp8BlockWeight |
| `weight` fp8 e4m3 + `weight_scale` [], [1], [N] or [N, 1] | Fp8Weight per-tensor / per-channel |
| `weight` uint8 [N, K/2] + `weight_scale` e4m3 [N, K/16] + `weight_scale_2` | Nvfp4Weight (ModelOpt) |
| `qweight` int32 [K/8, N] + `scales` [K/g, N] (+ `qzeros`/`zeros`, `g_idx`) | Int4GroupWeight (GPTQ layout) |
| `weight` int32 [K_pad/16, 4N_pad] + `weight_scale` or `weight_scale_inv` [G, N_pad] + a `workspace` (or `marlin_workspace`) attribute, or `quant_method.use_marlin` (vLLM 0.33) | MarlinFp8Weight (vLLM Marlin fp8 after loading; padded N/K cut to the stated sizes, no copy) |
| `weight` uint8 + `weight_scale` + `weight_global_scale` (0-d) | Nvfp4Weight (vLLM 0.33 post-load; weight padded to 32 cut to the stated sizes; scale layout stated) |
| `W_UK_T` [N, P, L] + `W_UV` [N, L, V] (vLLM's MLA attention after process_weights_after_loading) | DenseWeight (`from_vllm_mla`) |

Model dtype (`params_dtype` of the result): the `params_dtype` argument, else
the object's `compute_dtype`, `params_dtype` or `orig_dtype` (vLLM's fp8
layers set `orig_dtype`); a dense weight is its own dtype (converted when the
argument asks for another one). The storage dtype of a quantized weight is
never taken for it (SPEC §5), so a quantized object without any of these is a
ValueError asking for `params_dtype=`.

Other facts:
- `input_scale` (static activation scale of W8A8/W4A4 checkpoints) is ignored:
  the fp8 linears here quantize activations themselves (per token or per
  1×128 group) or take the per-call `x_scale` of FP8 prefill, and NVFP4 runs
  W4A16 here.
- A weight stored transposed ([K, N], as vLLM leaves some fp8 weights after
  loading) is turned back when the object states its sizes
  (`output_size_per_partition`/`input_size_per_partition`, or nn.Linear's
  `out_features`/`in_features`) and they tell the two orientations apart.
- Scale layouts (NVFP4 and block FP8) are stated, never inferred from shapes:
  after loading, vLLM swizzles NVFP4 block scales for CUTLASS (128x4; at
  kv_b_proj sizes the swizzled tensor has the checkpoint's shape) and some of
  its block-FP8 backends transpose or pad `weight_scale_inv`. The layout comes
  from the `scale_layout` argument, else the object's `weight_scale_layout`
  attribute (the two must agree when both are given): NVFP4 "linear" |
  "swizzled" (weights.NVFP4_SCALE_LAYOUTS), block FP8 "linear" | "transposed" |
  "linear_padded" | "transposed_padded" (weights.FP8_BLOCK_SCALE_LAYOUTS; a
  non-linear one also marks an fp8 weight as block-scaled). Without either, a
  serving-engine layer, recognised by its `quant_method` attribute (every vLLM
  linear layer has one), is a ValueError asking for the layout; any other
  object holds checkpoint tensors, so the DEFAULT is "linear" (the checkpoint's
  layout). Per-tensor / per-channel fp8 scales have no layout.
- GPTQ `qzeros` packed int32 [K/g, N/8] (8 zero points along N per word,
  lowest bits first) store zero − 1 (GPTQ v1 checkpoints) unless the object
  says `checkpoint_format = "gptq_v2"`; an unpacked [K/g, N] `qzeros`/`zeros`
  holds the zero points themselves; none means symmetric (zero 8). Only 4-bit
  weights, and `g_idx` only in its trivial (no act-order) form.
- int32 `.weight` is read as vLLM's post-load Marlin fp8 layout (mla_ext's
  own, see mla_ext/kv_b_proj/marlin.py) only when the object says it is one:
  it has the Marlin `workspace` (or `marlin_workspace`) attribute vLLM's
  `prepare_fp8_layer_for_marlin` set before 0.33, or its `quant_method` says
  so (vLLM 0.33's Fp8LinearMethod: `use_marlin = True`), or, stating nothing,
  its tensors are exactly Marlin fp8's (int32 [K_pad/16, 4*N_pad] and one
  16-bit scale tensor [G, N_pad], no global scale), or the caller calls
  `MarlinFp8Weight.from_vllm_layer(layer)` itself. The tensors are used
  without a copy. Sizes: `output_size_per_partition`/`input_size_per_partition`
  (the TRUE sizes: vLLM 0.33 zero-pads N and K to Marlin's tiles, N=200 ->
  256, and the padding is cut off), else read off the Marlin shape [K/16, 4N];
  group size:
  `weight_block_size[1]` (block fp8), else per-channel; scales: `weight_scale`
  or `weight_scale_inv` (vLLM keeps the checkpoint's name), in the model dtype.
  An int32 weight without such a statement is a ValueError (a shape alone
  does not say which packing it is).
A mapping (a state-dict slice {"weight": ..., "weight_scale_inv": ...}) is
read like an object with those attributes. What cannot be recognised is a
ValueError listing the tensor attributes found (name, dtype, shape).
"""
from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.input_dtype import declared_compute_dtype

# Names read through getattr (objects may expose them as properties).
_KNOWN_TENSORS = ("weight", "bias", "weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale",
                  "input_scale", "qweight", "scales", "qzeros", "zeros", "g_idx", "W_UK_T", "W_UV")
_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale")


def _get(obj, name: str):
    try:
        return getattr(obj, name, None)
    except (AttributeError, RuntimeError, ValueError):
        return None


def _tensor_attrs(obj) -> dict[str, torch.Tensor]:
    """Every tensor the object holds directly (parameters, buffers, attributes), detached."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.nn.Module):
        found.update(obj.named_parameters(recurse=False))
        found.update(obj.named_buffers(recurse=False))
    for name, value in getattr(obj, "__dict__", {}).items():
        if isinstance(value, torch.Tensor) and not name.startswith("_"):
            found.setdefault(name, value)
    for name in _KNOWN_TENSORS:
        value = _get(obj, name)
        if isinstance(value, torch.Tensor):
            found.setdefault(name, value)
    return {name: t.detach() for name, t in found.items()}


def _listing(tensors: dict[str, torch.Tensor]) -> str:
    if not tensors:
        return "none"
    return ", ".join(f"{n} {t.dtype} {list(t.shape)}" for n, t in tensors.items())


def _model_dtype(obj, params_dtype, arg: str, what: str) -> torch.dtype:
    if params_dtype is None:
        params_dtype = declared_compute_dtype(obj)
    if params_dtype is None and isinstance(_get(obj, "orig_dtype"), torch.dtype):
        params_dtype = obj.orig_dtype
    if params_dtype is None:
        raise ValueError(
            f"params_dtype: {arg} stores {what}, so the model (activation) dtype cannot be read from its "
            f"storage; pass params_dtype= (one of {W.FLOAT_DTYPES}) or give the object a params_dtype or "
            "orig_dtype attribute")
    if params_dtype not in W.FLOAT_DTYPES:
        raise ValueError(f"params_dtype: expected one of {W.FLOAT_DTYPES} (the model dtype), got {params_dtype}")
    return params_dtype


def _declared_sizes(obj) -> tuple[int, int] | None:
    """(output rows, input columns) the object states, if it does."""
    for out_attr, in_attr in (("output_size_per_partition", "input_size_per_partition"),
                              ("out_features", "in_features")):
        n, k = _get(obj, out_attr), _get(obj, in_attr)
        if isinstance(n, int) and isinstance(k, int):
            return n, k
    return None


def _oriented(obj, weight: torch.Tensor, arg: str, per_byte: int = 1, padded_ok: bool = False) -> torch.Tensor:
    """The weight as [N, K/per_byte], undoing a stored transpose when the object's sizes tell.
    `padded_ok`: a weight zero-padded past the stated sizes (vLLM pads NVFP4 weights
    to multiples of 32 for CUTLASS) is cut to them (a view)."""
    sizes = _declared_sizes(obj)
    if sizes is None or weight.dim() != 2:
        return weight
    want = (sizes[0], sizes[1] // per_byte)
    if tuple(weight.shape) == want:
        return weight
    if per_byte == 1 and tuple(weight.shape) == want[::-1]:
        return weight.t()
    if padded_ok and weight.shape[0] >= want[0] and weight.shape[1] >= want[1]:
        return weight[: want[0], : want[1]]
    raise ValueError(f"{arg}.weight: expected shape {list(want)} from the object's stated sizes "
                     f"(N={sizes[0]}, K={sizes[1]}), got {list(weight.shape)}")


_SCALE_LAYOUT_ATTR = "weight_scale_layout"


def _is_serving_layer(obj) -> bool:
    """A serving engine's post-load layer: vLLM's linear layers carry `quant_method`,
    and only vLLM's post-load NVFP4 layers hold `weight_global_scale` (a checkpoint
    has `weight_scale_2`), so a bare object with it is one too."""
    return _get(obj, "quant_method") is not None or _get(obj, "weight_global_scale") is not None


def _stated_scale_layout(obj, scale_layout, arg: str) -> str | None:
    """The scale layout the caller (`scale_layout`) or the object (`weight_scale_layout`) states."""
    declared = _get(obj, _SCALE_LAYOUT_ATTR)
    for name, value in (("scale_layout", scale_layout), (f"{arg}.{_SCALE_LAYOUT_ATTR}", declared)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name}: expected a layout name (str) or None, got {value!r}")
    if scale_layout is not None and declared is not None and scale_layout != declared:
        raise ValueError(f"scale_layout: {scale_layout!r} contradicts {arg}.{_SCALE_LAYOUT_ATTR} = {declared!r}")
    return scale_layout if scale_layout is not None else declared


def _require_stated(obj, layout: str | None, what: str, choices: tuple[str, ...], arg: str) -> str:
    """The stated layout; "linear" (the checkpoint's) for a checkpoint-style object;
    a ValueError for a serving-engine layer that states none."""
    if layout is None:
        if _is_serving_layer(obj):
            raise ValueError(
                f"scale_layout: {arg} is a serving-engine layer (it has `quant_method` as vLLM's linear layers "
                f"do, or vLLM's post-load `weight_global_scale`), whose {what} scales may have been re-laid out after loading (vLLM swizzles NVFP4 block "
                "scales for CUTLASS, 128x4, keeping the checkpoint's shape at kv_b_proj sizes; some block-FP8 "
                f"backends transpose or pad weight_scale_inv); state the layout, one of {choices}: pass "
                f"scale_layout=... or set {arg}.{_SCALE_LAYOUT_ATTR}")
        return "linear"
    if layout not in choices:
        raise ValueError(f"scale_layout: expected one of {choices} for {what} scales, got {layout!r}")
    return layout


def _fp8(obj, t: dict[str, torch.Tensor], weight: torch.Tensor, dt: torch.dtype, arg: str,
         scale_layout: str | None = None) -> W.WeightFormat:
    layout = _stated_scale_layout(obj, scale_layout, arg)
    inv, scale = t.get("weight_scale_inv"), t.get("weight_scale")
    if inv is not None and scale is not None:
        raise ValueError(f"{arg}: an fp8 weight takes `weight_scale` or `weight_scale_inv`, not both; "
                         f"tensor attributes found: {_listing(t)}")
    if inv is None and scale is None:
        raise ValueError(f"{arg}: an fp8 weight needs `weight_scale` (per-tensor [1] / per-channel [N]) or "
                         f"`weight_scale_inv` (block 128x128); tensor attributes found: {_listing(t)}")
    weight = _oriented(obj, weight, arg, padded_ok=True)
    n, k = weight.shape
    block_size = _get(obj, "weight_block_size")
    block_shape = (-(-n // ref.FP8_BLOCK), -(-k // ref.FP8_BLOCK))
    s = inv if inv is not None else scale
    if inv is not None or block_size is not None or layout not in (None, "linear") or (
            s.dim() == 2 and tuple(s.shape) == block_shape and tuple(s.shape) != (n, 1)):
        layout = _require_stated(obj, layout, "block-FP8", W.FP8_BLOCK_SCALE_LAYOUTS, arg)
        return W.Fp8BlockWeight(weight, s, dt, tuple(block_size) if block_size is not None else (128, 128),
                                scale_layout=layout)
    return W.Fp8Weight(weight, s, dt)


def _nvfp4(obj, t: dict[str, torch.Tensor], weight: torch.Tensor, dt: torch.dtype, arg: str,
           scale_layout: str | None = None) -> W.Nvfp4Weight:
    # vLLM 0.33's post-load ModelOpt layer replaces `weight_scale_2` by the 0-d
    # `weight_global_scale` (its max over the fused shards: the same multiplier).
    scale = t.get("weight_scale")
    if "weight_scale_2" in t and "weight_global_scale" in t:
        raise ValueError(f"{arg}: expected one of `weight_scale_2` (checkpoint) or `weight_global_scale` "
                         f"(vLLM post-load), got both; tensor attributes found: {_listing(t)}")
    scale_2 = t.get("weight_scale_2", t.get("weight_global_scale"))
    if scale is None or scale_2 is None:
        raise ValueError(f"{arg}: a uint8 weight is read as NVFP4 and needs `weight_scale` (e4m3 [N, K/16]) and "
                         f"`weight_scale_2` (fp32 global; vLLM post-load: `weight_global_scale`); tensor "
                         f"attributes found: {_listing(t)}")
    scale_2 = scale_2.reshape(-1) if scale_2.dim() == 0 else scale_2
    layout = _require_stated(obj, _stated_scale_layout(obj, scale_layout, arg), "NVFP4", W.NVFP4_SCALE_LAYOUTS,
                             arg)
    return W.Nvfp4Weight(weight, scale, scale_2, dt, scale_layout=layout)


def _int4_zeros(obj, t: dict[str, torch.Tensor], groups: int, n: int, arg: str) -> torch.Tensor | None:
    if "qzeros" in t and "zeros" in t:
        raise ValueError(f"{arg}: expected one of `qzeros` or `zeros`, got both")
    z = t.get("qzeros", t.get("zeros"))
    if z is None or z.numel() == 0:
        return None
    if tuple(z.shape) == (groups, n):
        return z
    if z.dtype == torch.int32 and n % 8 == 0 and tuple(z.shape) == (groups, n // 8):
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=z.device)
        unpacked = ((z.unsqueeze(-1) >> shifts) & 0xF).reshape(groups, n)
        v2 = _get(obj, "checkpoint_format") == "gptq_v2"
        return unpacked if v2 else unpacked + 1
    raise ValueError(f"{arg}.qzeros: expected int32 [K/group, N/8] = {[groups, n // 8]} (packed, GPTQ) or "
                     f"[K/group, N] = {[groups, n]} zero points, got {z.dtype} {list(z.shape)}")


def _int4(obj, t: dict[str, torch.Tensor], dt: torch.dtype, arg: str) -> W.Int4GroupWeight:
    qweight, scales = t["qweight"], t.get("scales")
    bits = _get(obj, "weight_bits")
    bits = _get(obj, "bits") if bits is None else bits
    if bits is not None and bits != 4:
        raise ValueError(f"{arg}: expected 4-bit weights (weight_bits/bits = 4), got {bits!r}")
    if scales is None or qweight.dim() != 2 or scales.dim() != 2 or scales.shape[1] != qweight.shape[1]:
        raise ValueError(f"{arg}: expected GPTQ layout qweight int32 [K/8, N] (8 values along K per word) with "
                         f"scales [K/group, N]; AWQ-style packing along N is not supported; tensor attributes "
                         f"found: {_listing(t)}")
    k, n, groups = qweight.shape[0] * 8, qweight.shape[1], scales.shape[0]
    group_size = _get(obj, "group_size")
    if group_size is None or group_size == -1:  # -1: one group spanning K
        if groups == 0 or k % groups:
            raise ValueError(f"{arg}.scales: expected [K/group, N] with K={k}, got {list(scales.shape)}")
        group_size = k // groups
    zeros = _int4_zeros(obj, t, groups, n, arg)
    g_idx = t.get("g_idx")
    if g_idx is not None and g_idx.numel() > 0:
        trivial = torch.arange(k, device=g_idx.device) // group_size
        if g_idx.shape != trivial.shape or not torch.equal(g_idx.to(trivial.dtype), trivial):
            raise ValueError(f"{arg}.g_idx: expected the trivial order arange(K) // group_size (act-order / "
                             "desc_act weights are not supported)")
    return W.Int4GroupWeight(qweight, scales, group_size, dt, zeros)


_MARLIN_MARKERS = ("workspace", "marlin_workspace")


def _marlin_fp8_tensors(t: dict[str, torch.Tensor]) -> bool:
    """The tensors are exactly what vLLM's prepare_fp8_layer_for_marlin leaves: an
    int32 `weight` [K_pad/16, 4*N_pad] (N_pad a multiple of 64) and ONE scale tensor,
    `weight_scale` or `weight_scale_inv`, in a 16-bit model dtype (the bias-folded
    Marlin scales), [G, N_pad] or [N_pad], and no global scale. No other int32 layout
    vLLM leaves in `weight` has that: its NVFP4/MXFP4 Marlin layers keep e4m3/ue8m0
    block scales (and a global scale), GPTQ/AWQ Marlin layers `qweight`."""
    w = t.get("weight")
    scales = [t[n] for n in ("weight_scale", "weight_scale_inv") if n in t]
    if w is None or w.dtype != torch.int32 or w.dim() != 2 or w.shape[1] % 256 or len(scales) != 1:
        return False
    if "weight_scale_2" in t or "weight_global_scale" in t or "qweight" in t:
        return False
    s = scales[0]
    return s.dtype in (torch.bfloat16, torch.float16) and s.dim() in (1, 2) and s.shape[-1] == w.shape[1] // 4


def _states_vllm_marlin(obj, t: dict[str, torch.Tensor]) -> bool:
    """The object is a vLLM Marlin fp8 layer: a `workspace` attribute (set by vLLM's
    repack before 0.33); or its quant method says so (vLLM 0.33 sets no workspace;
    its Fp8LinearMethod has `use_marlin`, True when its kernel is the Marlin FP8
    one, and that kernel's class names Marlin): an explicit `use_marlin = False` is
    believed; or, with no statement, its tensors are exactly Marlin fp8's
    (`_marlin_fp8_tensors`)."""
    if any(_get(obj, name) is not None for name in _MARLIN_MARKERS):
        return True
    method = _get(obj, "quant_method")
    said = _get(method, "use_marlin") if method is not None else None
    if isinstance(said, bool):
        return said
    kernel = _get(method, "fp8_linear") if method is not None else None
    if kernel is not None and "marlin" in type(kernel).__name__.lower():
        return True
    return _marlin_fp8_tensors(t)


def _marlin(obj, t: dict[str, torch.Tensor], dt: torch.dtype, arg: str) -> W.MarlinFp8Weight:
    weight = t["weight"]
    if "weight_scale_2" in t or "weight_global_scale" in t:
        # vLLM's Marlin NVFP4 layer also has an int32 weight and a workspace; its
        # nibbles and e4m3 group scales are not Marlin fp8 bytes.
        raise ValueError(f"{arg}: an int32 Marlin weight with a global scale is vLLM's Marlin NVFP4 "
                         "layout, which is not supported; build Nvfp4Weight from the checkpoint tensors "
                         f"(weight, weight_scale, weight_scale_2); tensor attributes found: {_listing(t)}")
    inv, scale = t.get("weight_scale_inv"), t.get("weight_scale")
    if (inv is None) == (scale is None):
        raise ValueError(f"{arg}: a vLLM Marlin fp8 layer needs exactly one of `weight_scale` / `weight_scale_inv` "
                         f"(the permuted, bias-folded Marlin scales); tensor attributes found: {_listing(t)}")
    if weight.dim() != 2:
        raise ValueError(f"{arg}.weight: expected a 2-D Marlin qweight [K/16, 4N], got {list(weight.shape)}")
    block = _get(obj, "weight_block_size")
    if block is None:
        group_size = -1
    elif isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) for b in block):
        group_size = block[1]  # vLLM's Marlin groups along K by the block's K size
    else:
        raise ValueError(f"{arg}.weight_block_size: expected None or [block_n, block_k], got {block!r}")
    sizes = _declared_sizes(obj)
    # The object stated it is Marlin, so its shape gives the sizes when it states none.
    n, k = sizes if sizes is not None else (weight.shape[1] // 4, weight.shape[0] * 16)
    return W.MarlinFp8Weight.from_vllm(weight, scale if scale is not None else inv, n, k, group_size, dt)


def marlin_vllm_layer(layer, params_dtype: torch.dtype | None = None, *, arg: str = "layer") -> W.MarlinFp8Weight:
    """`MarlinFp8Weight.from_vllm_layer`: a vLLM Marlin fp8 layer (or a mapping of its
    attributes) after process_weights_after_loading, read without a copy."""
    if isinstance(layer, Mapping):
        layer = types.SimpleNamespace(**{str(k): v for k, v in layer.items()})
    t = _tensor_attrs(layer)
    weight = t.get("weight")
    if weight is None or weight.dtype != torch.int32:
        raise ValueError(f"{arg}.weight: expected the int32 Marlin qweight [K/16, 4N]; tensor attributes found: "
                         f"{_listing(t)}")
    return _marlin(layer, t, _model_dtype(layer, params_dtype, arg, "Marlin-packed int32 weights"), arg)


def weight_format_from_module(module, params_dtype: torch.dtype | None = None, *,
                              scale_layout: str | None = None, arg: str = "module") -> W.WeightFormat:
    """The kv_b_proj WeightFormat of `module` (see the module doc for what is read).

    A WeightFormat is returned as is, a KvBProj gives its `weight_format`.
    `scale_layout` states how NVFP4 / block-FP8 scales are laid out (default: the
    object's `weight_scale_layout`, else "linear" for checkpoint-style objects and
    an error for serving-engine layers; see the module doc).
    `arg` names the argument in error messages."""
    if isinstance(module, W.WeightFormat):
        return module
    if isinstance(_get(module, "weight_format"), W.WeightFormat):
        return module.weight_format
    accepted = (f"a kv_b_proj WeightFormat ({', '.join(c.__name__ for c in W.ALL_FORMATS)}), an nn.Linear, "
                "or a module/object holding checkpoint tensors (weight + scales, or qweight + scales)")
    if isinstance(module, Mapping):  # a state-dict-like {name: tensor or attribute}
        module = types.SimpleNamespace(**{str(k): v for k, v in module.items()})
    if module is None or isinstance(module, (torch.Tensor, str, bytes, int, float, list, tuple)):
        raise ValueError(f"{arg}: expected {accepted}, got {type(module).__name__}")
    t = _tensor_attrs(module)
    if "W_UK_T" in t and "W_UV" in t and "weight" not in t and "qweight" not in t:
        # vLLM's MLA attention layer (or impl) after process_weights_after_loading.
        dense = W.DenseWeight.from_vllm_mla(t["W_UK_T"], t["W_UV"])
        return dense if params_dtype is None else W.DenseWeight(dense.weight.to(params_dtype))
    if params_dtype is not None and params_dtype not in W.FLOAT_DTYPES:
        raise ValueError(f"params_dtype: expected one of {W.FLOAT_DTYPES} (the model dtype), got {params_dtype}")
    if t.get("bias") is not None:
        raise ValueError(f"{arg}.bias: expected None (kv_b_proj has no bias), got a {t['bias'].dtype} "
                         f"{list(t['bias'].shape)} tensor")
    weight = t.get("weight")
    if scale_layout is not None and (weight is None or weight.dtype not in (torch.float8_e4m3fn, torch.uint8)):
        raise ValueError(f"scale_layout: only NVFP4 (uint8) and block-FP8 weights have a scale layout; {arg} "
                         f"holds {_listing(t)}")
    if "qweight" in t and weight is None:
        return _int4(module, t, _model_dtype(module, params_dtype, arg, "packed int4 weights"), arg)
    if weight is None or weight.dim() != 2:
        raise ValueError(f"{arg}: cannot recognise a kv_b_proj weight format in {type(module).__name__}: "
                         f"expected {accepted}; tensor attributes found: {_listing(t)}")
    wd = weight.dtype
    if wd in W.FLOAT_DTYPES:
        stray = [n for n in _WEIGHT_SCALES if n in t]
        if stray:
            raise ValueError(f"{arg}: a {wd} weight is read as dense, which has no scales, but {stray} "
                             f"are present; tensor attributes found: {_listing(t)}")
        weight = _oriented(module, weight, arg)
        return W.DenseWeight(weight if params_dtype is None else weight.to(params_dtype))
    if wd == torch.float8_e4m3fn:
        return _fp8(module, t, weight, _model_dtype(module, params_dtype, arg, f"{wd} weights"), arg, scale_layout)
    if wd == torch.uint8:
        weight = _oriented(module, weight, arg, per_byte=2, padded_ok=True)
        return _nvfp4(module, t, weight, _model_dtype(module, params_dtype, arg, "NVFP4 (uint8) weights"), arg,
                      scale_layout)
    if wd == torch.int32:
        if _states_vllm_marlin(module, t):
            return _marlin(module, t, _model_dtype(module, params_dtype, arg, "Marlin-packed int32 weights"), arg)
        raise ValueError(f"{arg}.weight: int32 is a packed layout and the object does not say which (e.g. vLLM's "
                         "Marlin fp8 layer has a `workspace` attribute); for a vLLM Marlin fp8 layer call "
                         "MarlinFp8Weight.from_vllm_layer(layer) or MarlinFp8Weight.from_vllm(qweight, scales, "
                         "size_n, size_k, group_size, params_dtype), or build MarlinFp8Weight.from_checkpoint("
                         f"weight, weight_scale, params_dtype) from the checkpoint fp8 tensors; tensor "
                         f"attributes found: {_listing(t)}")
    raise ValueError(f"{arg}.weight: unsupported dtype {wd}; expected bf16/fp16/fp32 (dense), float8_e4m3fn "
                     f"(fp8) or uint8 (NVFP4); tensor attributes found: {_listing(t)}")
