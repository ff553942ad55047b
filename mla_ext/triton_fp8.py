"""Helpers shared by the Triton kernels: fp8 decoding without fp8 types, and
the device guard every launch runs under.

Triton's fp8e4nv type exists only on sm_89+ (on sm_86 compiling a kernel that
loads or converts it fails: "type fp8e4nv not supported in this
architecture"), and sm_86 is a target. So fp8 bytes are loaded as uint8 and
decoded with integer operations, exactly, on every architecture (and in the
interpreter). Shared by the cache gather and the NVFP4 kv_b_proj kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_ext import compat


def launch_guard(t: torch.Tensor):
    """Context manager to wrap a Triton launch on `t`'s tensors.

    Triton launches on the *current* CUDA device and its current stream, so
    tensors on cuda:1 while cuda:0 is current would run on the wrong device.
    This makes t's device current for the launch; for CPU tensors (the
    interpreter) it is `torch.cuda.device(-1)`, a no-op that never
    initialises CUDA.

    CPU tensors run in Triton's interpreter, which may not work with the
    installed numpy (Triton 3.6 with numpy >= 2.4): the first such launch
    probes it (mla_ext.compat, once per process, which installs a shim where
    that fixes it); if it still cannot work, the launch raises a RuntimeError
    naming the reason instead of failing inside the kernel.
    """
    if t.device.type != "cuda":
        why = compat.triton_interpreter_reasons()  # [] when not interpreting or fine
        if why:
            raise RuntimeError("; ".join(why))
    return torch.cuda.device(t.device if t.device.type == "cuda" else -1)


@triton.jit
def e4m3_to_f32(b):
    """uint8 e4m3fn bits (as int32) -> float32, exact; 0x7F/0xFF -> NaN.

    Placing the 7 exponent/mantissa bits at fp16 bits 7..13 gives an fp16 of
    value x * 2^-8 (bias 7 vs 15), subnormals included; * 256 restores it.
    """
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e5m2_to_f32(b):
    """uint8 e5m2 bits (as int32) -> float32, exact (e5m2 is an fp16's high byte)."""
    return (b << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_to_f32(c):
    """e2m1 codes (as int32, 0..15; bit 3 the sign) -> float32, exact; code 8 is -0.0.

    Magnitude index m = (e << 1) | f: e = 0 gives f * 0.5, else the fp32 with
    exponent e - 1 and mantissa f / 2, i.e. (1 + f / 2) * 2^(e - 1).
    """
    e = (c >> 1) & 3
    f = c & 1
    mag = tl.where(e == 0, f * 0x3F000000, ((e + 126) << 23) | (f << 22))  # 0x3F000000 = 0.5f
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32_over_16384(c):
    """e2m1 codes (as int32, 0..15) -> float32 value x 2^-14, exact: the magnitude bits at
    fp16 bits 9..11 are an fp16 (subnormal for e = 0) of exactly that value, so two integer
    ops and one conversion (e2m1_to_f32 takes five plus a select). For loaders whose block
    scale can absorb the 2^14 (the latent kernel's nvfp4 decoder, where the fewer live
    temporaries let 64-row wgmma tiles compile without spills)."""
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
