"""Fuzz cases of the attention stage (SPEC §7): varlen_attention, merge_attn_states
(public API and the raw torch.ops.mla_ext.merge_attn_states), against
mla_ext.attention.reference in float64 within the SPEC §9 tolerances."""
from __future__ import annotations

import math

import torch

from fuzz_harness import QUICK, Call, add, report_rows_case
from helpers.numeric import assert_close_rel
from mla_ext.attention import api
from mla_ext.attention import reference as ref

F32, BF16 = torch.float32, torch.bfloat16
I32 = torch.int32
META = torch.device("meta")
INF = float("inf")

VARLEN = "mla_ext.attention.api:varlen_attention"
MERGE = "mla_ext.attention.api:merge_attn_states"
OP_MERGE = "torch.ops.mla_ext.merge_attn_states"
LSE_TOL = 1e-4  # natural-log LSE: relative Frobenius error against float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=I32)


# ---------------------------------------------------------------------------
# varlen_attention
# ---------------------------------------------------------------------------

def attn_setup(g, *, dtype=F32, N: int = 2, Dqk: int = 40, Dv: int = 24, q_lens=(5, 0, 7, 3),
               k_lens=(6, 3, 9, 0), seed: int = 3, q_kw=None, k_kw=None, causal: bool = True) -> dict:
    gen = _gen(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    return dict(
        q=g.put(torch.randn(tq, N, Dqk, generator=gen).to(dtype), "q", **(q_kw or {})),
        k=g.put(torch.randn(tk, N, Dqk, generator=gen).to(dtype), "k", **(k_kw or {})),
        v=g.put(torch.randn(tk, N, Dv, generator=gen).to(dtype), "v"),
        cu_seqlens_q=g.put(_cu(q_lens), "cu_seqlens_q"),
        cu_seqlens_k=g.put(_cu(k_lens), "cu_seqlens_k"),
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(k_lens, default=0),
        softmax_scale=0.17,
        causal=causal,
    )


def attn_call(a: dict, *, backend: str | None = None, check: bool = True) -> Call:
    want = None
    if check:
        c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        want = ref.varlen_attention_ref(c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"],
                                        c["softmax_scale"], c["causal"], compute_dtype=torch.float64,
                                        sinks=c.get("sinks"))

    def fn():
        with api.ATTENTION.force(backend):
            return api.varlen_attention(**a)

    def verify(result):
        o, lse = result
        assert o.dtype == a["q"].dtype and lse.dtype == F32, f"dtypes {o.dtype}, {lse.dtype}"
        assert_close_rel(o, want[0].to(o.dtype), "o")
        assert_close_rel(lse, want[1], "lse", LSE_TOL)
    return Call(fn, verify if check else None)


def _attn(name, expect, args=(), mutate=None, *, setup=None, backend=None, timeout=60.0):
    def build(g):
        a = attn_setup(g, **(setup or {}))
        if mutate is not None:
            mutate(g, a)
        return attn_call(a, backend=backend, check=expect != "reject")
    add(VARLEN, name, build, expect, args, timeout=timeout)


_attn("valid_fp32_causal", "accept")
_attn("valid_fp32_noncausal", "accept", setup=dict(causal=False))
_attn("valid_bf16", "accept", setup=dict(dtype=BF16))
_attn("valid_fp16", "accept", setup=dict(dtype=torch.float16, causal=False))
_attn("valid_torch_backend", "accept", backend="torch")
_attn("valid_mla_dims_192_128", "accept", setup=dict(Dqk=192, Dv=128, N=1, q_lens=(3, 2), k_lens=(4, 6)))
_attn("head_dim_above_256_falls_back", "accept", setup=dict(Dqk=264, Dv=8, N=1, q_lens=(2,), k_lens=(3,)))
_attn("padded_token_strides", "accept", setup=dict(q_kw=dict(pad=8, misalign=1), k_kw=dict(pad=3)))
_attn("q_longer_than_k_causal", "accept", setup=dict(q_lens=(6,), k_lens=(2,)))
_attn("zero_queries", "accept", setup=dict(q_lens=(0, 0), k_lens=(3, 1)))
_attn("zero_keys", "accept", setup=dict(q_lens=(3, 2), k_lens=(0, 0)))
_attn("no_requests", "accept", setup=dict(q_lens=(), k_lens=()))
_attn("rows_past_last_offset", "accept",
      mutate=lambda g, a: a.update(q=g.put(torch.randn(18, 2, 40), "q2")))
_attn("huge_max_seqlen", "either", ("max_seqlen_q",),
      lambda g, a: a.update(max_seqlen_q=2**31, max_seqlen_k=2**31), timeout=QUICK)
_attn("q_2d", "reject", ("q",), lambda g, a: a.update(q=a["q"][:, 0]))
_attn("q_not_a_tensor", "reject", ("q",), lambda g, a: a.update(q=[[0.0]]))
_attn("k_dtype_differs", "reject", ("k",), lambda g, a: a.update(k=a["k"].double()))
_attn("q_int", "reject", ("q",), lambda g, a: a.update(q=a["q"].int(), k=a["k"].int(), v=a["v"].int()))
_attn("k_heads_differ", "reject", ("k", "v"), lambda g, a: a.update(k=a["k"][:, :1]))
_attn("k_head_dim_differs", "reject", ("k",), lambda g, a: a.update(k=a["k"][..., :32]))
_attn("v_tokens_differ", "reject", ("v",), lambda g, a: a.update(v=a["v"][:10]))
_attn("q_head_dim_strided", "reject", ("q",),
      lambda g, a: a.update(q=g.put(a["q"], "q2", strides=(160, 80, 2))))
_attn("v_expanded_head_dim", "reject", ("v",), lambda g, a: a.update(v=a["v"][..., :1].expand(-1, -1, 24)))
_attn("k_expanded_tokens", "either", ("k",), lambda g, a: a.update(k=a["k"][:1].expand(18, -1, -1)))
_attn("cu_int64", "reject", ("cu_seqlens_q",), lambda g, a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()))
_attn("cu_2d", "reject", ("cu_seqlens_k",), lambda g, a: a.update(cu_seqlens_k=a["cu_seqlens_k"][None]))
_attn("cu_empty", "reject", ("cu_seqlens_q",), lambda g, a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:0]))
_attn("cu_count_differs", "reject", ("cu_seqlens_k", "cu_seqlens_q"),
      lambda g, a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:4]))
