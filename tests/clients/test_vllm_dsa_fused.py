"""mla_ext's fused_norm_rope / fused_q (mla_ext/vllm/dsa_model_ops.py, which the vLLM plugin
puts in place of vLLM 0.33's on capability < 8.9) against vLLM's own Triton kernels run in the
Triton interpreter (tests/clients/vllm_dsa_fused.py, with the interpreter's fp32 -> bf16 / e4m3
casts corrected to the GPU's round-to-nearest-even, saturating) on the seeded cases of
dsa_fused_cases.py: every return value and every in-place write (q/kv/k_pe/index_k outputs, the
top-k buffer, the latent cache in auto/bf16/fp8/fp8_ds_mla, the fp8 index cache, plain and
shuffled) is compared; caches and outputs start poisoned; padding slots (-1) stay untouched. Both
of mla_ext's paths: the torch ops and the Triton kernels (forced in the interpreter).

Element-wise results (RoPE'd rows, the fp8 query, index_q_fp8, index weights, the caches' rope
parts and scales) must be bit-identical; values behind a reduction (RMSNorm, LayerNorm: numpy's
and torch's summation orders differ) within one bf16 ulp / one e4m3 code, for a handful of values."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clients import dsa_fused_cases as cases
from mla_ext.vllm.dsa_model_ops import FUSED_Q, NORM_ROPE, fused_norm_rope, fused_q

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def oracle(vllm_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("dsa_fused") / "vllm.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_tree), str(REPO)]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "vllm_dsa_fused.py"), str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


# Both of mla_ext's paths: torch (the CPU default) and the Triton kernels (the CUDA path, forced
# here in the interpreter).
BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(cases.NORM_ROPE_CASES))
def test_fused_norm_rope_equals_vllms_kernel(oracle, name, backend):
    args, kwargs = cases.norm_rope_case(name)
    with NORM_ROPE.force(backend):
        ret = fused_norm_rope(*args, **kwargs)
    cases.compare_norm_rope(name, ret, args, kwargs, oracle["norm_rope"][name], exact=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(cases.Q_CASES))
def test_fused_q_equals_vllms_kernel(oracle, name, backend):
    args, kwargs = cases.q_case(name)
    with FUSED_Q.force(backend):
        ret = fused_q(*args, **kwargs)
    cases.compare_q(args, kwargs, ret, oracle["q"][name]["ret"], exact=True)
