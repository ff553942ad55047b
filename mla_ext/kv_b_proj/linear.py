"""`KvBProj`: the kv_b_proj layer, dispatching by (weight format, GPU capability, M).

Backends, in the stated priority order (the first one with no reasons serves
the call when no measurement decides, see below):
- marlin_w8a16     Marlin fp8 weight-only GEMM (sm_80+), while M <= MARLIN_MAX_M
                   (split-K, up to 64-row CTA tiles)
- triton_w4a16     NVFP4 dequant-in-kernel GEMM (sm_80+), while M <= W4A16_MAX_M
                   (packed tiles loaded along K, unpacked in registers)
- scaled_mm_block  block fp8 W8A8 (DeepSeek 1x128 / 128x128 scales) through
                   torch._scaled_mm's cuBLASLt blockwise scaling (sm_90 only, when
                   this torch build's probe passes; scaled_mm_block.py)
- triton_fp8_block block-scaled fp8 W8A8 GEMM (native fp8 dot: sm_89+)
- scaled_mm_fp8    per-tensor / per-channel fp8 through torch._scaled_mm (sm_89+)
- dequant_dense    dequantize once (cached per layer, per dtype and device),
                   then a 16-bit GEMM (cuBLAS on a GPU); serves everything.
Weight-only kernels only win while the GEMM is memory-bound (small M); at
prefill M (thousands of rows, K=512) the GEMM is compute-bound and a
dequantize-once 16-bit GEMM (or native fp8) is faster.

The M thresholds are the stated order's heuristics (`Backend.heuristic`). On a
device with a committed measurement table (mla_ext/dispatch_tables/<device>.json,
written by `benchmarks/bench_kv_b_proj.py --sweep`), the measured-fastest usable
backend of the bucket (weight format, dtypes, K, N, M rounded up to a power of
two; the nearest measured M within 3 octaves) is chosen instead, and `explain()`
names the table entry; elsewhere "no measurement for <device>: stated order".

The dequantized cache costs N*K*2 bytes per layer and dtype (32 MiB for
DeepSeek-V3 at TP1: 61 layers ~ 2 GiB); it is built on the first large-M call
(do that during warm-up, before CUDA-graph capture).

On the CPU only `dequant_dense` is chosen automatically; the Triton kernels
(through TRITON_INTERPRET=1), the Marlin packed-layout CPU reference and CPU
`_scaled_mm` run there only when forced (`DISPATCH.force(name)` or
MLA_EXT_FORCE_KV_B_PROJ=name), which is how the tests exercise them.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mla_ext import _ext
from mla_ext._args import as_device, check_int
from mla_ext.cache import checks
from mla_ext.compat import cpu_rowwise_scaled_mm_reasons
from mla_ext.dispatch import Backend, Dispatcher, pow2_buckets
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.input_dtype import FP8_DTYPES
from mla_ext.kv_b_proj import marlin
from mla_ext.kv_b_proj.marlin import marlin_fp8_gemm
from mla_ext.kv_b_proj.from_module import weight_format_from_module

if TYPE_CHECKING:
    from mla_ext.kv_b_proj.scaled_mm_block import BlockScaledWeight

OP = "kv_b_proj"

# M thresholds. PROVISIONAL: no GPU was available when they were written.
# Replace them with the crossover M that `benchmarks/bench_kv_b_proj.py`
# prints on the target GPU (DeepSeek-V3 shapes, K=512, N=4,096 and 32,768).
# Sources for the provisional values:
# - Marlin (int4) vs torch GEMM by batch, vllm PR #2497: 1.47x at M=64, 1.01x
#   at M=128, 0.60-0.74x at M>=256 (prior-art.md §2.1). fp8 Marlin moves half
#   the bytes int4 would save, so its crossover is at or below that one.
MARLIN_MAX_M = 128
# - Our Triton W4A16 kernel is a plain dequant-in-kernel GEMM with no split-K
#   or Marlin-style pipelining; assumed to cross over earlier than Marlin.
W4A16_MAX_M = 64
# - Native fp8 reads half the weight bytes of bf16 and has twice the
#   tensor-core rate on sm_89+, so it is assumed never to lose; set a minimum
#   M here if the benchmark shows the activation-quantization overhead losing
#   to dequant + bf16 cuBLAS at small M.
FP8_NATIVE_MIN_M = 1


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@dataclass
class KvBProjInputs:
    """What the backends decide on; `x` is None for `explain(M)` without data."""

    layer: "KvBProj"
    M: int
    device: torch.device
    capability: tuple[int, int] | None
    act_dtype: torch.dtype
    x: torch.Tensor | None = None
    x_scale: torch.Tensor | None = None
    out: torch.Tensor | None = None


def _forced(name: str) -> bool:
    return DISPATCH._forced_name() == name


def _gpu_reasons(name: str, inp: KvBProjInputs, min_cap: tuple[int, int], cpu_ok: str | None) -> list[str]:
    """Device/capability reasons. `cpu_ok`: how the backend can run on a CPU when forced."""
    if inp.device.type == "cpu":
        if cpu_ok is None:
            return ["needs a CUDA device (input is on the CPU)"]
        if not _forced(name):
            return [f"input is on the CPU: {cpu_ok} runs there only when this backend is forced"]
        if cpu_ok.startswith("the Triton interpreter") and os.environ.get("TRITON_INTERPRET") != "1":
            return ["input is on the CPU and TRITON_INTERPRET is not 1"]
        return []
    if inp.device.type != "cuda":
        return [f"unsupported device type {inp.device.type!r}"]
    cap = inp.capability or (0, 0)
    if cap < min_cap:
        return [f"needs sm_{min_cap[0]}{min_cap[1]}+, device is sm_{cap[0]}{cap[1]}"]
    return []


def _above(inp: KvBProjInputs, what: str, limit: int) -> list[str]:
    """An M threshold is a performance rule of the stated order (a Backend.heuristic):
    forcing the backend (tests, benchmarks measuring the crossover) or a measurement
    table overrides it; capability limits stay."""
    if inp.M > limit:
        return [f"M={inp.M} > {what}={limit} (compute-bound: dequantize + 16-bit GEMM wins)"]
    return []


def _format_reason(inp: KvBProjInputs, cls) -> list[str]:
    fmt = inp.layer.weight_format
    return [] if isinstance(fmt, cls) else [f"weight format is {fmt.name}, not {cls.name}"]


def _x_unit_stride(inp: KvBProjInputs) -> list[str]:
    x = inp.x
    if x is not None and x.shape[1] > 1 and x.stride(1) != 1:
        return [f"x must have unit stride along K, got strides {x.stride()}"]
    return []


# -- marlin_w8a16 ------------------------------------------------------------

def _marlin_module():
    return marlin, ""


def _marlin_reasons(inp: KvBProjInputs) -> list[str]:
    why = _format_reason(inp, W.MarlinFp8Weight)
    if why:
        return why
    why = _gpu_reasons("marlin_w8a16", inp, (8, 0), "the Marlin packed-layout CPU reference")
    if inp.act_dtype != inp.layer.params_dtype:
        why.append(f"activation dtype must be {inp.layer.params_dtype} (packed for it), got {inp.act_dtype}")
    marlin, err = _marlin_module()
    if marlin is None:
        why.append(err)
    elif inp.x is not None and not why:
        why.extend(marlin.marlin_not_supported_reasons(inp.x, inp.layer.weight_format.packed))
    return why


def _marlin_run(inp: KvBProjInputs) -> torch.Tensor:
    y = marlin_fp8_gemm(inp.x, inp.layer.weight_format.packed, out_dtype=inp.layer.params_dtype)
    return _into(y, inp)


# -- triton_w4a16 ------------------------------------------------------------

def _w4a16_reasons(inp: KvBProjInputs) -> list[str]:
    why = _format_reason(inp, W.Nvfp4Weight)
    if why:
        return why
    why = _gpu_reasons("triton_w4a16", inp, (8, 0), "the Triton interpreter")
    if inp.act_dtype not in W.ACT_DTYPES:
        why.append(f"activation dtype must be bf16 or fp16 (W4A16), got {inp.act_dtype}")
    return why + _x_unit_stride(inp)


def _w4a16_run(inp: KvBProjInputs) -> torch.Tensor:
    from mla_ext.kv_b_proj.triton_w4a16 import nvfp4_w4a16_matmul

    f = inp.layer.weight_format
    return nvfp4_w4a16_matmul(inp.x, f.weight, f.weight_scale, f.weight_scale_2, out=inp.out)


# -- scaled_mm_block ---------------------------------------------------------

def _smm_block_reasons(inp: KvBProjInputs) -> list[str]:
    why = _format_reason(inp, W.Fp8BlockWeight)
    if why:
        return why
    from mla_ext.kv_b_proj import scaled_mm_block as S

    f = inp.layer.weight_format
    if inp.device.type == "cpu":
        # CPU torch._scaled_mm has no blockwise scaling (probed once: torch 2.14 refuses it).
        probe = S.blockwise_scaled_mm_reasons(inp.device, inp.layer.params_dtype)
        if probe:
            why = ["needs a CUDA sm_90 device (input is on the CPU)"] + probe
        elif not _forced("scaled_mm_block"):
            why = ["input is on the CPU: CPU torch._scaled_mm runs there only when this backend is forced"]
    else:
        # Device type, architecture (sm_90 only), out dtype, then this torch build's probe.
        why = S.blockwise_scaled_mm_reasons(inp.device, inp.layer.params_dtype)
    why += S.shape_reasons(f.N, f.K)
    if inp.act_dtype not in W.FLOAT_DTYPES + (torch.float8_e4m3fn,):
        why.append(f"activation dtype must be bf16/fp16/fp32 or float8_e4m3fn, got {inp.act_dtype}")
    return why + _x_unit_stride(inp)


def _smm_block_run(inp: KvBProjInputs) -> torch.Tensor:
    from mla_ext.kv_b_proj.scaled_mm_block import scaled_mm_block_linear

    w = inp.layer.scaled_mm_block_weight(inp.device)
    return scaled_mm_block_linear(inp.x, w, inp.layer.params_dtype, x_scale=inp.x_scale, out=inp.out)


# -- the stated order's heuristics (M thresholds; a measurement overrides them) --

def _marlin_heuristic(inp: KvBProjInputs) -> list[str]:
    if _format_reason(inp, W.MarlinFp8Weight):
        return []  # the format reason says it all
    return _above(inp, "MARLIN_MAX_M", MARLIN_MAX_M)


def _w4a16_heuristic(inp: KvBProjInputs) -> list[str]:
    if _format_reason(inp, W.Nvfp4Weight):
        return []
    return _above(inp, "W4A16_MAX_M", W4A16_MAX_M)


def _fp8_native_m(inp: KvBProjInputs) -> list[str]:
    if inp.M < FP8_NATIVE_MIN_M:
        return [f"M={inp.M} < FP8_NATIVE_MIN_M={FP8_NATIVE_MIN_M} (dequantize + 16-bit GEMM wins)"]
    return []


def _fp8_block_heuristic(inp: KvBProjInputs) -> list[str]:
    """The heuristic of the native block-fp8 backends (scaled_mm_block, triton_fp8_block)."""
    return [] if _format_reason(inp, W.Fp8BlockWeight) else _fp8_native_m(inp)


def _fp8_heuristic(inp: KvBProjInputs) -> list[str]:
    return [] if _format_reason(inp, W.Fp8Weight) else _fp8_native_m(inp)


# -- triton_fp8_block --------------------------------------------------------

def _fp8_block_reasons(inp: KvBProjInputs) -> list[str]:
    why = _format_reason(inp, W.Fp8BlockWeight)
    if why:
        return why
    why = _gpu_reasons("triton_fp8_block", inp, (8, 9), "the Triton interpreter")
    if inp.act_dtype not in W.FLOAT_DTYPES + (torch.float8_e4m3fn,):
        why.append(f"activation dtype must be bf16/fp16/fp32 or float8_e4m3fn, got {inp.act_dtype}")
    return why + _x_unit_stride(inp)


def _fp8_block_run(inp: KvBProjInputs) -> torch.Tensor:
    from mla_ext.kv_b_proj.triton_fp8_block import fp8_block_linear

    f = inp.layer.weight_format
    return fp8_block_linear(inp.x, f.weight, f.weight_scale_inv, inp.layer.params_dtype, out=inp.out,
                            x_scale=inp.x_scale)


# -- scaled_mm_fp8 -----------------------------------------------------------

def _scaled_mm_reasons(inp: KvBProjInputs) -> list[str]:
    why = _format_reason(inp, W.Fp8Weight)
    if why:
        return why
    why = _gpu_reasons("scaled_mm_fp8", inp, (8, 9), "CPU torch._scaled_mm")
    if not hasattr(torch, "_scaled_mm"):
        why.append("torch._scaled_mm is missing from this torch build")
    elif inp.device.type == "cpu":
        # The CPU kernel of torch 2.11 takes per-tensor scales only (probed once, cached).
        why += cpu_rowwise_scaled_mm_reasons()
    f = inp.layer.weight_format
    # cuBLAS fp8 GEMMs need 16-aligned N and K.
    if f.N % 16 or f.K % 16:
        why.append(f"N={f.N} and K={f.K} must be multiples of 16 (cuBLAS fp8)")
    # Row-wise scaled_mm produces bf16 only.
    if inp.layer.params_dtype != torch.bfloat16:
        why.append(f"row-wise torch._scaled_mm outputs bf16 only; params_dtype is {inp.layer.params_dtype}")
    if inp.act_dtype not in W.FLOAT_DTYPES + (torch.float8_e4m3fn,):
        why.append(f"activation dtype must be bf16/fp16/fp32 or float8_e4m3fn, got {inp.act_dtype}")
    return why + _x_unit_stride(inp)


def _scaled_mm_run(inp: KvBProjInputs) -> torch.Tensor:
    from mla_ext.kv_b_proj import quant

    f = inp.layer.weight_format
    x = inp.x
    m = x.shape[0]
    if x.dtype == torch.float8_e4m3fn:
        s = torch.ones(1, device=x.device) if inp.x_scale is None else inp.x_scale.float().reshape(-1, 1)
        xq, xs = x.contiguous(), s.expand(m, 1).contiguous()  # per-tensor or per-row: row-wise scales
    else:
        # Per-token (row-wise) dynamic quantization: one group spanning K.
        amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=quant.EPS)
        xs = amax / 448.0
        xq = (x.float() / xs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    ws = f.channel_scales().view(1, -1)
    y = torch._scaled_mm(xq, f.weight.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    return _into(y, inp)


# -- dequant_dense -----------------------------------------------------------

def _dense_reasons(inp: KvBProjInputs) -> list[str]:
    if inp.act_dtype not in W.FLOAT_DTYPES + FP8_DTYPES:
        return [f"activation dtype must be a float or fp8 dtype, got {inp.act_dtype}"]
    return []


def _dense_run(inp: KvBProjInputs) -> torch.Tensor:
    layer = inp.layer
    x = inp.x
    if x.dtype in FP8_DTYPES:
        s = 1.0 if inp.x_scale is None else inp.x_scale.float().reshape(-1, 1)  # [1, 1] or [M, 1]
        x = (x.float() * s).to(layer.params_dtype)
    w = layer.dense_weight(layer.params_dtype, x.device)
    if inp.out is not None:
        return torch.matmul(x, w.t(), out=inp.out)
    return x @ w.t()


def _into(y: torch.Tensor, inp: KvBProjInputs) -> torch.Tensor:
    y = y.to(inp.layer.params_dtype)
    if inp.out is None:
        return y
    inp.out.copy_(y)
    return inp.out


# -- what each backend does to the activations (for explain) -------------------

# W8A8 backends quantize a 16/32-bit x themselves. SPEC §9: a W8A8 result is within
# 1e-3 (relative Frobenius) of a reference that applies the same quantization to the
# same weights; against unquantized activations it is reported, not bounded
# (measured 2.9e-2 per MLA layer on random data, 3.3-3.8e-2 against transformers).
W8A8_BLOCK_NOTE = ("quantized per 1x128 group to e4m3 by the backend (W8A8, as DeepSeek's and vLLM's "
                   "block-FP8 path; SPEC §9: <= 1e-3 against a reference with the same quantization, "
                   "about 3e-2 from unquantized activations)")
ACTIVATION_QUANTIZATION = {
    "scaled_mm_block": W8A8_BLOCK_NOTE,
    "triton_fp8_block": W8A8_BLOCK_NOTE,
    "scaled_mm_fp8": "quantized per token (row) to e4m3 by the backend (W8A8 row-wise)",
}


def activation_quantization(backend: str, act_dtype: torch.dtype) -> str:
    """What `backend` (a backend name; anything else, e.g. explain's "none (...)", is
    a backend that does not quantize) does to activations of `act_dtype`, in words."""
    if not isinstance(backend, str):
        raise ValueError(f"backend: expected a kv_b_proj backend name (str), got {type(backend).__name__}")
    if not isinstance(act_dtype, torch.dtype):
        raise ValueError(f"act_dtype: expected a torch.dtype, got {act_dtype!r}")
    if act_dtype in FP8_DTYPES:
        return (f"arrive as {str(act_dtype).removeprefix('torch.')} with x_scale, per tensor or per row "
                "(MLAPrefill's FP8 prefill quantizes per token, so requests never share a scale)")
    return ACTIVATION_QUANTIZATION.get(backend, "not quantized (the weight is dequantized or used as stored)")


# -- dispatch by measurement ---------------------------------------------------

_DEVICE_NAMES: dict[int, str] = {}


def _device_name(device: torch.device) -> str:
    """The name a measurement table is filed under: the CUDA device name, else the type."""
    if device.type != "cuda":
        return device.type
    idx = device.index if device.index is not None else torch.cuda.current_device()
    name = _DEVICE_NAMES.get(idx)
    if name is None:
        name = _DEVICE_NAMES[idx] = torch.cuda.get_device_name(idx)
    return name


def _dtype_tag(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def table_bucket(fmt: str, params_dtype: torch.dtype, act_dtype: torch.dtype, K: int, N: int, M: int) -> str:
    """The measurement-table key of one kv_b_proj call; M is rounded up to a power of two."""
    for arg, value in (("K", K), ("N", N), ("M", M)):
        check_int(value, arg, minimum=1)
    return (f"{fmt}/{_dtype_tag(params_dtype)}/x={_dtype_tag(act_dtype)}/K={K}/N={N}/"
            f"M={pow2_buckets(M, 0)[0]}")


def _table_key(inp: KvBProjInputs) -> tuple[str, list[str]]:
    layer = inp.layer
    keys = [table_bucket(layer.weight_format.name, layer.params_dtype, inp.act_dtype, layer.K, layer.N, m)
            for m in pow2_buckets(inp.M, 3)]
    return _device_name(inp.device), keys


DISPATCH = Dispatcher(OP, [
    Backend("marlin_w8a16", _marlin_reasons, _marlin_run, _marlin_heuristic),
    Backend("triton_w4a16", _w4a16_reasons, _w4a16_run, _w4a16_heuristic),
    Backend("scaled_mm_block", _smm_block_reasons, _smm_block_run, _fp8_block_heuristic),
    Backend("triton_fp8_block", _fp8_block_reasons, _fp8_block_run, _fp8_block_heuristic),
    Backend("scaled_mm_fp8", _scaled_mm_reasons, _scaled_mm_run, _fp8_heuristic),
    Backend("dequant_dense", _dense_reasons, _dense_run),
], table_key=_table_key)


def _check_rows(M) -> None:
    if isinstance(M, bool) or not isinstance(M, int) or M < 0:
        raise ValueError(f"M: expected an int >= 0 (rows of x), got {M!r}")


class KvBProj:
    """kv_b_proj up-projection: y [M, N] = x [M, K] @ W^T, W in any weight format.

    Exposes `.weight` (the stored tensor, absent for weight-only integer
    formats) and `.params_dtype`, like an upstream layer, so
    `kv_b_proj_input_dtype(layer, ...)` applies to it unchanged.
    """

    def __init__(self, weight_format: W.WeightFormat):
        """`weight_format`: a WeightFormat, or an nn.Linear / checkpoint-style module,
        converted by `from_module.weight_format_from_module`."""
        if not isinstance(weight_format, W.WeightFormat):
            weight_format = weight_format_from_module(weight_format, arg="weight_format")
        self.weight_format = weight_format
        self.params_dtype = weight_format.params_dtype
        self.N, self.K = weight_format.N, weight_format.K
        self._dense_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._block_cache: dict[torch.device, object] = {}  # scaled_mm_block: BlockScaledWeight per device
        self._dense_lock = threading.Lock()

    @property
    def weight(self) -> torch.Tensor:
        w = getattr(self.weight_format, "weight", None)
        if w is None:
            raise AttributeError(f"{self.weight_format.name} weights have no .weight (use qweight/scales)")
        return w

    @property
    def device(self) -> torch.device:
        return self.weight_format.device

    def to(self, device) -> "KvBProj":
        return KvBProj(self.weight_format.to(device))

    def dense_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The dequantized [N, K] weight, computed once per (dtype, device) and cached.

        Built under a lock, and never while a CUDA graph is being captured: a weight
        first built inside a capture would be an unfilled tensor for every later
        eager call. Call `prepare()` (or run one eager forward) before capturing."""
        key = (dtype, torch.device(device))

        def build() -> torch.Tensor:
            f = self.weight_format
            w = f.weight if isinstance(f, W.DenseWeight) and f.weight.dtype == dtype else f.dequantize(dtype)
            return w.to(device)

        return self._cached(self._dense_cache, key, key[1], f"the dequantized {dtype} weight", build)

    def _cached(self, cache: dict, key, device: torch.device, what: str, build):
        """cache[key], built by `build()` under the layer's lock on first use; never first
        built while a CUDA graph is being captured (it would be an unfilled tensor for
        every later eager call)."""
        w = cache.get(key)
        if w is not None:
            return w
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kv_b_proj: {what} for {device} is first needed inside a CUDA graph capture; "
                "call KvBProj.prepare() or run one eager forward before capturing"
            )
        with self._dense_lock:
            w = cache.get(key)
            if w is None:
                w = cache[key] = build()
        return w

    def scaled_mm_block_weight(self, device) -> "BlockScaledWeight":
        """Block-fp8 weights in cuBLASLt's blockwise layout (scaled_mm_block backend):
        the fp8 weight (K zero-padded to a multiple of 512 where it is not one) and its
        128 x 128 scales as [L4, N/128] with strides (1, L4); built once per device and
        cached on this layer, never first inside a CUDA graph capture."""
        from mla_ext.kv_b_proj import scaled_mm_block as S

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        f = self.weight_format
        if not isinstance(f, W.Fp8BlockWeight):
            raise ValueError(f"scaled_mm_block_weight: needs fp8_block weights, this layer holds {f.name}")
        return self._cached(self._block_cache, device, device, "the scaled_mm_block weight layout",
                            lambda: S.prepare_weight(f.weight.to(device), f.weight_scale_inv.to(device)))

    def prepare(self, device=None, dtype: torch.dtype | None = None, *, warm: bool | None = None,
                max_rows: int = 8192, act_dtype: torch.dtype | None = None) -> "KvBProj":
        """Builds what the forward path would otherwise build on first use (the
        dequantized weight of the dense fallback; for block-fp8 weights on sm_90 also
        the scaled_mm_block capability probe and weight layout), e.g. before a CUDA
        graph capture.

        `warm` (default: on a CUDA device) also runs the forward once per row-count
        bucket up to `max_rows` (`warm_rows`), so that every kernel variant the
        dispatch picks for some M (Triton launch configs by M, backend switches) is
        compiled now, not while serving or inside a graph capture. Integer arguments
        that vary with the batch never cause a compile (`do_not_specialize`).
        `act_dtype`: the activations the layer feeds (default `dtype` / params dtype;
        fp8 for fp8 prefill)."""
        device = torch.device(device or self.device)
        self.dense_weight(dtype or self.params_dtype, device)
        if isinstance(self.weight_format, W.Fp8BlockWeight) and device.type == "cuda":
            from mla_ext.kv_b_proj import scaled_mm_block as S

            if (not S.shape_reasons(self.N, self.K)
                    and not S.blockwise_scaled_mm_reasons(device, self.params_dtype)):
                self.scaled_mm_block_weight(device)
        if warm if warm is not None else device.type == "cuda":
            self._warm(device, act_dtype or dtype or self.params_dtype, max_rows)
        return self

    def _warm(self, device: torch.device, act_dtype: torch.dtype, max_rows: int) -> None:
        fp8 = act_dtype in FP8_DTYPES
        scale = torch.ones(1, dtype=torch.float32, device=device) if fp8 else None
        for m in warm_rows(max_rows):
            x = torch.zeros(m, self.K, dtype=torch.float32 if fp8 else act_dtype, device=device)
            self.forward(x.to(act_dtype), x_scale=scale)

    def _inputs(self, M: int, device, act_dtype, x=None, x_scale=None, out=None) -> KvBProjInputs:
        device = torch.device(device)
        return KvBProjInputs(self, M, device, _capability(device), act_dtype, x, x_scale, out)

    def _check(self, x: torch.Tensor, x_scale, out) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor [M, K={self.K}], got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.K:
            raise ValueError(f"x must be 2-D [M, K={self.K}], got shape {tuple(x.shape)}")
        if x.dtype in FP8_DTYPES:
            if not isinstance(self.weight_format, (W.Fp8Weight, W.Fp8BlockWeight)):
                raise ValueError(f"x is {x.dtype} but {self.weight_format.name} weights take "
                                 f"{self.params_dtype} activations (see kv_b_proj_input_dtype)")
        elif x.dtype != self.params_dtype:
            raise ValueError(f"x dtype must be {self.params_dtype} (the layer's params dtype) or fp8 for "
                             f"fp8 weights, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"x must be on {self.device}, got {x.device}")
        if x_scale is not None:
            self._check_x_scale(x, x_scale)
        if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (x.shape[0], self.N)
                                or out.dtype != self.params_dtype or out.device != x.device
                                or (self.N > 1 and out.stride(1) != 1)):
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be {self.params_dtype} [{x.shape[0]}, {self.N}] on {x.device} "
                             f"with unit column stride, got {got}")
        if out is not None:
            # A GEMM reads x while it writes out: any shared byte corrupts the result.
            checks.check_no_internal_overlap(out, "out")
            checks.check_no_overlap(out, "out", x, "x")

    @staticmethod
    def _check_x_scale(x: torch.Tensor, x_scale) -> None:
        """A per-tensor scale (one element) or per-row scales [M, 1] (FP8 prefill's
        per-token scales). A per-tensor scale is checked finite and > 0 where that is
        free (the CPU); per-row scales are not: a non-finite row scale (a request
        whose latents hold a NaN or inf) makes that row's output non-finite and no
        other row's, so it is the request's own result, not a call error."""
        m = x.shape[0]
        if not isinstance(x_scale, torch.Tensor):
            raise ValueError(f"x_scale: expected a one-element float tensor, float32 [{m}, 1] per-row "
                             f"scales or None, got {type(x_scale).__name__}")
        if x_scale.device != x.device:
            raise ValueError(f"x_scale: expected a tensor on {x.device} (x's device), got {x_scale.device}")
        per_row = x_scale.dim() == 2 and tuple(x_scale.shape) == (m, 1)
        if not x_scale.dtype.is_floating_point or not (x_scale.numel() == 1 or per_row):
            raise ValueError(f"x_scale must be a one-element float tensor or per-row scales [{m}, 1] "
                             f"(x has {m} rows), got {x_scale.dtype} {tuple(x_scale.shape)}")
        if x_scale.numel() == 1 and not per_row and x_scale.device.type == "cpu":
            # Free on the CPU; on a GPU reading it would sync the host (the caller owns it there).
            v = float(x_scale.reshape(()))
            if not (0.0 < v < float("inf")):
                raise ValueError(f"x_scale: expected a finite value > 0, got {v}")

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None,
                out: torch.Tensor | None = None, *, chosen=None) -> torch.Tensor:
        """x [M, K] in params_dtype (or fp8 for fp8 weights, scaled by `x_scale`: one
        element (per tensor) or [M, 1] (per row); default 1). The row stride may exceed
        K: `workspace[:, :L]` works. `chosen` (mla_ext.dispatch.Chosen): a call site resolved once."""
        self._check(x, x_scale, out)
        if x.shape[0] == 0:
            return out if out is not None else torch.empty((0, self.N), dtype=self.params_dtype, device=x.device)
        return DISPATCH.run(self._inputs(x.shape[0], x.device, x.dtype, x, x_scale, out), chosen)

    __call__ = forward

    def backend_for(self, M: int, device=None, act_dtype: torch.dtype | None = None) -> str:
        _check_rows(M)
        device = as_device(device or self.device)
        return DISPATCH.choose(self._inputs(M, device, act_dtype or self.params_dtype)).name

    def explain(self, M: int, device=None, act_dtype: torch.dtype | None = None) -> str:
        """Which backend serves M rows, and why every other one does not."""
        _check_rows(M)
        device = as_device(device or self.device)
        cap = _capability(device)
        head = (f"{self.weight_format.describe()} on {device}"
                + (f" (sm_{cap[0]}{cap[1]})" if cap else "") + f", M={M}")
        inputs = self._inputs(M, device, act_dtype or self.params_dtype)
        text = head + "\n" + DISPATCH.explain(inputs)
        if device.type == "cuda":  # which SASS binary or PTX the CUDA backends would run
            text += "\n  " + _ext.cuda_target_note(device)
        try:
            name = DISPATCH.choose(inputs).name
        except ValueError:
            return text
        return text + f"\n  activations: {activation_quantization(name, inputs.act_dtype)}"