_attn("cu_strided", "reject", ("cu_seqlens_q",),
      lambda g, a: a.update(cu_seqlens_q=g.put(a["cu_seqlens_q"], "cu2", strides=(2,))))
_attn("cu_decreasing", "reject", ("cu_seqlens_q",),
      lambda g, a: a["cu_seqlens_q"].copy_(torch.tensor([0, 5, 3, 12, 15], dtype=I32)))
_attn("cu_negative_start", "reject", ("cu_seqlens_k",),
      lambda g, a: a["cu_seqlens_k"].copy_(torch.tensor([-1, 6, 9, 18, 18], dtype=I32)))
_attn("cu_past_rows", "reject", ("cu_seqlens_k",),
      lambda g, a: a["cu_seqlens_k"].copy_(torch.tensor([0, 6, 9, 18, 40], dtype=I32)))
_attn("cu_int32_max", "reject", ("cu_seqlens_q",),
      lambda g, a: a["cu_seqlens_q"].copy_(torch.tensor([0, 5, 5, 12, 2**31 - 1], dtype=I32)), timeout=QUICK)
_attn("max_seqlen_too_small", "reject", ("max_seqlen",), lambda g, a: a.update(max_seqlen_k=4))
for _label, _v in (("negative", -1), ("float", 7.0), ("bool", True), ("str", "7"), ("none", None)):
    _attn(f"max_seqlen_{_label}", "reject", ("max_seqlen_q",), lambda g, a, v=_v: a.update(max_seqlen_q=v))
for _label, _v in (("nan", math.nan), ("zero", 0.0), ("negative", -0.1), ("inf", INF), ("bool", True),
                   ("str", "0.1"), ("tensor", torch.tensor(0.1)), ("none", None)):
    _attn(f"softmax_scale_{_label}", "reject", ("softmax_scale",),
          lambda g, a, v=_v: a.update(softmax_scale=v))
for _label, _v in (("str_no", "no"), ("int_1", 1), ("none", None), ("tensor", torch.tensor(True))):
    _attn(f"causal_{_label}", "reject", ("causal",), lambda g, a, v=_v: a.update(causal=v))
_attn("return_lse_str", "reject", ("return_lse",), lambda g, a: a.update(return_lse="no"))
# Attention sinks (one logit per head joining every softmax; rows without keys: o = 0, lse = sink).
_attn("sinks_valid", "accept", mutate=lambda g, a: a.update(sinks=torch.tensor([0.5, -1.0])))
_attn("sinks_torch_backend", "accept", backend="torch",
      mutate=lambda g, a: a.update(sinks=torch.tensor([2.0, 0.0])))
