"""mla_ext's fused_norm_rope / fused_q (mla_ext/vllm/dsa_model_ops.py, which the vLLM plugin
puts in place of vLLM 0.33's on capability < 8.9) against vLLM's own Triton kernels run in the
Triton interpreter (tests/clients/vllm_dsa_fused.py, with the interpreter's fp32 -> bf16 / e4m3
casts corrected to the GPU's round-to-nearest-even, saturating) on the seeded cases of
dsa_fused_cases.py: every return value and every in-place write (q/kv/k_pe/index_k outputs, the
top-k buffer, the latent cache in auto/bf16/fp8/fp8_ds_mla, the fp8 index cache, plain and
shuffled) is compared; caches and outputs start poisoned; padding slots (-1) stay untouched.

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
from mla_ext.vllm.dsa_model_ops import fused_norm_rope, fused_q

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAX_NEAR = 0.01  # share of reduction-derived values allowed one ulp/code off vLLM's


@pytest.fixture(scope="module")
def oracle(vllm_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("dsa_fused") / "vllm.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_tree), str(REPO)]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "vllm_dsa_fused.py"), str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _near_floats(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """bf16/fp16: equal up to one ulp at a few elements; fp32: within 8 ulps (the whole row moves
    with the norm's reduction order). NaN where both are NaN."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, what
    a, b = ours.float(), theirs.float()
    assert torch.equal(a.isnan(), b.isnan()), what
    a, b = a.nan_to_num(), b.nan_to_num()
    ulps = 8 if ours.dtype == torch.float32 else 1
    ulp = torch.finfo(ours.dtype).eps * torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    assert bool(((a - b).abs() <= ulps * ulp).all()), f"{what}: max diff {(a - b).abs().max()}"
    assert ours.dtype == torch.float32 or (a != b).float().mean() <= MAX_NEAR, what


def _near_e4m3(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """e4m3 bytes equal, or the same sign and one code apart, at a few bytes."""
    a, b = ours.view(torch.uint8).int(), theirs.view(torch.uint8).int()
    off = a != b
    assert bool(((a & 0x80) == (b & 0x80))[off].all()) and bool(((a & 0x7F) - (b & 0x7F)).abs().le(1).all()), what
    assert off.float().mean() <= MAX_NEAR, what


def _check_mla_cache(ours, theirs, poison, slots, cdt):
    ob, tb, pb = (c.view(torch.uint8).reshape(-1, c.shape[2] * c.element_size()) for c in (ours, theirs, poison))
    written = slots[slots >= 0]
    untouched = torch.ones(ob.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(ob[untouched], pb[untouched]) and torch.equal(tb[untouched], pb[untouched])
    o, t = ob[written], tb[written]
    if cdt == "fp8_ds_mla":
        _near_e4m3(o[:, :512], t[:, :512], "fp8_ds_mla values")
        assert torch.equal(o[:, 512:], t[:, 512:]), "fp8_ds_mla scales and bf16 rope"
    elif cdt == "fp8":
        _near_e4m3(o[:, :512], t[:, :512], "fp8 latent")
        assert torch.equal(o[:, 512:], t[:, 512:]), "fp8 rope"
    else:
        o, t = o.view(ours.dtype), t.view(ours.dtype)
        _near_floats(o[:, :512], t[:, :512], "native latent")
        assert torch.equal(o[:, 512:], t[:, 512:]), "native rope"


def _check_index_cache(ours, theirs, poison, B):
    """Whole pages: scales exact, values within one code; bytes neither run wrote stay poison."""
    D = cases.IDX_DIM
    ob, tb, pb = (c.reshape(c.shape[0], -1) for c in (ours, theirs, poison))
    assert torch.equal(ob[:, B * D:], tb[:, B * D:]), "index cache scales"
    _near_e4m3(ob[:, :B * D], tb[:, :B * D], "index cache values")
    same = (ob == pb) & (tb == pb)
    changed_ours = (ob != pb).sum()
    assert changed_ours <= (tb != pb).sum() + (ob != tb).sum() and bool(same.any())


@pytest.mark.parametrize("name", list(cases.NORM_ROPE_CASES))
def test_fused_norm_rope_equals_vllms_kernel(oracle, name):
    theirs = oracle["norm_rope"][name]
    args, kwargs = cases.norm_rope_case(name)
    _, poison_kw = cases.norm_rope_case(name)
    ret = fused_norm_rope(*args, **kwargs)
    _near_floats(ret, theirs["ret"], "q_c_out")
    if "q_c_out" in kwargs:
        assert ret is kwargs["q_c_out"]
    tk, ok = theirs["kwargs"], kwargs
    for out in ("kv_c_out", "index_k_out"):
        if out in ok:
            _near_floats(ok[out], tk[out], out)
    if "k_pe_out" in ok:
        assert torch.equal(ok["k_pe_out"], tk["k_pe_out"]), "k_pe_out (element-wise RoPE)"
    if "index_k_out" in ok and "slot_mapping" in ok:  # rows of padding slots are not written
        assert bool(ok["index_k_out"][ok["slot_mapping"] < 0].isnan().all())
    topk, has_idx = args[-1], kwargs["has_indexer"]
    assert torch.equal(topk, theirs["args"][-1])
    assert bool((topk[:cases.T] == (-1 if has_idx else cases.POISON_TOPK)).all())
    assert bool((topk[cases.T:] == cases.POISON_TOPK).all())
    if "mla_kv_cache" in ok:
        slots = ok["slot_mapping"]
        _check_mla_cache(ok["mla_kv_cache"], tk["mla_kv_cache"], poison_kw["mla_kv_cache"], slots,
                         ok["mla_kv_cache_dtype"])
        B = ok["indexer_k_cache"].shape[1]
        if has_idx:
            _check_index_cache(ok["indexer_k_cache"], tk["indexer_k_cache"], poison_kw["indexer_k_cache"], B)
        else:
            assert torch.equal(ok["indexer_k_cache"], poison_kw["indexer_k_cache"])
    for i in (1, 4, 7, 9):  # inputs are read only
        if args[i] is not None:
            assert torch.equal(args[i], cases.norm_rope_case(name)[0][i])


@pytest.mark.parametrize("name", list(cases.Q_CASES))
def test_fused_q_equals_vllms_kernel(oracle, name):
    theirs = oracle["q"][name]["ret"]
    args, kwargs = cases.q_case(name)
    ours = fused_q(*args, **kwargs)
    for o, t in zip(ours, theirs):
        assert o.dtype == t.dtype and o.shape == t.shape
    iq, w, mqa = ours
    if kwargs["has_indexer"]:  # element-wise (RoPE, max, power-of-two scale): bit-identical
        assert torch.equal(iq.view(torch.uint8), theirs[0].view(torch.uint8)), "index_q_fp8"
        assert torch.equal(w, theirs[1]), "index_weights_out"
    if kwargs["quantize_mqa"]:
        raw = mqa.view(torch.uint8)
        assert torch.equal(raw, theirs[2].view(torch.uint8)), "mqa_q (fp8)"
        if args[6].item() <= 0.5:  # ql_nope * 60 / q_scale: some saturate at 448
            assert bool((raw[..., :cases.L_NOPE] & 0x7F == 0x7E).any())
    else:
        assert torch.equal(mqa, theirs[2]), "mqa_q (RoPE'd q_pe)"
