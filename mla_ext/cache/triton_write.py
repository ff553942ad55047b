"""Triton cache writer and KV-scale kernel: the GPU path where the CUDA kernels
cannot run (a library without a binary for the device), bit-identical to the
CPU writer (csrc/cache/cache_cpu.cpp) in every cache format.

Why integer bit manipulation everywhere: a float -> fp8 cast is not available
on sm_86 in Triton and is wrong under the interpreter (toolchain notes), and
bf16 arithmetic is wrong under the interpreter. So inputs are loaded as their
bits (bf16/fp16 as int16) and widened exactly, fp8/e2m1 codes are computed with
the same integer rounding as csrc/common/fp8.h, and every division is IEEE
(`div_rn`: Triton's plain `/` on fp32 is an approximate division on NVIDIA).
The result is the same bytes on a GPU, on the CPU and in the interpreter.

One program per token; a slot outside [0, num_blocks * block_size) (padding
-1 included) writes nothing, as every other backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_ext.config.formats import DsMla, Nvfp4DsMla, QuantMode, get_format
from mla_ext.triton_fp8 import e4m3_to_f32, launch_guard
from mla_ext.cache.reference import fp8_max

# Input kinds (how a row is loaded): fp32 values, bf16 or fp16 bits, raw words (native copy).
IN_F32, IN_BF16, IN_F16, IN_RAW = 0, 1, 2, 3
# Formats as the kernel sees them.
MODE_NATIVE, MODE_E4M3, MODE_E5M2, MODE_DS_MLA, MODE_NVFP4 = 0, 1, 2, 3, 4
MIN_KV_SCALE = 1e-12  # as reference.MIN_KV_SCALE / csrc kMinKvScale
SCALE_ROWS = 16  # rows per program of the KV-scale partial max


@triton.jit
def _widen(v, IN_KIND: tl.constexpr):
    """A loaded input (fp32 values or 16-bit patterns as int16) -> fp32, exactly."""
    if IN_KIND == 1:
        return ((v.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif IN_KIND == 2:
        return v.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return v


@triton.jit
def _encode_fp8(x, MAN: tl.constexpr, BIAS: tl.constexpr, SAT_BITS: tl.constexpr, SAT_BYTE: tl.constexpr):
    """fp32 -> fp8 byte (int32 0..255) with MAN mantissa bits and exponent bias BIAS:
    round to nearest even, saturating (|x| >= the fp32 SAT_BITS, inf included, gives
    SAT_BYTE), NaN -> 0x7F | sign. csrc/common/fp8.h encode_e4m3_sat / encode_e5m2_sat,
    step by step, in integers (no fp8 type: none on sm_86, wrong in the interpreter)."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # Subnormal results k * 2^(1 - BIAS - MAN): adding a power of two whose ulp is
    # that step lets the FPU round to nearest even.
    big: tl.constexpr = (151 - BIAS - MAN) << 23
    sub = (a.to(tl.float32, bitcast=True) + tl.full(a.shape, big, tl.int32).to(tl.float32, bitcast=True)
           ).to(tl.int32, bitcast=True) - big
    shift: tl.constexpr = 23 - MAN
    norm = (a - ((127 - BIAS) << 23) + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift
    mag = tl.where(a < ((128 - BIAS) << 23), sub, norm)
    mag = tl.where(a >= SAT_BITS, SAT_BYTE, mag)
    mag = tl.where(a > 0x7F800000, 0x7F, mag)
    return sign | (mag & 0x7F)


@triton.jit
def _encode_e4m3(x):
    """e4m3fn: bias 7, max 448 (0x7E); 0x7F is NaN."""
    return _encode_fp8(x, 3, 7, 0x43E00000, 0x7E)


@triton.jit
def _encode_e5m2(x):
    """e5m2: bias 15, max finite 57344 (0x7B)."""
    return _encode_fp8(x, 2, 15, 0x47600000, 0x7B)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (int32 0..65535), RNE, every NaN -> 0x7FC0 (f32_to_bf16_bits)."""
    u = x.to(tl.int32, bitcast=True)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)


@triton.jit
def _ds_tile_scale(amax):
    """2^ceil(log2(max(amax / 448, 1e-4))) from the bits (fp8::ds_mla_tile_scale)."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    s = tl.where(s >= 1e-4, s, 1e-4)  # also maps NaN to the floor
    u = s.to(tl.int32, bitcast=True)
    up = (((u >> 23) + 1) << 23).to(tl.float32, bitcast=True)
    return tl.where((u & 0x7FFFFF) == 0, s, up)


@triton.jit
def _e2m1_code(x, inv_s):
    """e2m1 code of x * inv_s (inv_s = the IEEE reciprocal of the block scale, as vLLM's
    writer and nvfp4_ds_mla.h encode_e2m1: not x / s, which differs at e2m1 ties): sign
    of the product, magnitude rounded to nearest even on the grid 0 .5 1 1.5 2 3 4 6,
    saturating."""
    q = x * inv_s
    sign = (q.to(tl.int32, bitcast=True) >> 28) & 8
    a = tl.abs(q)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    return sign | idx


# Integer arguments that change with the batch or the cache view are not specialized
# (Triton would compile a new variant for == 1 / % 16 values mid-serving).
_WRITE_VARYING = ["num_slots", "block_size", "kv_stride", "pe_stride", "cache_block_stride",
                  "cache_entry_stride"]


# register budget: 64
@triton.jit(do_not_specialize=_WRITE_VARYING)
def _write_kernel(kv_c, k_pe, cache, slots, k_scale, num_slots, block_size,
                  kv_stride, pe_stride, cache_block_stride, cache_entry_stride,
                  L: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
                  MODE: tl.constexpr, IN_KIND: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        dst = cache + (slot // block_size) * cache_block_stride + (slot % block_size) * cache_entry_stride
        src = kv_c + t * kv_stride
        pe = k_pe + t * pe_stride
        if MODE == 0:  # native: the bits, unchanged
            i = tl.arange(0, BLOCK)
            v = tl.load(src + i, mask=i < L)
            w = tl.load(pe + (i - L), mask=(i >= L) & (i < L + R))
            tl.store(dst + i, tl.where(i < L, v, w), mask=i < L + R)
        elif MODE == 1 or MODE == 2:  # fp8 per tensor: saturate(x / k_scale)
            i = tl.arange(0, BLOCK)
            x = tl.where(i < L, _widen(tl.load(src + i, mask=i < L), IN_KIND),
                         _widen(tl.load(pe + (i - L), mask=(i >= L) & (i < L + R)), IN_KIND))
            q = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * tl.load(k_scale))
            b = _encode_e4m3(q) if MODE == 1 else _encode_e5m2(q)
            tl.store(dst + i, b.to(tl.uint8), mask=i < L + R)
        elif MODE == 3:  # fp8_ds_mla: 4 tiles of 128 e4m3 + 4 fp32 scales + 64 bf16
            tile = tl.arange(0, 4)
            col = tl.arange(0, 128)
            offs = tile[:, None] * 128 + col[None, :]
            x = _widen(tl.load(src + offs), IN_KIND)
            a = tl.abs(x)
            amax = tl.max(tl.where(a == a, a, 0.0), axis=1)  # NaN ignored, as std::max
            s = _ds_tile_scale(amax)
            q = tl.math.div_rn(x, tl.broadcast_to(s[:, None], [4, 128]))
            tl.store(dst + offs, _encode_e4m3(q).to(tl.uint8))
            sbits = s.to(tl.int32, bitcast=True)
            byte = tl.arange(0, 4)
            tl.store(dst + 512 + tile[:, None] * 4 + byte[None, :],
                     ((sbits[:, None] >> (byte[None, :] * 8)) & 0xFF).to(tl.uint8))
            r = tl.arange(0, 64)
            if R > 0:
                h = _bf16_bits(_widen(tl.load(pe + r), IN_KIND))
            else:
                h = tl.zeros([64], tl.int32)  # R = 0: the rope bytes are zero
            half = tl.arange(0, 2)
            tl.store(dst + 528 + r[:, None] * 2 + half[None, :],
                     ((h[:, None] >> (half[None, :] * 8)) & 0xFF).to(tl.uint8))
        else:  # nvfp4_ds_mla: 32 blocks of 16 e2m1 (pairs) + 64 e4m3 rope + 32 e4m3 scales
            blk = tl.arange(0, 32)
            k = tl.arange(0, 8)
            even = blk[:, None] * 16 + k[None, :] * 2
            x0 = _widen(tl.load(src + even), IN_KIND)
            x1 = _widen(tl.load(src + even + 1), IN_KIND)
            a0, a1 = tl.abs(x0), tl.abs(x1)
            finite = (tl.max(tl.where(a0 <= 3.4028234663852886e38, 0, 1), axis=1)
                      + tl.max(tl.where(a1 <= 3.4028234663852886e38, 0, 1), axis=1)) == 0
            amax = tl.maximum(tl.max(tl.where(a0 == a0, a0, 0.0), axis=1),
                              tl.max(tl.where(a1 == a1, a1, 0.0), axis=1))
            s = tl.math.div_rn(amax, tl.full([32], 6.0, tl.float32))
            s = tl.where(s >= 0.001953125, s, 0.001953125)  # 2^-9; NaN -> floor
            sb = tl.where(finite, _encode_e4m3(s), 0x7F)
            sdec = e4m3_to_f32(sb)
            inv = tl.broadcast_to(tl.math.div_rn(tl.full([32], 1.0, tl.float32), sdec)[:, None], [32, 8])
            pair = _e2m1_code(x0, inv) | (_e2m1_code(x1, inv) << 4)
            pair = tl.where(finite[:, None], pair, 0)
            tl.store(dst + blk[:, None] * 8 + k[None, :], pair.to(tl.uint8))
            tl.store(dst + 320 + 8 * (blk & 3) + (blk >> 2), sb.to(tl.uint8))
            r = tl.arange(0, 64)
            tl.store(dst + 256 + r, _encode_e4m3(_widen(tl.load(pe + r), IN_KIND)).to(tl.uint8))


# register budget: 128
@triton.jit(do_not_specialize=["num_tokens", "kv_stride", "pe_stride"])
def _amax_kernel(kv_c, k_pe, partial, num_tokens, kv_stride, pe_stride,
                 L: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 IN_KIND: tl.constexpr):
    """partial[p] = max |finite value| over rows [p * ROWS, (p + 1) * ROWS) of (kv_c | k_pe)."""
    p = tl.program_id(0)
    row = p.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK)
    ok = row[:, None] < num_tokens
    x = tl.where(i[None, :] < L,
                 _widen(tl.load(kv_c + row[:, None] * kv_stride + i[None, :], mask=ok & (i[None, :] < L)),
                        IN_KIND),
                 _widen(tl.load(k_pe + row[:, None] * pe_stride + (i[None, :] - L),
                                mask=ok & (i[None, :] >= L) & (i[None, :] < L + R)), IN_KIND))
    a = tl.abs(x)
    a = tl.where(ok & (i[None, :] < L + R) & (a <= 3.4028234663852886e38), a, 0.0)  # drops NaN, inf
    tl.store(partial + p, tl.max(tl.max(a, axis=1), axis=0))


# register budget: 32
@triton.jit(do_not_specialize=["num_partials"])
def _scale_kernel(partial, out, num_partials, fp8_max, BLOCK: tl.constexpr):
    """out = max(max(partial) / fp8_max, 1e-12), IEEE division."""
    m = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_partials, BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(partial + i, mask=i < num_partials, other=0.0))
    amax = tl.max(m, axis=0)
    s = tl.math.div_rn(tl.full([1], 1.0, tl.float32) * amax, tl.full([1], 1.0, tl.float32) * fp8_max)
    tl.store(out + tl.arange(0, 1), tl.where(s >= 1e-12, s, 1e-12))



