"""Hypothesis properties, one per op: valid random inputs (formats, shapes,
strides, misaligned pointers, out-of-range ids where the result is defined)
match the stage's reference within SPEC §9, with every tensor inside guard
bytes. Each example runs in its own forked child (tests/fuzz/fuzz_harness.py),
so a crash or a hang is reported as such and shrunk like any failure.

Example counts are small (CI runs the whole fuzz suite in a few minutes);
HYPOTHESIS_PROFILE=explore draws fresh examples locally.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fuzz_cases_attention as fa
import fuzz_cases_cache as fc
import fuzz_cases_kv_b_proj as fk
import fuzz_cases_host as fh
from fuzz_harness import Call, run_one
from mla_ext.compat import cpu_rowwise_scaled_mm_reasons
from mla_ext.config.formats import ScaleKind, get_format
from mla_ext.prefill import chunking

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BF16 = torch.bfloat16


def ok(build, timeout: float = 60.0) -> None:
    result = run_one(build, timeout)
    assert result.ok, result.line()


layouts = st.fixed_dictionaries({"pad": st.sampled_from([0, 0, 3, 16]), "misalign": st.sampled_from([0, 0, 1])})


@st.composite
def gather_params(draw, raw: bool):
    fmt = draw(st.sampled_from(fc.FORMAT_NAMES))
    B = draw(st.sampled_from([1, 16, 64]))
    n = draw(st.integers(0, 4))
    lens = draw(st.lists(st.sampled_from([0, 1, 7, 16, 33, 70]), min_size=n, max_size=n))
    starts = [draw(st.integers(0, 40)) for _ in lens]
    width = max([-(-(s + k) // B) for s, k in zip(starts, lens)] + [1]) + draw(st.integers(0, 2))
    f = get_format(fmt)
    dst_dtype = None
    if not raw and f.is_quantized:
        dst_dtype = draw(st.sampled_from([BF16, torch.float16, torch.float32, torch.uint8]))
    return dict(fmt=fmt, B=B, lens=tuple(lens), starts=tuple(starts), width=width,
                num_blocks=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2**16)), dst_dtype=dst_dtype,
                cache_kw=draw(layouts), dst_kw=draw(layouts), bad=draw(st.integers(0, 3)),
                extra_rows=draw(st.integers(0, 3)))


def gather_build(p: dict, raw: bool, via: str):
    def build(g):
        a = fc.gather_setup(g, p["fmt"], raw=raw, lens=p["lens"] or (0,), starts=p["starts"] or (0,),
                            num_blocks=p["num_blocks"], B=p["B"], width=p["width"], seed=p["seed"],
                            dst_dtype=p["dst_dtype"], cache_kw=p["cache_kw"], dst_kw=p["dst_kw"],
                            extra_rows=p["extra_rows"])
        bt = a["block_table"]
        gen = torch.Generator().manual_seed(p["seed"])
        for _ in range(p["bad"]):  # out-of-range ids: zero rows (SPEC §6), defined by the reference
            r, c = (int(torch.randint(0, n, (1,), generator=gen)) for n in bt.shape)
            bt[r, c] = [-1, p["num_blocks"], 2**31 - 1][int(torch.randint(0, 3, (1,), generator=gen))]
        return fc.gather_call(a, via, raw=raw)
    return build


@pytest.mark.parametrize("via", ["api", "op"])
@given(p=gather_params(raw=False))
@SETTINGS
def test_gather_matches_reference(via, p):
    ok(gather_build(p, False, via))


@pytest.mark.parametrize("via", ["api", "op"])
@given(p=gather_params(raw=True))
@SETTINGS
def test_cp_gather_matches_reference(via, p):
    ok(gather_build(p, True, via))


@given(p=gather_params(raw=False))
@FEW
def test_triton_gather_matches_reference(p):
    ok(gather_build(p, False, "triton"))


@st.composite
def write_params(draw):
    fmt = draw(st.sampled_from(fc.FORMAT_NAMES))
    f = get_format(fmt)
    own_layout = f.is_quantized and f.scale_kind != ScaleKind.PER_TENSOR
    Lw, Rw = (512, draw(st.sampled_from([64, 0]))) if own_layout else (draw(st.integers(1, 40)),
                                                                       draw(st.integers(0, 9)))
    return dict(fmt=fmt, T=draw(st.integers(0, 20)), num_blocks=draw(st.integers(1, 4)),
                B=draw(st.sampled_from([1, 5, 16])), Lw=Lw, Rw=Rw,
                in_dtype=draw(st.sampled_from([BF16, torch.float16, torch.float32])), seed=draw(st.integers(0, 999)),
                cache_kw=draw(layouts), kv_kw=draw(layouts), scale=draw(st.sampled_from([1.0, 0.0137, 3.5])))


@pytest.mark.parametrize("via", ["api", "op"])
@given(p=write_params())
@SETTINGS
def test_write_matches_reference(via, p):
    assume(get_format(p["fmt"]).supports_dims(p["Lw"], p["Rw"]))

    def build(g):
        a = fc.write_setup(g, p["fmt"], T=min(p["T"], p["num_blocks"] * p["B"]), num_blocks=p["num_blocks"],
                           B=p["B"], in_dtype=p["in_dtype"], seed=p["seed"], Lw=p["Lw"], Rw=p["Rw"],
                           cache_kw=p["cache_kw"], kv_kw=p["kv_kw"])
        a["k_scale"].fill_(p["scale"])
        return fc.write_call(a, via)
    ok(build)


@pytest.mark.parametrize("via", ["api", "op"])
@given(fmt=st.sampled_from([f for f in fc.FORMAT_NAMES if get_format(f).is_quantized]), T=st.integers(0, 30),
       dtype=st.sampled_from([BF16, torch.float16, torch.float32]), seed=st.integers(0, 999),
       magnitude=st.sampled_from([1e-6, 1.0, 300.0]), kv_kw=layouts)
@SETTINGS
def test_kv_scale_matches_reference(via, fmt, T, dtype, seed, magnitude, kv_kw):
    def build(g):
        a = fc.kv_scale_setup(g, T=T, dtype=dtype, seed=seed, kv_kw=kv_kw)
        a["kv_c"].mul_(magnitude)
        return fc.kv_scale_call(a, fmt, via)
    ok(build)


@given(dtype=st.sampled_from([torch.float32, BF16, torch.float16]), N=st.integers(1, 3),
       Dqk=st.sampled_from([8, 40, 96]), Dv=st.sampled_from([8, 24]),
       lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 12)), min_size=0, max_size=3),
       causal=st.booleans(), backend=st.sampled_from([None, None, "torch", "flex_attention"]),
       seed=st.integers(0, 999), q_kw=layouts, split=st.sampled_from([False, None, 1, "per_head"]))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_varlen_attention_matches_reference(dtype, N, Dqk, Dv, lens, causal, backend, seed, q_kw, split):
    """split: whole keys (False), or k_nope plus k_rope shared [Tk, R] (None), [Tk, 1, R] or per head."""
    assume(split is False or Dqk > 8)  # split keys: P = Dqk - 8 > 0

    def build(g):
        a = fa.attn_setup(g, dtype=dtype, N=N, Dqk=Dqk, Dv=Dv, q_lens=tuple(q for q, _ in lens),
                          k_lens=tuple(k for _, k in lens), seed=seed, q_kw=q_kw, causal=causal)
        if split is False:
            return fa.attn_call(a, backend=backend)
        return fa.split_call(a, N if split == "per_head" else split, backend=backend, g=g, p_split=Dqk - 8)
    ok(build)


@pytest.mark.parametrize("via", ["api", "op"])
@given(dtype=st.sampled_from([torch.float32, BF16, torch.float16]), T=st.integers(0, 9), N=st.integers(1, 4),
       D=st.sampled_from([1, 8, 40]), seed=st.integers(0, 999), in_place=st.sampled_from([None, "o1", "o2"]),
       backend=st.sampled_from([None, None, "triton", "torch"]), o_kw=layouts)
@SETTINGS
def test_merge_matches_reference(via, dtype, T, N, D, seed, in_place, backend, o_kw):
    def build(g):
        a = fa.merge_setup(g, dtype=dtype, T=T, N=N, D=D, seed=seed, o_kw=o_kw)
        if in_place is not None:
            side = "1" if in_place == "o1" else "2"
            a[f"o{side}"] = g.put(a[f"o{side}"], f"o{side}_out", writable=True)
            a[f"lse{side}"] = g.put(a[f"lse{side}"], f"lse{side}_out", writable=True)
            a.update(out=a[f"o{side}"], out_lse=a[f"lse{side}"])
        return fa.merge_call(a, via, backend=backend if via == "api" else None)
    ok(build)


BACKENDS = {"marlin_fp8": "marlin_w8a16", "marlin_fp8_g128": "marlin_w8a16", "nvfp4": "triton_w4a16",
            "fp8_block": "triton_fp8_block", "fp8_per_tensor": "scaled_mm_fp8"}
if cpu_rowwise_scaled_mm_reasons():  # torch 2.11: CPU _scaled_mm is per-tensor only, scaled_mm_fp8 says so
    del BACKENDS["fp8_per_tensor"]   # (test_kv_b_proj_linear checks that refusal and the fallback)


@given(kind=st.sampled_from(fk.KINDS), m=st.integers(0, 40), forced=st.booleans(), x_kw=layouts)
@SETTINGS
def test_kv_b_proj_matches_reference(kind, m, forced, x_kw):
    backend = BACKENDS.get(kind) if forced else None
    ok(fk.forward_case(kind, m=m, backend=backend, x_kw=x_kw))


@given(n=st.integers(1, 200), k16=st.integers(1, 12), grouped=st.booleans(), m=st.integers(0, 20),
       act=st.sampled_from([BF16, torch.float16]), seed=st.integers(0, 999), a_kw=layouts)
@SETTINGS
def test_marlin_ops_match_reference(n, k16, grouped, m, act, seed, a_kw):
    k = 128 * (1 + k16 // 4) if grouped else 16 * k16
    group = 128 if grouped else -1

    def build(g):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / 8
        src, want = fk.fp8_source("block" if grouped else "channel", w)
        scales = (src.weight_scale_inv.repeat_interleave(128, 0)[:n].t().contiguous() if grouped
                  else src.channel_scales())
        w8, s = g.put(src.weight, "w_fp8"), g.put(scales, "scales")
        x = g.put(torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(act), "a", **a_kw)
        ops = torch.ops.mla_ext

        def fn():
            qweight, packed = ops.marlin_fp8_repack(w8, s, group, act)
            return ops.marlin_fp8_dequantize(qweight, packed, n, k, group, act), \
                ops.marlin_fp8_gemm(x, qweight, packed, n, k, group, act, torch.float32)

        def check(res):
            deq, y = res
            fk.assert_dequant(deq, want, True, "marlin_fp8_dequantize")
            fk.assert_linear(y, x, want, dense=False, what="marlin_fp8_gemm")
        return Call(fn, check)
    ok(build)


@given(ctx=st.lists(st.sampled_from([0, 1, 15, 16, 17, 64, 100, 1000, 60000]), max_size=12),
       data=st.data(), A=st.sampled_from([1, 16, 64]), mult=st.integers(1, 20))
@SETTINGS
def test_chunk_plan_invariants(ctx, data, A, mult):
    qlens = data.draw(st.lists(st.integers(0, 5), min_size=len(ctx), max_size=len(ctx)))
    W = A * mult

    def build(g):
        return Call(lambda: chunking.plan_context_chunks(ctx, qlens, W, A), fh.check_plan(ctx, qlens, W, A))
    ok(build)


@given(fmt=st.sampled_from(fh.LAYER_FORMATS),
       reqs=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 3)), min_size=1, max_size=3),
       ws=st.sampled_from([16, 32, 256]), seed=st.integers(0, 99),
       path=st.sampled_from(["auto", "absorbed", "up_project"]))
@FEW
def test_mla_prefill_matches_oracle(fmt, reqs, ws, seed, path):
    def build(g):
        a = fh.prefill_setup(g, fmt, ctx=tuple(c for c, _ in reqs), qlens=tuple(q for _, q in reqs), seed=seed,
                             layer_kw=dict(workspace_rows_override=ws, context_attention=path))
        return fh.prefill_call(a)
    ok(build, timeout=120.0)


def test_guard_bytes_catch_an_out_of_bounds_write():
    """The harness itself: a write one element past a tensor, a write into a
    read-only input and a segfault are each reported, not missed."""
    def oob(g):
        x = g.put(torch.zeros(4, 8), "x", writable=True)
        return Call(lambda: x.as_strided((1,), (1,), x.storage_offset() + 32).fill_(1.0))

    def into_input(g):
        x = g.put(torch.zeros(4, 8), "x")
        return Call(lambda: x.add_(1.0))

    def segfault(g):
        import ctypes
        return Call(lambda: ctypes.string_at(0))

    def hang(g):
        return Call(lambda: [math.factorial(10) for _ in iter(int, 1)])

    assert run_one(oob).outcome == "WRONG" and "outside its elements" in run_one(oob).detail
    assert run_one(into_input).outcome == "WRONG"
    assert run_one(segfault).outcome == "CRASH"
    assert run_one(hang, timeout=2.0).outcome == "HANG"
