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
from mla_ext.kv_b_proj.marlin import (marlin_fp8_dequantize, marlin_fp8_from_vllm, marlin_fp8_repack,
                                      marlin_fp8_slice_rows)
from mla_ext.kv_b_proj.rows import check_row_cut, shard_rows

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


def _check_tensor(t, name: str) -> None:
    _require(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")


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
        loaded = getattr(self, "loaded_scale_layout", "linear")
        also = f" (scales loaded {loaded})" if loaded != "linear" else ""
        return f"{self.name} [N={self.N}, K={self.K}] params_dtype={self.params_dtype}{also}"

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
        """This rank's heads of the full kv_b_proj: heads [rank·n, (rank+1)·n), n = num_heads / tp_size
        (mla_ext/kv_b_proj/shard.py says how each format is cut). `self` is the full weight,
        N = num_heads · head_rows; returns a format of the same kind (`self` at tp_size 1)."""
        start, stop = shard_rows(num_heads, head_rows, tp_size, rank)
        if self.N != num_heads * head_rows:
            raise ValueError(f"fmt: expected the full kv_b_proj, N = num_heads * head_rows = {num_heads} * {head_rows} "
                             f"= {num_heads * head_rows} rows, got N={self.N} ({self.describe()})")
        if tp_size == 1:
            return self
        try:
            return self.slice_rows(start, stop)
        except ValueError as exc:
            per_rank = num_heads // tp_size
            raise ValueError(
                f"cannot shard {self.describe()} for tp_size={tp_size}, rank={rank} (heads "
                f"[{rank * per_rank}, {(rank + 1) * per_rank}) of {num_heads}, rows [{start}, {stop})): {exc}") from exc


class DenseWeight(WeightFormat):
    name = "dense"

    def __init__(self, weight: torch.Tensor):
        _check_tensor(weight, "weight")
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

    @classmethod
    def from_vllm_mla(cls, W_UK_T: torch.Tensor, W_UV: torch.Tensor) -> "DenseWeight":
        """The kv_b_proj weight from the two matrices vLLM's MLA attention keeps after
        process_weights_after_loading (kv_b_proj dequantized to the activation dtype,
        split per head): `W_UK_T` [N, P, L] (keys, transposed for the absorbed
        query) and `W_UV` [N, L, V]. Head h's rows of the result are W_UK_T[h]
        (P rows) then W_UV[h]^T (V rows), the checkpoint's [N*(P+V), L] layout.
        One copy, in the matrices' dtype (load time)."""
        for name, t in (("W_UK_T", W_UK_T), ("W_UV", W_UV)):
            _check_tensor(t, name)
            _require(t.dim() == 3, f"{name}: expected a 3-D tensor ({'[N, P, L]' if name == 'W_UK_T' else '[N, L, V]'}),"
                     f" got shape {tuple(t.shape)}")
            _require(t.dtype in FLOAT_DTYPES, f"{name}: expected one of {FLOAT_DTYPES}, got {t.dtype}")
        n, p, lat = W_UK_T.shape
        _require(W_UV.shape[0] == n and W_UV.shape[1] == lat,
                 f"W_UV: expected shape [N={n}, L={lat}, V] (as W_UK_T [N, P, L]), got {tuple(W_UV.shape)}")
        _require(W_UV.dtype == W_UK_T.dtype and W_UV.device == W_UK_T.device,
                 f"W_UV: expected dtype {W_UK_T.dtype} on {W_UK_T.device} (as W_UK_T), got {W_UV.dtype} on "
                 f"{W_UV.device}")
        v = W_UV.shape[2]
        rows = torch.cat([W_UK_T, W_UV.transpose(1, 2)], dim=1)  # [N, P+V, L]
        return cls(rows.reshape(n * (p + v), lat))

    def dequantize_fp32(self) -> torch.Tensor:
        return self.weight.float()

    def _slice_rows(self, start: int, stop: int) -> "DenseWeight":
        return DenseWeight(_rows(self.weight, start, stop))


class Fp8Weight(WeightFormat):
    """W8A8 fp8 e4m3 with a per-tensor [1] or per-channel [N] fp32 scale."""

    name = "fp8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, params_dtype: torch.dtype):
        _check_tensor(weight, "weight")
        _check_tensor(weight_scale, "weight_scale")
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


# Block-FP8 scale layouts (`Fp8BlockWeight(..., scale_layout=...)`). The layout
# names what the two indices of the given tensor mean; strides are free (a
# column-major or TMA-aligned tensor is just a strided view of the same indices).
#   "linear"             [ceil(N/128), ceil(K/128)], s[n_blk, k_blk]: the checkpoint
#   "transposed"         [ceil(K/128), ceil(N/128)], s[k_blk, n_blk]: the checkpoint's .t()
#                        (what vLLM's SM90 CUTLASS block-FP8 path once left after
#                        loading, vLLM PR 23280)
#   "linear_padded"      at least [ceil(N/128), ceil(K/128)], s[n_blk, k_blk]; the rows
#   "transposed_padded"  / columns past those (padding, e.g. K blocks rounded up to 4
#                        for cuBLASLt's blockwise scaled_mm) are ignored
FP8_BLOCK_SCALE_LAYOUTS = ("linear", "transposed", "linear_padded", "transposed_padded")


def fp8_block_scales_to_linear(scale: torch.Tensor, n: int, k: int, scale_layout: str,
                               arg: str = "weight_scale_inv") -> torch.Tensor:
    """Block-FP8 scales given in `scale_layout` (FP8_BLOCK_SCALE_LAYOUTS) -> the
    checkpoint layout fp32 [ceil(n/128), ceil(k/128)], contiguous (a copy)."""
    _require(scale_layout in FP8_BLOCK_SCALE_LAYOUTS,
             f"scale_layout: expected one of {FP8_BLOCK_SCALE_LAYOUTS}, got {scale_layout!r}")
    _require(isinstance(scale, torch.Tensor) and scale.dim() == 2,
             f"{arg}: expected a 2-D tensor, got "
             + (f"shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__))
    gn, gk = -(-n // ref.FP8_BLOCK), -(-k // ref.FP8_BLOCK)
    transposed = scale_layout.startswith("transposed")
    want = (gk, gn) if transposed else (gn, gk)
    shape = tuple(scale.shape)
    if scale_layout.endswith("_padded"):
        _require(shape[0] >= want[0] and shape[1] >= want[1],
                 f"{arg}: scale_layout {scale_layout!r} needs at least {want} for weight [N={n}, K={k}], got {shape}")
        scale = scale[: want[0], : want[1]]
    else:
        _require(shape == want, f"{arg}: scale_layout {scale_layout!r} needs shape {want} for weight "
                                f"[N={n}, K={k}], got {shape}")
    return (scale.t() if transposed else scale).float().contiguous()


class Fp8BlockWeight(WeightFormat):
    """DeepSeek block fp8: e4m3 [N, K] and fp32 `weight_scale_inv` [ceil(N/128), ceil(K/128)].

    Despite its checkpoint name, `weight_scale_inv` multiplies: w = q * s.

    `scale_layout` says how the given `weight_scale_inv` is laid out (see
    FP8_BLOCK_SCALE_LAYOUTS); the DEFAULT is "linear", the checkpoint's
    [ceil(N/128), ceil(K/128)]. It is never guessed from the shape (a transposed
    square scale has the checkpoint's shape). The object always stores the linear
    layout: `weight_scale_inv` is [ceil(N/128), ceil(K/128)] whatever was given,
    and `loaded_scale_layout` records what was given.
    """

    name = "fp8_block"

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 params_dtype: torch.dtype, block_size=(128, 128), scale_layout: str = "linear"):
        _require(isinstance(block_size, (tuple, list)) and tuple(block_size) == (ref.FP8_BLOCK, ref.FP8_BLOCK),
                 f"block_size: expected (128, 128), got {block_size!r}")
        _check_tensor(weight, "weight")
        _check_tensor(weight_scale_inv, "weight_scale_inv")
        _require(weight.dim() == 2, f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        _require(weight.dtype == torch.float8_e4m3fn, f"weight dtype must be torch.float8_e4m3fn, got {weight.dtype}")
        _check_e4m3_weight("weight", weight)
        n, k = weight.shape
        if scale_layout == "linear":  # the checkpoint's (the historical message)
            want = (-(-n // ref.FP8_BLOCK), -(-k // ref.FP8_BLOCK))
            _require(tuple(weight_scale_inv.shape) == want,
                     f"weight_scale_inv must have shape {want} for weight {tuple(weight.shape)}, "
                     f"got {tuple(weight_scale_inv.shape)}")
        scale = fp8_block_scales_to_linear(weight_scale_inv, n, k, scale_layout)
        _check_finite_positive("weight_scale_inv", scale)
        self.weight = weight.contiguous()
        self.weight_scale_inv = scale
        self.loaded_scale_layout = scale_layout
        self.N, self.K = n, k
        self.params_dtype = _check_params_dtype(params_dtype)

    @classmethod
    def from_checkpoint(cls, weight, weight_scale_inv, params_dtype, block_size=(128, 128)) -> "Fp8BlockWeight":
        return cls(weight, weight_scale_inv, params_dtype, block_size)

    @classmethod
    def from_vllm_postload(cls, weight: torch.Tensor, weight_scale_inv: torch.Tensor, params_dtype: torch.dtype,
                           *, scale_layout: str, weight_transposed: bool = False, N: int | None = None,
                           K: int | None = None) -> "Fp8BlockWeight":
        """From the tensors a vLLM block-FP8 linear holds after process_weights_after_loading.

        vLLM's backends differ in what they leave, so everything is stated, nothing is
        inferred from shapes: `scale_layout` (required; FP8_BLOCK_SCALE_LAYOUTS) for
        `weight_scale_inv`, `weight_transposed=True` for a weight stored [K, N], and
        N / K, the logical sizes, when the weight was padded (e.g. N rounded up to 128:
        only the first N rows and K columns are read). DeepGEMM's UE8M0-requantized
        weights (SM100) are a different quantization and are not read here.
        """
        _require(isinstance(weight_transposed, bool),
                 f"weight_transposed: expected a bool, got {weight_transposed!r}")
        _require(isinstance(weight, torch.Tensor) and weight.dim() == 2,
                 f"weight: expected a 2-D fp8 tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
        w = weight.t() if weight_transposed else weight
        n = w.shape[0] if N is None else _check_int_arg("N", N, 1)
        k = w.shape[1] if K is None else _check_int_arg("K", K, 1)
        _require(n <= w.shape[0] and k <= w.shape[1],
                 f"N, K: the weight holds [{w.shape[0]}, {w.shape[1]}] (as [N, K]), fewer than N={n}, K={k}")
        return cls(w[:n, :k], weight_scale_inv, params_dtype, scale_layout=scale_layout)

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
        return marlin_fp8_dequantize(self.packed).float()

    def _slice_rows(self, start: int, stop: int) -> "MarlinFp8Weight":
        return MarlinFp8Weight(marlin_fp8_slice_rows(self.packed, start, stop), self.params_dtype)


# NVFP4 block-scale layouts (`Nvfp4Weight(..., scale_layout=...)`):
#   "linear"    the checkpoint's row-major e4m3 [N, K/16]: scale (r, c) at r * (K/16) + c
#   "swizzled"  the 128x4 layout CUTLASS / FlashInfer block-scaled GEMMs read (what
#               vLLM's `swizzle_blockscale` makes in process_weights_after_loading):
#               rows padded to Mp = round_up(N, 128), scale columns to
#               Kp = round_up(K/16, 4), then laid out as [Mp/128, Kp/4, 32, 4, 4], i.e.
#               scale (r, c) at ((r // 128) * (Kp / 4) + c // 4) * 512
#                               + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
#               of the flat [Mp * Kp] buffer (vLLM returns it as [Mp, Kp]). Facts: the
#               reshape (Mp/128, 4, 32, Kp/4, 4) + permute (0, 1, 4, 3, 2, 5) of vLLM's
#               swizzle_blockscale (vLLM PRs 21631, 23140); cuBLAS's block-scale offset
#               helper (nvmath-python get_block_scale_offset: NVFP4 A of 128 x 128, scale
#               (5, 2) at 82 and (5, 5) at 593); cuDNN's "128x4" scale-factor layout.
# At DeepSeek kv_b_proj sizes (N a multiple of 128, K/16 = 32) both have the
# checkpoint's shape: the layout must be stated, it cannot be detected.
NVFP4_SCALE_LAYOUTS = ("linear", "swizzled")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def nvfp4_swizzled_scale_shape(n: int, k: int) -> tuple[int, int]:
    """(Mp, Kp) of the swizzled block scales of an [n, k] NVFP4 weight."""
    _check_int_arg("n", n, 1)
    _check_int_arg("k", k, ref.NVFP4_BLOCK)
    return _round_up(n, 128), _round_up(k // ref.NVFP4_BLOCK, 4)


def unswizzle_nvfp4_scales(swizzled: torch.Tensor, n: int, k: int, arg: str = "weight_scale") -> torch.Tensor:
    """The swizzled (128x4) block scales of an [n, k] NVFP4 weight -> the checkpoint's
    [n, k/16] (same dtype, contiguous). `swizzled` is [Mp, Kp] or flat [Mp * Kp]
    (read in row-major order); padding entries are dropped."""
    mp, kp = nvfp4_swizzled_scale_shape(n, k)
    _require(isinstance(swizzled, torch.Tensor) and swizzled.dim() in (1, 2) and swizzled.numel() == mp * kp
             and (swizzled.dim() == 1 or tuple(swizzled.shape) == (mp, kp)),
             f"{arg}: swizzled block scales of an [N={n}, K={k}] weight are [Mp, Kp] = [{mp}, {kp}] "
             f"(N rounded up to 128, K/16 up to 4) or flat [{mp * kp}], got "
             + (f"shape {tuple(swizzled.shape)}" if isinstance(swizzled, torch.Tensor) else type(swizzled).__name__))
    # Flat index ((m0 * Kp/4 + k0) * 32 + m2) * 16 + m1 * 4 + k1 with r = 128 m0 + 32 m1 + m2
    # and c = 4 k0 + k1: view as (m0, k0, m2, m1, k1), bring to (m0, m1, m2, k0, k1).
    t = swizzled.contiguous().reshape(mp // 128, kp // 4, 32, 4, 4)
    return t.permute(0, 3, 2, 1, 4).reshape(mp, kp)[:n, : k // ref.NVFP4_BLOCK].contiguous()


def swizzle_nvfp4_scales(linear: torch.Tensor) -> torch.Tensor:
    """The inverse: checkpoint [n, k/16] block scales -> swizzled [Mp, Kp], padding
    zero (what vLLM's swizzle_blockscale returns)."""
    _require(isinstance(linear, torch.Tensor) and linear.dim() == 2,
             f"linear: expected a 2-D [N, K/16] tensor, got {getattr(linear, 'shape', type(linear).__name__)}")
    n, kb = linear.shape
    mp, kp = nvfp4_swizzled_scale_shape(n, kb * ref.NVFP4_BLOCK)
    padded = torch.zeros(mp, kp, dtype=linear.dtype, device=linear.device)
    padded[:n, :kb] = linear
    return padded.reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(mp, kp).contiguous()


class Nvfp4Weight(WeightFormat):
    """NVFP4: uint8 [N, K/2] (two e2m1 per byte, low nibble = even k), e4m3
    `weight_scale` [N, K/16] and fp32 global `weight_scale_2` [1]:
    w = e2m1 * weight_scale * weight_scale_2 (ModelOpt naming).

    `scale_layout` says how the given `weight_scale` is laid out: "linear" (the
    DEFAULT: the checkpoint's row-major [N, K/16]) or "swizzled" (the CUTLASS /
    FlashInfer 128x4 layout vLLM leaves after process_weights_after_loading; see
    NVFP4_SCALE_LAYOUTS). It is never guessed: at kv_b_proj sizes the two have the
    same shape, and swizzled scales read as linear dequantize most of the weight
    wrong. Swizzled scales are un-swizzled once here; the object always stores the
    linear [N, K/16] `weight_scale` (`loaded_scale_layout` records what was given).
    A uint8 `weight_scale` is read as the e4m3 bytes it holds.
    """

    name = "nvfp4"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, params_dtype: torch.dtype, scale_layout: str = "linear"):
        _require(weight.dim() == 2 and weight.dtype == torch.uint8,
                 f"weight must be uint8 [N, K/2], got {weight.dtype} shape {tuple(weight.shape)}")
        n, k = weight.shape[0], weight.shape[1] * 2
        _require(k % ref.NVFP4_BLOCK == 0, f"K (= 2 * weight.shape[1]) must be a multiple of 16, got {k}")
        _require(scale_layout in NVFP4_SCALE_LAYOUTS,
                 f"scale_layout: expected one of {NVFP4_SCALE_LAYOUTS}, got {scale_layout!r}")
        if scale_layout == "swizzled" and isinstance(weight_scale, torch.Tensor) and weight_scale.dtype == torch.uint8:
            weight_scale = weight_scale.view(torch.float8_e4m3fn)
        _require(weight_scale.dtype == torch.float8_e4m3fn,
                 f"weight_scale dtype must be torch.float8_e4m3fn, got {weight_scale.dtype}")
        if scale_layout == "swizzled":
            weight_scale = unswizzle_nvfp4_scales(weight_scale, n, k)
        _require(tuple(weight_scale.shape) == (n, k // ref.NVFP4_BLOCK),
                 f"weight_scale must have shape {(n, k // ref.NVFP4_BLOCK)}, got {tuple(weight_scale.shape)}")
        _require(weight_scale_2.numel() == 1, f"weight_scale_2 must have 1 element, got {weight_scale_2.numel()}")
        _check_finite_positive("weight_scale_2", weight_scale_2)
        _require(bool(torch.isfinite(ref.decode_e4m3(weight_scale)).all()), "weight_scale must be finite (no e4m3 NaN)")
        self.weight = weight.contiguous()
        self.weight_scale = weight_scale.contiguous()
        self.weight_scale_2 = weight_scale_2.float().reshape(1).contiguous()
        self.loaded_scale_layout = scale_layout
        self.N, self.K = n, k
        self.params_dtype = _check_params_dtype(params_dtype)

    @classmethod
    def from_checkpoint(cls, weight, weight_scale, weight_scale_2, params_dtype) -> "Nvfp4Weight":
        return cls(weight, weight_scale, weight_scale_2, params_dtype)

    @classmethod
    def from_vllm_postload(cls, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                           params_dtype: torch.dtype, *, scale_layout: str = "swizzled", N: int | None = None,
                           K: int | None = None) -> "Nvfp4Weight":
        """From the tensors a vLLM ModelOpt NVFP4 linear holds after
        process_weights_after_loading on its CUTLASS / FlashInfer-CUTLASS backends:
        `weight` uint8 [N, K/2] (possibly padded: N, K are then the logical sizes and
        only the first N rows and K/2 byte columns are read), `weight_scale` swizzled
        (128x4, [Mp, Kp], un-swizzled once here), `weight_scale_2` the fp32 global.
        Pass scale_layout="linear" for a backend that leaves the checkpoint layout.
        vLLM's Marlin NVFP4 repack (GPUs without native FP4) is another layout and
        is not read here: build the weight from the checkpoint tensors instead."""
        _require(isinstance(weight, torch.Tensor) and weight.dim() == 2,
                 f"weight: expected a 2-D uint8 tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
        n = weight.shape[0] if N is None else _check_int_arg("N", N, 1)
        k = 2 * weight.shape[1] if K is None else _check_int_arg("K", K, 2)
        _require(k % 2 == 0 and n <= weight.shape[0] and k // 2 <= weight.shape[1],
                 f"N, K: the weight holds [{weight.shape[0]}, {weight.shape[1]}] bytes ([N, K/2]), "
                 f"not enough for N={n}, K={k} (K even)")
        return cls(weight[:n, : k // 2], weight_scale, weight_scale_2, params_dtype, scale_layout=scale_layout)

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