def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_reasons(tensors: list[Tensor]) -> list[str]:
    devs = {t.device for t in tensors}
    why = []
    if len(devs) != 1:
        why.append(f"tensors are on several devices: {sorted(str(d) for d in devs)}")
    if _interpreting():
        if any(d.type != "cpu" for d in devs):
            why.append("TRITON_INTERPRET is set: tensors must be on the CPU")
    elif any(d.type != "cuda" for d in devs):
        why.append("tensors are not on CUDA (and TRITON_INTERPRET is not set)")
    return why


def write_not_supported_reasons(args: tuple) -> list[str]:
    """Why `write_triton(*args)` cannot serve these (already validated) write arguments."""
    kv_c, k_pe, kv_cache, slot_mapping, _name, k_scale = args
    return _device_reasons([kv_c, k_pe, kv_cache, slot_mapping, k_scale])


def kv_scale_not_supported_reasons(args: tuple) -> list[str]:
    kv_c, k_pe, _name = args
    return _device_reasons([kv_c, k_pe])


def _in_view(t: Tensor, raw: bool) -> tuple[Tensor, int]:
    """The view a kernel loads `t` through, and its IN_KIND."""
    if t.dtype == torch.float32:
        return (t.view(torch.int32), IN_RAW) if raw else (t, IN_F32)
    return t.view(torch.int16), (IN_RAW if raw else IN_BF16 if t.dtype == torch.bfloat16 else IN_F16)


