"""Runs vLLM 0.33's own DeepSeek-V3.2 Triton kernels fused_norm_rope / fused_q
(vllm/models/deepseek_v32/common/kernels.py) in the Triton interpreter on the seeded cases of
dsa_fused_cases.py and saves what they return and write (torch.save to argv[1]): the oracle of
tests/clients/test_vllm_dsa_fused.py. Run in a subprocess with vLLM's client tree on PYTHONPATH
and TRITON_INTERPRET=1; the platform is vLLM's UnspecifiedPlatform (CPU tensors, fp8 = e4m3fn,
no PDL, fp32 indexer scales as on every GPU but SM100).

The interpreter's fp32 -> bf16 and fp32 -> fp8e4nv conversions are not the GPU's
(toolchain-notes: bf16 truncates, e4m3 rounds wrongly for ~2% of values). They are corrected
here, and only they: triton.runtime.interpreter._convert_float, for an fp32 input and a bf16 or
fp8e4nv output, returns torch's round-to-nearest-even conversion (for e4m3 after clamping to
+-448, NaN kept: the GPU's cvt.rn.satfinite), the conversions the kernels ask for on the GPU.
Every other conversion is the interpreter's own."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM keeps real Triton (not its placeholder) without a GPU driver only where the visible
# devices are set and empty (vllm/triton_utils/importing.py); the interpreter needs no driver.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

_interpreters_convert = interpreter._convert_float


def _convert_float_like_the_gpu(input, input_dtype, output_dtype, rounding_mode):
    if input_dtype == tl.float32 and output_dtype in (tl.bfloat16, tl.float8e4nv):
        x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
        if output_dtype == tl.float8e4nv:
            bits = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        else:
            bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return bits.reshape(np.shape(input))
    return _interpreters_convert(input, input_dtype, output_dtype, rounding_mode)


interpreter._convert_float = _convert_float_like_the_gpu

import vllm.platforms  # noqa: E402
from vllm.platforms.interface import UnspecifiedPlatform  # noqa: E402


class CpuPlatform(UnspecifiedPlatform):
    device_type = "cpu"
    device_name = "cpu"
    dispatch_key = "CPU"


vllm.platforms._current_platform = CpuPlatform()
vllm.platforms.current_platform = vllm.platforms._current_platform

from vllm.models.deepseek_v32.common import kernels  # noqa: E402

import dsa_fused_cases as cases  # noqa: E402

assert kernels._FP8_DTYPE == torch.float8_e4m3fn and kernels._FP8_MAX == 448.0
results = {"norm_rope": {}, "q": {}}
for name in cases.NORM_ROPE_CASES:
    args, kwargs = cases.norm_rope_case(name)
    ret = kernels.fused_norm_rope(*args, **kwargs)
    results["norm_rope"][name] = {"ret": ret, "args": args, "kwargs": kwargs}
for name in cases.Q_CASES:
    args, kwargs = cases.q_case(name)
    ret = kernels.fused_q(*args, **kwargs)
    results["q"][name] = {"ret": ret, "args": args, "kwargs": kwargs}
torch.save(results, sys.argv[1])
print("ok")