def warm_rows(max_rows: int) -> list[int]:
    """Row counts that reach every M bucket of the dispatch and the Triton launch
    configs (their boundaries are powers of two): 1, 2^k and 2^k + 1 up to max_rows."""
    check_int(max_rows, "max_rows", minimum=1)
    out, p = {1, max_rows}, 2
    while p <= max_rows:
        out.update({p, min(p + 1, max_rows)})
        p *= 2
    return sorted(out)


# -- machine-level report for the `info` CLI ----------------------------------

_NEEDS = {
    "marlin_w8a16": (8, 0),
    "triton_w4a16": (8, 0),
    "triton_fp8_block": (8, 9),
    "scaled_mm_fp8": (8, 9),
}  # scaled_mm_block: sm_90 exactly, and this torch build's probe (below)


def backend_report() -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] about THIS machine (not about an input)."""
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    rows = []
    for b in DISPATCH.backends:
        why: list[str] = []
        need = _NEEDS.get(b.name)
        if need is not None:
            if cap is None:
                why.append("no CUDA device visible (CPU only when forced)")
            elif cap < need:
                why.append(f"needs sm_{need[0]}{need[1]}+, device is sm_{cap[0]}{cap[1]}")
        if b.name == "marlin_w8a16":
            mod, err = _marlin_module()
            if mod is None:
                why.append(err)
        if b.name == "scaled_mm_block":
            from mla_ext.kv_b_proj import scaled_mm_block as S

            if cap is None:
                why = ["no CUDA device visible"] + S.blockwise_scaled_mm_reasons("cpu")
            else:
                why = S.blockwise_scaled_mm_reasons(torch.device("cuda"), torch.bfloat16)
        if b.name == "scaled_mm_fp8" and not hasattr(torch, "_scaled_mm"):
            why.append("torch._scaled_mm is missing from this torch build")
        elif b.name == "scaled_mm_fp8" and cap is None:
            why += cpu_rowwise_scaled_mm_reasons()
        rows.append((OP, b.name, why))
    return rows
