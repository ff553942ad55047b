"""kv_b_proj weight formats (SPEC §5), one class per checkpoint format.

Every class takes the tensors a checkpoint (or an upstream layer) holds via
`from_checkpoint(...)`, has a `from_dense(w, ...)` quantizer (for tests and
users) and `dequantize(dtype)` -> [N, K]. The attributes mirror what an
upstream layer exposes, because `kv_b_proj_input_dtype` must treat these
objects and upstream layers alike:
- `.weight` is the STORED tensor (int32 for Marlin, uint8 for NVFP4, fp8 for
  the W8A8 formats) and `Int4GroupWeight` has no `.weight` at all;
- `.params_dtype` is the model (compute) dtype, the only authority on which
  dtype activations have; the storage dtype never is.
N is the output width (heads * (P + V)), K the input width (kv_lora_rank).

Tensor parallelism: `slice_rows(start, stop)` cuts output rows out of any
format (scales follow their rows; a cut through a quantization block or a
packing tile is a ValueError saying which), and `shard(num_heads, head_rows,
tp_size, rank)` takes one rank's heads (`mla_ext.kv_b_proj.shard`).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from mla_ext.kv_b_proj import reference as ref

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACT_DTYPES = (torch.bfloat16, torch.float16)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_params_dtype(params_dtype) -> torch.dtype:
    _require(params_dtype in FLOAT_DTYPES,
             f"params_dtype must be one of {FLOAT_DTYPES}, got {params_dtype}")
    return params_dtype


def _rows(t: torch.Tensor, start: int, stop: int, dim: int = 0) -> torch.Tensor:
    """An owned, contiguous copy of t[start:stop] along `dim` (a shard must not
    keep the full weight's storage alive)."""
    return t.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def check_row_cut(start: int, stop: int, n: int, unit: int, what: str, advice: str = "") -> None:
    """ValueError unless rows [start, stop) of an n-row weight start and end on
    a multiple of `unit` rows (or at n): `what` names the unit, e.g. "128-row
    quantization block"."""
    for edge in (start, stop):
        if edge % unit and edge != n:
            i = edge // unit
            raise ValueError(f"rows [{start}, {stop}) split the {what} {i} "
                             f"(rows [{i * unit}, {min(i * unit + unit, n)})) "
                             f"at row {edge}; slices must start and end on a multiple of {unit} rows (or at N={n})"
                             + (f": {advice}" if advice else ""))


def _check_finite_positive(name: str, t: torch.Tensor) -> None:
    # One host read at construction time (never on the hot path).
    tf = t.float()
    _require(bool(torch.isfinite(tf).all()) and bool((tf > 0).all()),
             f"{name} must be finite and > 0 everywhere")


def _check_e4m3_weight(name: str, w: torch.Tensor) -> None:
    """e4m3fn has NaN (bytes 0x7F/0xFF) and no inf: a NaN byte in a weight would
    turn whole output columns into NaN. One pass at construction time."""
    nan = (w.view(torch.uint8) & 0x7F) == 0x7F
    count = int(nan.sum())
    if count:
        row, col = (int(i) for i in nan.nonzero()[0])
        raise ValueError(f"{name}: expected finite e4m3 values; found {count} NaN bytes "
                         f"(0x7F/0xFF), the first at [{row}, {col}]")


def _check_int_arg(name: str, value, minimum: int) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
             f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


class WeightFormat:
    """Common behaviour: shape, dtype bookkeeping, dequantize, device moves."""

    name: str = ""
    N: int
    K: int
    params_dtype: torch.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activation/output dtype of this layer (== params_dtype)."""
        return self.params_dtype

    @property
    def device(self) -> torch.device:
        return self._first_tensor().device

    def _first_tensor(self) -> torch.Tensor:
        for v in vars(self).values():
            if isinstance(v, torch.Tensor):
                return v
        raise ValueError(f"{type(self).__name__} holds no tensor")

    def dequantize_fp32(self) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} does not define dequantize_fp32")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N, K] weight in `dtype` (default: params_dtype)."""
        return self.dequantize_fp32().to(dtype or self.params_dtype)

    def to(self, device) -> "WeightFormat":
        out = copy.copy(self)
        for k, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                setattr(out, k, v.to(device))
        return out

    def describe(self) -> str:
        return f"{self.name} [N={self.N}, K={self.K}] params_dtype={self.params_dtype}"

    def slice_rows(self, start: int, stop: int) -> "WeightFormat":
        """Output rows [start, stop) of the logical [N, K] weight, in the same format.

        The result owns copies of its tensors. ValueError when the format
        cannot be cut there (a block-scale or packing-tile boundary)."""
        for arg, v in (("start", start), ("stop", stop)):
            _require(isinstance(v, int) and not isinstance(v, bool),
                     f"{arg}: expected an int row index, got {v!r}")
        _require(0 <= start < stop <= self.N,
                 f"rows [start, stop): expected 0 <= start < stop <= N={self.N}, got [{start}, {stop})")
        return self._slice_rows(start, stop)

    def _slice_rows(self, start: int, stop: int) -> "WeightFormat":
        raise TypeError(f"{type(self).__name__} does not define _slice_rows")

    def shard(self, num_heads: int, head_rows: int, tp_size: int, rank: int) -> "WeightFormat":
        """This rank's heads of the full kv_b_proj (see `shard.shard_weight`)."""
        from mla_ext.kv_b_proj.shard import shard_weight

        return shard_weight(self, num_heads, head_rows, tp_size, rank)


class DenseWeight(WeightFormat):
    name = "dense"

    def __init__(self, weight: torch.Tensor):
        _require(weight.dim() == 2, f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        _require(weight.dtype in FLOAT_DTYPES, f"weight dtype must be one of {FLOAT_DTYPES}, got {weight.dtype}")
        self.weight = weight.contiguous()
        self.N, self.K = weight.shape
        self.params_dtype = weight.dtype

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor) -> "DenseWeight":
        return cls(weight)

    @classmethod
    def from_dense(cls, w: torch.Tensor, dtype: torch.dtype | None = None) -> "DenseWeight":
        return cls(w.to(dtype or w.dtype))

    def dequantize_fp32(self) -> torch.Tensor:
        return self.weight.float()

    def _slice_rows(self, start: int, stop: int) -> "DenseWeight":
        return DenseWeight(_rows(self.weight, start, stop))


class Fp8Weight(WeightFormat):
    """W8A8 fp8 e4m3 with a per-tensor [1] or per-channel [N] fp32 scale."""

    name = "fp8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, params_dtype: torch.dtype):
        _require(weight.dim() == 2, f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        _require(weight.dtype == torch.float8_e4m3fn, f"weight dtype must be torch.float8_e4m3fn, got {weight.dtype}")
        _check_e4m3_weight("weight", weight)
        n = weight.shape[0]
        scale = weight_scale.reshape(-1).float()
        _require(scale.numel() in (1, n),
                 f"weight_scale must have 1 (per-tensor) or N={n} (per-channel) elements, got {scale.numel()}")
        _check_finite_positive("weight_scale", scale)
        self.weight = weight.contiguous()
        self.weight_scale = scale.contiguous()
        self.N, self.K = weight.shape
        self.params_dtype = _check_params_dtype(params_dtype)

    @property
    def scheme(self) -> str:
        return "per_channel" if self.weight_scale.numel() > 1 else "per_tensor"

    def describe(self) -> str:
        return f"fp8 {self.scheme} " + super().describe().split(" ", 1)[1]

    @classmethod
    def from_checkpoint(cls, weight, weight_scale, params_dtype) -> "Fp8Weight":
        return cls(weight, weight_scale, params_dtype)

    @classmethod
    def from_dense(cls, w: torch.Tensor, per_channel: bool = True,
                   params_dtype: torch.dtype | None = None) -> "Fp8Weight":
        wf = w.float()
        amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax().reshape(1)
        scale = amax.clamp(min=1e-12) / ref.FP8_E4M3_MAX
        q = ref.quantize_e4m3(wf / (scale.view(-1, 1) if per_channel else scale))
        return cls(q, scale, params_dtype or w.dtype)

    def dequantize_fp32(self) -> torch.Tensor:
        return ref.dequant_fp8(self.weight, self.weight_scale)

    def channel_scales(self) -> torch.Tensor:
        """fp32 [N]: the scale of every output channel."""
        return self.weight_scale.expand(self.N).contiguous()

    def _slice_rows(self, start: int, stop: int) -> "Fp8Weight":
        # Per-tensor: the one scale is kept; per-channel: its rows follow the weight's.
        s = self.weight_scale.clone() if self.weight_scale.numel() == 1 else _rows(self.weight_scale, start, stop)
        return Fp8Weight(_rows(self.weight, start, stop), s, self.params_dtype)


class Fp8BlockWeight(WeightFormat):
    """DeepSeek block fp8: e4m3 [N, K] and fp32 `weight_scale_inv` [ceil(N/128), ceil(K/128)].

    Despite its checkpoint name, `weight_scale_inv` multiplies: w = q * s.
    """

    name = "fp8_block"

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 params_dtype: torch.dtype, block_size=(128, 128)):
        _require(tuple(block_size) == (ref.FP8_BLOCK, ref.FP8_BLOCK),
                 f"block_size must be (128, 128), got {tuple(block_size)}")
        _require(weight.dim() == 2, f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        _require(weight.dtype == torch.float8_e4m3fn, f"weight dtype must be torch.float8_e4m3fn, got {weight.dtype}")
        _check_e4m3_weight("weight", weight)
        n, k = weight.shape
        want = (-(-n // ref.FP8_BLOCK), -(-k // ref.FP8_BLOCK))
        _require(tuple(weight_scale_inv.shape) == want,
                 f"weight_scale_inv must have shape {want} for weight {tuple(weight.shape)}, "
                 f"got {tuple(weight_scale_inv.shape)}")
        _check_finite_positive("weight_scale_inv", weight_scale_inv)
        self.weight = weight.contiguous()
        self.weight_scale_inv = weight_scale_inv.float().contiguous()
        self.N, self.K = n, k
        self.params_dtype = _check_params_dtype(params_dtype)

    @classmethod
    def from_checkpoint(cls, weight, weight_scale_inv, params_dtype, block_size=(128, 128)) -> "Fp8BlockWeight":
        return cls(weight, weight_scale_inv, params_dtype, block_size)

    @classmethod
    def from_dense(cls, w: torch.Tensor, params_dtype: torch.dtype | None = None) -> "Fp8BlockWeight":
        n, k = w.shape
        b = ref.FP8_BLOCK
        gn, gk = -(-n // b), -(-k // b)
        wp = torch.zeros(gn * b, gk * b, dtype=torch.float32, device=w.device)
        wp[:n, :k] = w.float()
        amax = wp.view(gn, b, gk, b).abs().amax(dim=(1, 3))
        scale = amax.clamp(min=1e-12) / ref.FP8_E4M3_MAX
        q = ref.quantize_e4m3(wp / scale.repeat_interleave(b, 0).repeat_interleave(b, 1))
        return cls(q[:n, :k].contiguous(), scale, params_dtype or w.dtype)

    def dequantize_fp32(self) -> torch.Tensor:
        return ref.dequant_fp8_block(self.weight, self.weight_scale_inv)

    def _slice_rows(self, start: int, stop: int) -> "Fp8BlockWeight":
        b = ref.FP8_BLOCK
        check_row_cut(start, stop, self.N, b, f"{b}-row weight_scale_inv block")
        return Fp8BlockWeight(_rows(self.weight, start, stop),
                              _rows(self.weight_scale_inv, start // b, -(-stop // b)), self.params_dtype)


class MarlinFp8Weight(WeightFormat):
    """FP8 weights packed for the Marlin W8A16 kernel: `.weight` is int32.

    The layout is vLLM's post-load Marlin fp8 layout (mla_ext/kv_b_proj/marlin.py):
    `from_vllm` / `from_vllm_layer` wrap a vLLM layer's tensors without a copy,
    `from_checkpoint` / `from_fp8` / `from_dense` pack fp8 weights into it.
    The Marlin scales (in params_dtype) have the bf16/fp16 exponent-bias
    correction folded in, so the packed weight is tied to one activation
    dtype (params_dtype).
    """

    name = "marlin_fp8"

    def __init__(self, packed, params_dtype: torch.dtype):
        _check_params_dtype(params_dtype)
        _require(params_dtype == packed.act_dtype,
                 f"params_dtype must equal the dtype the weight was packed for ({packed.act_dtype}), "
                 f"got {params_dtype}")
        self.packed = packed
        self.N, self.K = packed.N, packed.K
        self.params_dtype = params_dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.qweight

    @property
    def device(self) -> torch.device:
        return self.packed.qweight.device

    def to(self, device) -> "MarlinFp8Weight":
        moved = {f.name: (getattr(self.packed, f.name).to(device)
                          if isinstance(getattr(self.packed, f.name), torch.Tensor)
                          else getattr(self.packed, f.name))
                 for f in dataclasses.fields(self.packed)}
        return MarlinFp8Weight(type(self.packed)(**moved), self.params_dtype)

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, weight_scale: torch.Tensor,
                        params_dtype: torch.dtype, block_size=None) -> "MarlinFp8Weight":
        """fp8 [N, K] with a per-tensor [1], per-channel [N] or block [ceil(N/128), ceil(K/128)] scale."""
        from mla_ext.kv_b_proj.marlin import marlin_fp8_repack

        _require(params_dtype in ACT_DTYPES, f"params_dtype must be bf16 or fp16 for Marlin, got {params_dtype}")
        _require(weight.dtype == torch.float8_e4m3fn, f"weight dtype must be torch.float8_e4m3fn, got {weight.dtype}")
        _check_e4m3_weight("weight", weight)
        n, k = weight.shape
        if block_size is not None:
            blk = Fp8BlockWeight(weight, weight_scale, params_dtype, block_size)
            # Block scales [N/128, K/128] -> Marlin group-128 scales [K/128, N].
            s = blk.weight_scale_inv.repeat_interleave(ref.FP8_BLOCK, 0)[:n].t().contiguous()
            return cls(marlin_fp8_repack(blk.weight, s, params_dtype, group_size=ref.FP8_BLOCK), params_dtype)
        f = Fp8Weight(weight, weight_scale, params_dtype)
        return cls(marlin_fp8_repack(f.weight, f.channel_scales(), params_dtype, group_size=-1), params_dtype)

    @classmethod
    def from_vllm(cls, qweight: torch.Tensor, scales: torch.Tensor, size_n: int, size_k: int,
                  group_size: int, params_dtype: torch.dtype) -> "MarlinFp8Weight":
        """A vLLM Marlin fp8 layer's post-load tensors, used as they are (no copy).

        qweight: the layer's `weight`, int32 [size_k/16, 4*size_n]; scales: its
        `weight_scale` (or `weight_scale_inv` for block fp8), params_dtype
        [G, size_n]; size_n / size_k: `output_size_per_partition` /
        `input_size_per_partition`; group_size: -1, or `weight_block_size[1]`
        (128) for block fp8; params_dtype: the layer's `orig_dtype`."""
        from mla_ext.kv_b_proj.marlin import marlin_fp8_from_vllm

        _require(params_dtype in ACT_DTYPES,
                 f"params_dtype: expected torch.bfloat16 or torch.float16 for Marlin, got {params_dtype}")
        return cls(marlin_fp8_from_vllm(qweight, scales, size_n, size_k, group_size, params_dtype), params_dtype)

    @classmethod
    def from_vllm_layer(cls, layer, params_dtype: torch.dtype | None = None) -> "MarlinFp8Weight":
        """A vLLM Marlin fp8 layer after `process_weights_after_loading` (the caller
        states it is one): reads `weight`, `weight_scale` or `weight_scale_inv`,
        `output_size_per_partition`/`input_size_per_partition`, `weight_block_size`
        and `orig_dtype` (or `params_dtype=`); no copy."""
        from mla_ext.kv_b_proj.from_module import marlin_vllm_layer

        return marlin_vllm_layer(layer, params_dtype)

    @classmethod
    def from_fp8(cls, fmt: "Fp8Weight | Fp8BlockWeight", params_dtype: torch.dtype | None = None) -> "MarlinFp8Weight":
        """Packs a checkpoint W8A8 format (e.g. its tensor-parallel shard) for Marlin:
        per-tensor/per-channel scales become per-channel, block scales group-128."""
        dt = params_dtype or fmt.params_dtype
        if isinstance(fmt, Fp8BlockWeight):
            return cls.from_checkpoint(fmt.weight, fmt.weight_scale_inv, dt, block_size=(128, 128))
        _require(isinstance(fmt, Fp8Weight),
                 f"fmt: expected an Fp8Weight or Fp8BlockWeight, got {type(fmt).__name__}")
        return cls.from_checkpoint(fmt.weight, fmt.weight_scale, dt)

    @classmethod
    def from_dense(cls, w: torch.Tensor, params_dtype: torch.dtype | None = None,
                   group_size: int = -1) -> "MarlinFp8Weight":
        dt = params_dtype or w.dtype
        if group_size == ref.FP8_BLOCK:
            return cls.from_fp8(Fp8BlockWeight.from_dense(w, dt))
        _require(group_size == -1, f"group_size must be -1 (per-channel) or 128, got {group_size}")
        return cls.from_fp8(Fp8Weight.from_dense(w, per_channel=True, params_dtype=dt))

    def dequantize_fp32(self) -> torch.Tensor:
        from mla_ext.kv_b_proj.marlin import marlin_fp8_dequantize

        return marlin_fp8_dequantize(self.packed).float()

    def _slice_rows(self, start: int, stop: int) -> "MarlinFp8Weight":
        from mla_ext.kv_b_proj.marlin import marlin_fp8_slice_rows

        return MarlinFp8Weight(marlin_fp8_slice_rows(self.packed, start, stop), self.params_dtype)


class Nvfp4Weight(WeightFormat):
    """NVFP4: uint8 [N, K/2] (two e2m1 per byte, low nibble = even k), e4m3
    `weight_scale` [N, K/16] and fp32 global `weight_scale_2` [1]:
    w = e2m1 * weight_scale * weight_scale_2 (ModelOpt naming)."""

    name = "nvfp4"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, params_dtype: torch.dtype):
        _require(weight.dim() == 2 and weight.dtype == torch.uint8,
                 f"weight must be uint8 [N, K/2], got {weight.dtype} shape {tuple(weight.shape)}")
        n, k = weight.shape[0], weight.shape[1] * 2
        _require(k % ref.NVFP4_BLOCK == 0, f"K (= 2 * weight.shape[1]) must be a multiple of 16, got {k}")
        _require(weight_scale.dtype == torch.float8_e4m3fn,
                 f"weight_scale dtype must be torch.float8_e4m3fn, got {weight_scale.dtype}")
        _require(tuple(weight_scale.shape) == (n, k // ref.NVFP4_BLOCK),
                 f"weight_scale must have shape {(n, k // ref.NVFP4_BLOCK)}, got {tuple(weight_scale.shape)}")
        _require(weight_scale_2.numel() == 1, f"weight_scale_2 must have 1 element, got {weight_scale_2.numel()}")
        _check_finite_positive("weight_scale_2", weight_scale_2)
        _require(bool(torch.isfinite(ref.decode_e4m3(weight_scale)).all()), "weight_scale must be finite (no e4m3 NaN)")
        self.weight = weight.contiguous()
        self.weight_scale = weight_scale.contiguous()
        self.weight_scale_2 = weight_scale_2.float().reshape(1).contiguous()
        self.N, self.K = n, k
        self.params_dtype = _check_params_dtype(params_dtype)

    @classmethod
    def from_checkpoint(cls, weight, weight_scale, weight_scale_2, params_dtype) -> "Nvfp4Weight":
        return cls(weight, weight_scale, weight_scale_2, params_dtype)

    @classmethod
    def from_dense(cls, w: torch.Tensor, params_dtype: torch.dtype | None = None) -> "Nvfp4Weight":
        n, k = w.shape
        _require(k % ref.NVFP4_BLOCK == 0, f"K must be a multiple of 16 for NVFP4, got {k}")
        wf = w.float()
        # Global scale maps the largest block scale onto the e4m3 range.
        g = (wf.abs().amax().clamp(min=1e-12) / (ref.E2M1_MAX * ref.FP8_E4M3_MAX)).reshape(1)
        blocks = wf.view(n, k // ref.NVFP4_BLOCK, ref.NVFP4_BLOCK)
        bscale = ref.quantize_e4m3(blocks.abs().amax(-1) / ref.E2M1_MAX / g)
        eff = ref.decode_e4m3(bscale) * g  # the scale the decoder will use
        safe = torch.where(eff > 0, eff, torch.ones_like(eff))
        codes = ref.encode_e2m1(torch.where(eff.unsqueeze(-1) > 0, blocks / safe.unsqueeze(-1), 0.0))
        return cls(ref.pack_nvfp4(codes.view(n, k)), bscale, g, params_dtype or w.dtype)

    def dequantize_fp32(self) -> torch.Tensor:
        return ref.dequant_nvfp4(self.weight, self.weight_scale, self.weight_scale_2)

    def _slice_rows(self, start: int, stop: int) -> "Nvfp4Weight":
        # Block scales run along K, so every row owns its own; the global scale is kept.
        return Nvfp4Weight(_rows(self.weight, start, stop), _rows(self.weight_scale, start, stop),
                           self.weight_scale_2.clone(), self.params_dtype)


class Int4GroupWeight(WeightFormat):
    """Weight-only int4 with group scales, GPTQ-style, and NO `.weight` attribute.

    qweight int32 [K/8, N]: 8 unsigned nibbles along K per word, lowest bits
    first; scales [K/group, N] in params_dtype; zeros (optional) [K/group, N]
    integer zero points, default 8 (symmetric). w = (q - zero) * scale.
    """

    name = "int4_group"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                 params_dtype: torch.dtype, zeros: torch.Tensor | None = None):
        _require(qweight.dim() == 2 and qweight.dtype == torch.int32,
                 f"qweight must be int32 [K/8, N], got {qweight.dtype} shape {tuple(qweight.shape)}")
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        _check_int_arg("group_size", group_size, 1)
        _require(k % group_size == 0,
                 f"group_size must be > 0 and divide K={k}, got {group_size}")
        want = (k // group_size, n)
        _require(tuple(scales.shape) == want, f"scales must have shape {want}, got {tuple(scales.shape)}")
        _require(bool(torch.isfinite(scales.float()).all()), "scales must be finite")
        if zeros is not None:
            _require(tuple(zeros.shape) == want, f"zeros must have shape {want}, got {tuple(zeros.shape)}")
        self.qweight = qweight.contiguous()
        self.scales = scales.contiguous()
        self.zeros = None if zeros is None else zeros.contiguous()
        self.group_size = group_size
        self.N, self.K = n, k
        self.params_dtype = _check_params_dtype(params_dtype)

    @classmethod
    def from_checkpoint(cls, qweight, scales, group_size, params_dtype, zeros=None) -> "Int4GroupWeight":
        return cls(qweight, scales, group_size, params_dtype, zeros)

    @classmethod
    def from_dense(cls, w: torch.Tensor, group_size: int = 128,
                   params_dtype: torch.dtype | None = None) -> "Int4GroupWeight":
        n, k = w.shape
        _check_int_arg("group_size", group_size, 1)
        _require(k % 8 == 0 and k % group_size == 0,
                 f"K must be a multiple of 8 and of group_size={group_size}, got {k}")
        dt = params_dtype or w.dtype
        wg = w.float().t().reshape(k // group_size, group_size, n)
        scale = (wg.abs().amax(1) / 7.0).clamp(min=1e-8).to(dt)
        q = (torch.round(wg / scale.float().unsqueeze(1)) + 8).clamp(0, 15).to(torch.int32).reshape(k, n)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device).view(1, 8, 1)
        qweight = (q.view(k // 8, 8, n) << shifts).sum(1, dtype=torch.int64)
        qweight = torch.where(qweight >= 2**31, qweight - 2**32, qweight).to(torch.int32)
        return cls(qweight, scale, group_size, dt)

    def dequantize_fp32(self) -> torch.Tensor:
        return ref.dequant_int4_grouped(self.qweight, self.scales, self.zeros, self.group_size)

    def _slice_rows(self, start: int, stop: int) -> "Int4GroupWeight":
        # qweight packs along K ([K/8, N]) and groups run along K: output rows
        # are columns here, and any column range is a clean cut.
        zeros = None if self.zeros is None else _rows(self.zeros, start, stop, dim=1)
        return Int4GroupWeight(_rows(self.qweight, start, stop, dim=1), _rows(self.scales, start, stop, dim=1),
                               self.group_size, self.params_dtype, zeros)


ALL_FORMATS = (DenseWeight, Fp8Weight, Fp8BlockWeight, MarlinFp8Weight, Nvfp4Weight, Int4GroupWeight)

# Named quantization recipes (tests, benchmarks, the CLI): name -> from_dense call.
RECIPES = {
    "dense": lambda w, dt: DenseWeight.from_dense(w, dt),
    "fp8_per_tensor": lambda w, dt: Fp8Weight.from_dense(w, per_channel=False, params_dtype=dt),
    "fp8_per_channel": lambda w, dt: Fp8Weight.from_dense(w, per_channel=True, params_dtype=dt),
    "fp8_block": lambda w, dt: Fp8BlockWeight.from_dense(w, dt),
    "marlin_fp8": lambda w, dt: MarlinFp8Weight.from_dense(w, dt),
    "marlin_fp8_g128": lambda w, dt: MarlinFp8Weight.from_dense(w, dt, group_size=128),
    "nvfp4": lambda w, dt: Nvfp4Weight.from_dense(w, dt),
    "int4_group": lambda w, dt: Int4GroupWeight.from_dense(w, 64, dt),
}


def quantize(recipe: str, w: torch.Tensor, params_dtype: torch.dtype) -> WeightFormat:
    """Quantize a dense [N, K] weight with a named recipe (see RECIPES)."""
    _require(recipe in RECIPES, f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    return RECIPES[recipe](w, params_dtype)
