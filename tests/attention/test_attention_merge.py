"""merge_attn_states (SPEC §7) on every backend against the fp64 reference.

Inputs are random with edge rows mixed in: -inf on one side, +inf (treated as
-inf), both sides empty, and garbage (inf/NaN) in the o of an empty side,
which must never leak into the result. Outputs are poisoned with NaN before
the call and surrounded by guard regions that must stay untouched.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_ext import _ext
from mla_ext.attention import MERGE, merge_attn_states
from mla_ext.attention.reference import merge_attn_states_ref
from helpers.numeric import rel_fro

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
GUARD = 1234.5


def make_inputs(t, n, d, dtype, device="cpu", seed=0, edges=True):
    g = torch.Generator().manual_seed(seed)
    o1 = torch.randn(t, n, d, generator=g).to(dtype)
    o2 = torch.randn(t, n, d, generator=g).to(dtype)
    lse1 = torch.randn(n, t, generator=g) * 4
    lse2 = torch.randn(n, t, generator=g) * 4
    if edges and t * n >= 8:
        kind = torch.randint(0, 6, (n, t), generator=g)
        lse1[kind == 1] = -math.inf  # prefix empty
        lse2[kind == 2] = -math.inf  # suffix empty
        lse1[kind == 3] = math.inf  # +inf counts as -inf
        lse1[kind == 4] = -math.inf  # both empty
        lse2[kind == 4] = -math.inf
        lse2[kind == 5] = math.inf
        lse1[kind == 5] = -math.inf  # both "empty" via +inf / -inf
        # An empty side's o may hold anything; it must not reach the output.
        empty1 = (kind == 1) | (kind == 3) | (kind == 4) | (kind == 5)
        o1[empty1.transpose(0, 1)] = torch.tensor(float("nan"), dtype=dtype)
        empty2 = (kind == 2) | (kind == 4) | (kind == 5)
        o2[empty2.transpose(0, 1)] = torch.tensor(float("inf"), dtype=dtype)
    return [x.to(device) for x in (o1, lse1, o2, lse2)]


def guarded(shape, dtype, device, pad=(2, 1, 8)):
    """A NaN-poisoned view inside a GUARD-filled buffer; returns (view, buffer, mask of the view)."""
    big = torch.full([s + 2 * p for s, p in zip(shape, pad)], GUARD, dtype=dtype, device=device)
    idx = tuple(slice(p, p + s) for s, p in zip(shape, pad))
    view = big[idx]
    view.fill_(float("nan"))
    mask = torch.zeros(big.shape, dtype=torch.bool, device=device)
    mask[idx] = True
    return view, big, mask


def check_against_ref(o, lse, o1, lse1, o2, lse2, dtype):
    ref_o, ref_lse = merge_attn_states_ref(o1.cpu(), lse1.cpu(), o2.cpu(), lse2.cpu(), torch.float64)
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any(), "NaN in merged output"
    assert not torch.isnan(lse).any(), "NaN in merged LSE"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert not torch.isposinf(lse).any()
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    assert rel_fro(o, ref_o) <= TOL[dtype]
    # Both sides empty: exactly zero.
    empty = (~fin).transpose(0, 1)
    assert (o[empty] == 0).all()
    # One side empty: the other side, unchanged (bit for bit).
    a = torch.where(lse1.cpu() == math.inf, -math.inf, lse1.cpu())
    b = torch.where(lse2.cpu() == math.inf, -math.inf, lse2.cpu())
    only1 = (torch.isfinite(a) & torch.isneginf(b)).transpose(0, 1)
    only2 = (torch.isneginf(a) & torch.isfinite(b)).transpose(0, 1)
    assert torch.equal(o[only1], o1.cpu()[only1])
    assert torch.equal(o[only2], o2.cpu()[only2])
    assert torch.equal(lse[only1.transpose(0, 1)], a[only1.transpose(0, 1)])


try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except ImportError:  # a CPU-only torch install need not have triton
    _HAVE_TRITON = False

CPU_BACKENDS = ["cpu"] + (["triton"] if _HAVE_TRITON else []) + ["torch"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 4, 128), (7, 3, 72), (1, 1, 1)])
def test_merge_matches_reference_with_guards(backend, dtype, shape):
    t, n, d = shape
    o1, lse1, o2, lse2 = make_inputs(t, n, d, dtype, seed=t * 31 + d)
    out, out_big, out_mask = guarded((t, n, d), dtype, "cpu")
    out_lse, lse_big, lse_mask = guarded((n, t), torch.float32, "cpu", pad=(1, 3))
    with MERGE.force(backend):
        merge_attn_states(o1, lse1, o2, lse2, out=out, out_lse=out_lse)
    check_against_ref(out, out_lse, o1, lse1, o2, lse2, dtype)
    assert (out_big[~out_mask] == GUARD).all(), "merge wrote outside `out`"
    assert (lse_big[~lse_mask] == GUARD).all(), "merge wrote outside `out_lse`"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_merge_strided_views_with_different_head_strides(backend):
    """Prefix and suffix with different token/head strides (an upstream bug
    derived one from the other), LSEs as transposed views."""
    t, n, d = 19, 5, 40
    o1, lse1, o2, lse2 = make_inputs(t, n, d, torch.bfloat16, seed=7)
    p = torch.randn(t, n, d + 24).to(torch.bfloat16)[:, :, 8 : 8 + d]  # head stride d+24
    p.copy_(o1)
    s = torch.randn(n, t, d).to(torch.bfloat16).transpose(0, 1)  # token stride d, head stride t*d
    s.copy_(o2)
    l1 = torch.randn(t, n).transpose(0, 1)  # [N, T] with strides (1, N)
    l1.copy_(lse1)
    out = torch.full((t, n, 2 * d), float("nan"), dtype=torch.bfloat16)[:, :, :d]
    out_lse = torch.empty(n, t)
    with MERGE.force(backend):
        merge_attn_states(p, l1, s, lse2, out=out, out_lse=out_lse)
    check_against_ref(out, out_lse, o1, lse1, o2, lse2, torch.bfloat16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_merge_in_place_and_without_out_lse(backend):
    t, n, d = 21, 4, 64
    o1, lse1, o2, lse2 = make_inputs(t, n, d, torch.float32, seed=3)
    ref_o, ref_lse = merge_attn_states_ref(o1, lse1, o2, lse2, torch.float64)
    a, la = o1.clone(), lse1.clone()
    with MERGE.force(backend):
        merge_attn_states(a, la, o2, lse2, out=a, out_lse=la)
    assert rel_fro(a, ref_o) <= 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(la))
    assert torch.allclose(la[fin], ref_lse[fin].float(), atol=1e-5)
    # out_lse omitted on the raw op: only o is written.
    if backend == "cpu":
        out = torch.full_like(o1, float("nan"))
        _ext.ops().merge_attn_states(out, None, o1, lse1, o2, lse2)
        assert rel_fro(out, ref_o) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(0, 40),
    n=st.integers(1, 6),
    d=st.integers(1, 96),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_merge_cpu_kernel_property(t, n, d, dtype, seed):
    o1, lse1, o2, lse2 = make_inputs(t, n, d, dtype, seed=seed)
    out = torch.full((t, n, d), float("nan"), dtype=dtype)
    out_lse = torch.full((n, t), float("nan"))
    with MERGE.force("cpu"):
        merge_attn_states(o1, lse1, o2, lse2, out=out, out_lse=out_lse)
    if t:
        check_against_ref(out, out_lse, o1, lse1, o2, lse2, dtype)


def test_merge_reference_formula_fp64():
    """The reference against the SPEC §7 formula written out by hand."""
    o1 = torch.tensor([[[1.0, 2.0]]], dtype=torch.float64)
    o2 = torch.tensor([[[3.0, -1.0]]], dtype=torch.float64)
    l1, l2 = torch.tensor([[0.5]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)
    o, lse = merge_attn_states_ref(o1, l1, o2, l2, torch.float64)
    w1, w2 = math.exp(0.5 - 2.0), 1.0
    assert torch.allclose(o, (w1 * o1 + w2 * o2) / (w1 + w2))
    assert abs(float(lse) - (2.0 + math.log(w1 + w2))) < 1e-6


def test_merge_errors_name_the_argument():
    o1, lse1, o2, lse2 = make_inputs(4, 2, 8, torch.float32, edges=False)
    with pytest.raises(ValueError, match="lse2.*float32"):
        merge_attn_states(o1, lse1, o2, lse2.double())
    with pytest.raises(ValueError, match=r"o2.*shape"):
        merge_attn_states(o1, lse1, o2[:3], lse2)
    with pytest.raises(ValueError, match="lse1.*shape"):
        merge_attn_states(o1, lse1.t().contiguous(), o2, lse2)
    with pytest.raises(ValueError, match="o2.*dtype"):
        merge_attn_states(o1, lse1, o2.half(), lse2)
    with pytest.raises(ValueError, match="out.*contiguous"):
        merge_attn_states(o1, lse1, o2, lse2, out=torch.empty(4, 8, 2).transpose(1, 2))
    # The C++ op checks too (TORCH_CHECK_VALUE -> ValueError).
    with pytest.raises(ValueError, match="suffix_lse"):
        _ext.ops().merge_attn_states(torch.empty_like(o1), None, o1, lse1, o2, lse2.double())
    with pytest.raises(ValueError, match="prefix_output.*stride"):
        _ext.ops().merge_attn_states(torch.empty_like(o1), None, o1.transpose(0, 2).contiguous().transpose(0, 2),
                                     lse1, o2, lse2)


def test_merge_fake_kernel_under_compile():
    """The op traces through torch.compile via its fake kernel."""
    o1, lse1, o2, lse2 = make_inputs(6, 2, 16, torch.float32, edges=False)

    def f(a, la, b, lb):
        out = torch.empty_like(a)
        out_lse = torch.empty_like(la)
        torch.ops.mla_ext.merge_attn_states(out, out_lse, a, la, b, lb)
        return out, out_lse

    out, out_lse = torch.compile(f, backend="eager", fullgraph=True)(o1, lse1, o2, lse2)
    ref_o, ref_lse = merge_attn_states_ref(o1, lse1, o2, lse2)
    assert torch.allclose(out, ref_o, atol=1e-5) and torch.allclose(out_lse, ref_lse, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(257, 16, 128), (33, 3, 72), (5, 2, 13)])  # vector and scalar paths
def test_merge_cuda(backend, dtype, shape):
    t, n, d = shape
    o1, lse1, o2, lse2 = make_inputs(t, n, d, dtype, device="cuda", seed=d)
    out, out_big, out_mask = guarded((t, n, d), dtype, "cuda")
    out_lse, lse_big, lse_mask = guarded((n, t), torch.float32, "cuda", pad=(1, 3))
    with MERGE.force(backend):
        merge_attn_states(o1, lse1, o2, lse2, out=out, out_lse=out_lse)
    torch.cuda.synchronize()
    check_against_ref(out, out_lse, o1, lse1, o2, lse2, dtype)
    assert (out_big[~out_mask] == GUARD).all()
    assert (lse_big[~lse_mask] == GUARD).all()
    # In place, and with different prefix/suffix head strides.
    p = torch.empty(t, n, d + 8, dtype=dtype, device="cuda")[:, :, :d]
    p.copy_(o1)
    la = lse1.clone()
    with MERGE.force(backend):
        merge_attn_states(p, la, o2, lse2, out=p, out_lse=la)
    check_against_ref(p, la, o1, lse1, o2, lse2, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_cpu_rounds_like_torch(dtype):
    """With equal LSEs the merge is (x1 + x2) / 2 rounded once from fp32, so the
    C++ kernel's hand-written 16-bit conversions must match torch's casts bit
    for bit, including subnormals, overflow to inf and ties."""
    g = torch.Generator().manual_seed(1)
    mags = torch.tensor([1e-7, 3e-6, 6e-5, 1e-3, 1.0, 300.0, 6.5e4, 1e30])
    x1 = (torch.randn(64, 2, 40, generator=g) * mags[torch.randint(0, 8, (64, 2, 40), generator=g)])
    x2 = (torch.randn(64, 2, 40, generator=g) * mags[torch.randint(0, 8, (64, 2, 40), generator=g)])
    o1, o2 = x1.to(dtype), x2.to(dtype)
    lse = torch.zeros(2, 64)
    want = (0.5 * o1.float() + 0.5 * o2.float()).to(dtype)
    with MERGE.force("cpu"):
        got, _ = merge_attn_states(o1, lse, o2, lse)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert same.all(), f"{(~same).sum()} elements differ, e.g. {got[~same][:4]} vs {want[~same][:4]}"


_MERGE_AOT = r"""
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from mla_ext.attention import triton_merge as tm
i32 = "i32"
names = ["num_rows", "num_heads", "head_size", "o_st", "o_sh", "p_st", "p_sh", "s_st", "s_sh",
         "ol_sh", "ol_st", "pl_sh", "pl_st", "sl_sh", "sl_st"]