_attn("sinks_bf16_q", "accept", setup=dict(dtype=BF16), mutate=lambda g, a: a.update(sinks=torch.tensor([1.0, 1.0])))
for _label, _v in (("wrong_heads", torch.zeros(3)), ("2d", torch.zeros(1, 2)), ("list", [0.0, 1.0]),
                   ("int", torch.zeros(2, dtype=torch.int32)), ("nan", torch.tensor([0.0, math.nan])),
                   ("inf", torch.tensor([INF, 0.0])), ("meta", torch.zeros(2, device="meta"))):
    _attn(f"sinks_{_label}", "reject", ("sinks",), lambda g, a, v=_v: a.update(sinks=v))
_attn("k_on_meta", "reject", ("k",), lambda g, a: a.update(k=a["k"].to(META)))
_attn("cu_on_meta", "reject", ("cu_seqlens_k",), lambda g, a: a.update(cu_seqlens_k=a["cu_seqlens_k"].to(META)))


def _no_lse(g):
    a = attn_setup(g)
    want = ref.varlen_attention_ref(*(a[k].clone() for k in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")),
                                    a["softmax_scale"], a["causal"], compute_dtype=torch.float64)[0]

    def check(o):
        assert isinstance(o, torch.Tensor), f"return_lse=False returned {type(o).__name__}, not the output"
        assert_close_rel(o, want.to(o.dtype), "o")
    return Call(lambda: api.varlen_attention(**a, return_lse=False), check)


add(VARLEN, "return_lse_false", _no_lse, "accept")


# ---------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------

def merge_setup(g, *, dtype=F32, T: int = 7, N: int = 3, D: int = 16, seed: int = 4, o_kw=None,
                lse_strides=None) -> dict:
    gen = _gen(seed)
    lse1 = torch.randn(N, T, generator=gen) * 3
    lse2 = torch.randn(N, T, generator=gen) * 3
    if T >= 4:
        lse1[0, 0], lse2[0, 0] = -INF, -INF  # both empty: o = 0, lse = -inf
        lse1[1 % N, 1] = -INF  # one side empty: the other side unchanged
        lse2[2 % N, 2] = INF  # +inf counts as -inf (SPEC §7)
        lse1[0, 3] = 80.0  # far apart: no overflow
    return dict(
        o1=g.put(torch.randn(T, N, D, generator=gen).to(dtype), "o1", **(o_kw or {})),
        lse1=g.put(lse1, "lse1", strides=lse_strides),
        o2=g.put(torch.randn(T, N, D, generator=gen).to(dtype), "o2"),
        lse2=g.put(lse2, "lse2"),
        out=g.put(torch.zeros(T, N, D, dtype=dtype), "out", writable=True),
        out_lse=g.put(torch.zeros(N, T), "out_lse", writable=True),
    )


def merge_reference(a: dict):
    c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    return ref.merge_attn_states_ref(c["o1"], c["lse1"], c["o2"], c["lse2"], compute_dtype=torch.float64)


def merge_call(a: dict, via: str, *, backend: str | None = None, check: bool = True) -> Call:
    want = merge_reference(a) if check else None
    if via == "op":
        def fn():
            torch.ops.mla_ext.merge_attn_states(a["out"], a["out_lse"], a["o1"], a["lse1"], a["o2"], a["lse2"])
            return a["out"], a["out_lse"]
    else:
        def fn():
            with api.MERGE.force(backend):
                return api.merge_attn_states(a["o1"], a["lse1"], a["o2"], a["lse2"], out=a["out"],
                                             out_lse=a["out_lse"])

    def verify(result):
        o, lse = result
        assert_close_rel(o, want[0].to(o.dtype), "out")
        if lse is not None:
            assert_close_rel(lse, want[1], "out_lse", LSE_TOL)
    return Call(fn, verify if check else None)


NAMES_OP = {"o1": "prefix_output", "lse1": "prefix_lse", "o2": "suffix_output", "lse2": "suffix_lse",
            "out": "output", "out_lse": "output_lse"}


def _merge_cases(entry: str, via: str) -> None:
    def M(name, expect, args=(), mutate=None, *, setup=None, backend=None, timeout=60.0):
        if via == "op":
            args = tuple(NAMES_OP.get(x, x) for x in args)

        def build(g):
            a = merge_setup(g, **(setup or {}))
            if mutate is not None:
                mutate(g, a)
            return merge_call(a, via, backend=backend, check=expect != "reject")
        add(entry, name, build, expect, args, timeout=timeout)

    M("valid_fp32", "accept")
    M("valid_bf16", "accept", setup=dict(dtype=BF16))
    M("valid_fp16", "accept", setup=dict(dtype=torch.float16))
    M("head_dim_1_one_head", "accept", setup=dict(N=1, D=1))
    M("padded_misaligned_strides", "accept", setup=dict(o_kw=dict(pad=4, misalign=1)))
    M("lse_transposed_layout", "accept", setup=dict(lse_strides=(1, 3)))
    M("zero_tokens", "accept", setup=dict(T=0))
    M("out_lse_none", "accept", mutate=lambda g, a: a.update(out_lse=None))
    def in_place(o: str, lse: str):
        def mutate(g, a):
            # The inputs that are also outputs live in writable guarded buffers.
            a[o] = g.put(a[o], f"{o}_out", writable=True)
            a[lse] = g.put(a[lse], f"{lse}_out", writable=True)
            a.update(out=a[o], out_lse=a[lse])
        return mutate
    M("in_place_on_o1", "accept", mutate=in_place("o1", "lse1"))
    M("in_place_on_o2", "accept", mutate=in_place("o2", "lse2"))
    M("in_place_crossed", "either", ("out", "out_lse"), in_place("o1", "lse2"))
    if via == "api":
        M("triton_backend", "accept", backend="triton", setup=dict(dtype=BF16))
        M("torch_backend", "accept", backend="torch")
        M("outputs_allocated", "accept", mutate=lambda g, a: a.update(out=None, out_lse=None))

    def shifted_out(g, a):
        buf = g.put(torch.randn(8, 3, 16), "o1_and_out", writable=True)
        a.update(o1=buf[:7], out=buf[1:])
    M("out_shifted_over_o1", "reject", ("out", "o1"), shifted_out)

    def shifted_lse(g, a):
        buf = g.put(torch.randn(3, 8), "lse2_and_out_lse", writable=True)
        a.update(lse2=buf[:, :7], out_lse=buf[:, 1:])
    M("out_lse_shifted_over_lse2", "reject", ("out_lse", "lse2"), shifted_lse)

    def lse_inside_out(g, a):
        a.update(out_lse=a["out"].view(-1)[:21].view(3, 7))
    M("out_lse_inside_out", "reject", ("out_lse", "out"), lse_inside_out)

    def out_over_lse1(g, a):
        buf = g.put(torch.randn(400), "lse1_and_out", writable=True)
        a.update(lse1=buf[:21].view(3, 7), out=buf[16:16 + 336].view(7, 3, 16))
    M("out_overlaps_lse1", "reject", ("out", "lse1"), out_over_lse1)
    M("out_expanded", "reject", ("out",), lambda g, a: a.update(out=a["out"][:1].expand(7, -1, -1)))
    M("out_lse_expanded", "reject", ("out_lse",), lambda g, a: a.update(out_lse=a["out_lse"][:, :1].expand(3, 7)))
    M("o2_dtype_differs", "reject", ("o2",), lambda g, a: a.update(o2=a["o2"].double()))
    M("o1_int", "reject", ("o1", "out"), lambda g, a: a.update(o1=a["o1"].int(), o2=a["o2"].int(),
                                                                out=a["out"].int()))
    M("lse1_fp16", "reject", ("lse1",), lambda g, a: a.update(lse1=a["lse1"].half()))
    M("lse1_token_major", "reject", ("lse1",), lambda g, a: a.update(lse1=a["lse1"].t().contiguous()))
    M("o1_2d", "reject", ("o1", "out"), lambda g, a: a.update(o1=a["o1"][:, 0]))
    M("out_wrong_shape", "reject", ("out",), lambda g, a: a.update(out=a["out"][:6]))
    M("o1_head_dim_strided", "reject", ("o1",),
      lambda g, a: a.update(o1=g.put(a["o1"], "o1s", strides=(96, 32, 2))))
    M("o2_on_meta", "reject", ("o2",), lambda g, a: a.update(o2=a["o2"].to(META)))
    M("out_lse_on_meta", "reject", ("out_lse",), lambda g, a: a.update(out_lse=a["out_lse"].to(META)))
    M("lse2_not_a_tensor", "reject", ("lse2",), lambda g, a: a.update(lse2=[[0.0] * 7] * 3))
    M("o1_none", "reject", ("o1",), lambda g, a: a.update(o1=None))


_merge_cases(MERGE, "api")
_merge_cases(OP_MERGE, "op")


add("mla_ext.attention.api:backend_report", "cpu", report_rows_case(api.backend_report, "cpu"), "accept")
add("mla_ext.attention.api:backend_report", "unknown_device", report_rows_case(api.backend_report, "tpu9"),
    "reject", ("device",))


# ---------------------------------------------------------------------------
# varlen_attention with split MLA keys (k = k_nope [Tk, N, P], k_rope shared or per head)
# ---------------------------------------------------------------------------

P_SPLIT = 32  # of Dqk = 40: R = 8


def split_call(a: dict, rope_heads: int | None, *, backend: str | None = None, check: bool = True,
               mutate=None, g=None, p_split: int = P_SPLIT) -> Call:
    """a's keys split into k_nope (a strided view of k) and k_rope [Tk, R] (rope_heads None)
    or [Tk, rope_heads, R]; the reference sees the assembled keys."""
    k = a["k"]
    tk, n, _ = k.shape
    rope = k[:, :1, p_split:] if rope_heads == 1 or rope_heads is None else k[:, :, p_split:]
    rope = g.put(rope.squeeze(1) if rope_heads is None else rope, "k_rope")
    kw = dict(a, k=k[..., :p_split], k_rope=rope)
    if mutate is not None:
        mutate(g, kw)
    want = None
    if check:
        heads = 1 if rope.dim() == 2 else rope.shape[1]
        keys = torch.cat([k[..., :p_split], rope.reshape(tk, heads, rope.shape[-1]).expand(tk, n, -1)], dim=-1)
        want = ref.varlen_attention_ref(a["q"].clone(), keys, a["v"].clone(), a["cu_seqlens_q"].clone(),
                                        a["cu_seqlens_k"].clone(), a["softmax_scale"], a["causal"],
                                        compute_dtype=torch.float64)

    def fn():
        with api.ATTENTION.force(backend):
            return api.varlen_attention(**kw)

    def verify(result):
        o, lse = result
        assert_close_rel(o, want[0].to(o.dtype), "o")
        assert_close_rel(lse, want[1], "lse", LSE_TOL)
    return Call(fn, verify if check else None)


def _split(name, expect="accept", args=(), *, rope_heads=None, backend=None, mutate=None, setup=None):
    def build(g):
        a = attn_setup(g, **(setup or {}))
        return split_call(a, rope_heads, backend=backend, check=expect != "reject", mutate=mutate, g=g)
    add(VARLEN, f"split_keys_{name}", build, expect, args)


_split("shared_rope")
_split("rope_one_head", rope_heads=1)
_split("rope_per_head", rope_heads=2)
_split("bf16_torch_backend", setup=dict(dtype=BF16), backend="torch")
_split("flex_attention_backend", backend="flex_attention")
_split("rope_dtype_differs", "reject", ("k_rope",), mutate=lambda g, kw: kw.update(k_rope=kw["k_rope"].double()))
_split("rope_tokens_differ", "reject", ("k_rope",), mutate=lambda g, kw: kw.update(k_rope=kw["k_rope"][:5]))
_split("rope_three_heads", "reject", ("k_rope",),
       mutate=lambda g, kw: kw.update(k_rope=kw["k_rope"][:, None].expand(-1, 3, -1)))
_split("dims_do_not_sum", "reject", ("k_rope", "k"),
       mutate=lambda g, kw: kw.update(k_rope=g.put(torch.zeros(18, 16), "k_rope16")))
_split("rope_head_dim_strided", "reject", ("k_rope",),
       mutate=lambda g, kw: kw.update(k_rope=g.put(kw["k_rope"], "k_rope_s", strides=(16, 2))))
_split("rope_4d", "reject", ("k_rope",), mutate=lambda g, kw: kw.update(k_rope=kw["k_rope"][None, :, None]))
_split("rope_list", "reject", ("k_rope",), mutate=lambda g, kw: kw.update(k_rope=[[0.0] * 8] * 18))
_split("rope_on_meta", "reject", ("k_rope",), mutate=lambda g, kw: kw.update(k_rope=kw["k_rope"].to(META)))
_split("scratch_garbage", "reject", ("scratch",), mutate=lambda g, kw: kw.update(scratch={"keys": None}))