_MODES = {QuantMode.NONE: MODE_NATIVE, QuantMode.FP8_PER_TILE: MODE_DS_MLA,
          QuantMode.NVFP4_PER_BLOCK: MODE_NVFP4}


def _mode(fmt) -> int:
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        return MODE_E4M3 if fmt.fp8_dtype == torch.float8_e4m3fn else MODE_E5M2
    return _MODES[fmt.quant_mode]


def write_triton(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                 kv_cache_dtype: str, k_scale: Tensor) -> None:
    """concat_and_cache_mla through Triton (arguments already validated by the api)."""
    fmt = get_format(kv_cache_dtype)
    mode = _mode(fmt)
    T, L = kv_c.shape
    R = k_pe.shape[1]
    if T == 0:
        return
    kv, kind = _in_view(kv_c, mode == MODE_NATIVE)
    pe, _ = _in_view(k_pe, mode == MODE_NATIVE)
    if mode == MODE_NATIVE:
        cache = kv_cache.view(kv.dtype)
    else:
        cache = kv_cache.view(torch.uint8)
    if R == 0:  # a [T, 0] tensor: any valid pointer (never read)
        pe = kv
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    block = triton.next_power_of_2(max(L + R, 1))
    with launch_guard(kv_cache):
        _write_kernel[(T,)](
            kv, pe, cache, slot_mapping, k_scale, num_blocks * block_size, block_size,
            kv.stride(0), pe.stride(0), cache.stride(0), cache.stride(1),
            L=L, R=R, BLOCK=block, MODE=mode, IN_KIND=kind,
        )


def kv_scale_triton(kv_c: Tensor, k_pe: Tensor, kv_cache_dtype: str) -> Tensor:
    """compute_kv_scale through Triton: two launches (partial maxima, then the scale)."""
    fmt = get_format(kv_cache_dtype)
    out = torch.ones(1, dtype=torch.float32, device=kv_c.device)
    if fmt.quant_mode != QuantMode.FP8_PER_TENSOR:
        return out  # the ds formats keep their scales in the rows

    T, L = kv_c.shape
    R = k_pe.shape[1]
    kv, kind = _in_view(kv_c, False)
    pe, _ = _in_view(k_pe, False)
    if R == 0:
        pe = kv
    n = triton.cdiv(T, SCALE_ROWS)
    partial = torch.zeros(max(n, 1), dtype=torch.float32, device=kv_c.device)
    with launch_guard(kv_c):
        if n:
            _amax_kernel[(n,)](kv, pe, partial, T, kv.stride(0), pe.stride(0),
                               L=L, R=R, BLOCK=triton.next_power_of_2(max(L + R, 1)), ROWS=SCALE_ROWS,
                               IN_KIND=kind)
        _scale_kernel[(1,)](partial, out, n, fp8_max(fmt.fp8_dtype), BLOCK=64)
    return out