for dt in ("bf16", "fp16", "fp32"):
    sig = dict(out_ptr=f"*{dt}", out_lse_ptr="*fp32", p_ptr=f"*{dt}", p_lse_ptr="*fp32", s_ptr=f"*{dt}", s_lse_ptr="*fp32")
    sig.update({n: i32 for n in names})
    for d in (128, 512):
        cfg = dict(HAS_OUT_LSE=True, BLOCK_R=4096 // d, BLOCK_D=d)
        s = dict(sig, **{k: "constexpr" for k in cfg})
        for cc in (86, 90):
            k = triton.compile(ASTSource(fn=tm._merge_kernel, signature=s, constexprs=cfg), target=GPUTarget("cuda", cc, 32))
            assert k.metadata.shared <= 99 * 1024
print("AOT-OK")
"""


def test_triton_merge_compiles_for_sm86_and_sm90():
    """Ahead-of-time compile (no GPU needed) for every dtype and both targets."""
    import os
    import subprocess
    import sys

    if not _HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _MERGE_AOT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stderr[-3000:]


def test_backend_report_rows_cover_every_backend():
    from mla_ext.attention import api

    rows = api.backend_report("cpu")
    assert {(op, b) for op, b, _ in rows} == {("attention", "triton"), ("attention", "torch"),
                                              ("attention", "flex_attention"),
                                              ("attention", "varlen_attn"),
                                              ("merge", "cuda"), ("merge", "cpu"),
                                              ("merge", "triton"), ("merge", "torch")}
    why = {(op, b): r for op, b, r in rows}
    assert why[("merge", "cpu")] == [] and why[("merge", "cuda")]
