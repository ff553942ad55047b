"""varlen_attention with LSE for MLA shapes against the fp64 reference.

The reference itself is checked against torch SDPA per request. The Triton
kernel runs under TRITON_INTERPRET=1 on the CPU here (small shapes, big
tiles); outputs are NaN-poisoned first so an unwritten row fails.
"""
import math

import pytest

pytest.importorskip("triton")  # a CPU-only torch install need not have triton
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from mla_ext.attention import ATTENTION, varlen_attention
from mla_ext.attention.reference import varlen_attention_ref
from mla_ext.attention.triton_attention import varlen_attention_triton
from helpers.numeric import rel_fro
from test_attention_backends import TOL, cu  # noqa: F401 (shared helpers)


def make_qkv(q_lens, k_lens, n, dqk, dv, dtype, device="cpu", seed=0, strided=False):
    """Random q/k/v; with strided=True, k and v are views laid out the way the
    MLA path builds them (v a slice of the kv_b_proj output, k a concat)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    q = torch.randn(tq, n, dqk, generator=g).to(dtype).to(device)
    if strided:
        kv = torch.randn(tk, n, (dqk - 16) + dv, generator=g).to(dtype).to(device)  # [k_nope | v]
        k_pe = torch.randn(tk, 1, 16, generator=g).to(dtype).to(device)
        k = torch.cat([kv[..., : dqk - 16], k_pe.expand(tk, n, 16)], dim=-1)
        v = kv[..., dqk - 16 :]
        assert not v.is_contiguous()
    else:
        k = torch.randn(tk, n, dqk, generator=g).to(dtype).to(device)
        v = torch.randn(tk, n, dv, generator=g).to(dtype).to(device)
    return q, k, v


def check(o, lse, ref_o, ref_lse, dtype):
    o, lse = o.cpu(), lse.cpu()
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin].float(), atol=2e-3 if dtype != torch.float32 else 1e-4)
    assert (o.transpose(0, 1)[~fin] == 0).all(), "rows with no key must be 0"
    assert rel_fro(o, ref_o) <= TOL[dtype]


def test_reference_matches_sdpa():
    q_lens, k_lens = [5, 3, 9], [7, 3, 12]
    n, dqk, dv, scale = 3, 24, 16, 0.37
    q, k, v = make_qkv(q_lens, k_lens, n, dqk, dv, torch.float64, seed=1)
    for causal in (False, True):
        o, lse = varlen_attention_ref(q, k, v, cu(q_lens), cu(k_lens), scale, causal, torch.float64)
        cq, ck = cu(q_lens).tolist(), cu(k_lens).tolist()
        for b in range(3):
            qb = q[cq[b] : cq[b + 1]].transpose(0, 1)
            kb = k[ck[b] : ck[b + 1]].transpose(0, 1)
            vb = v[ck[b] : ck[b + 1]].transpose(0, 1)
            ql, kl = qb.shape[1], kb.shape[1]
            mask = None
            if causal:  # bottom-right: i sees j <= i + kl - ql
                mask = torch.ones(ql, kl, dtype=torch.bool).tril(kl - ql)
            want = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
            assert torch.allclose(o[cq[b] : cq[b + 1]].transpose(0, 1), want, atol=1e-10)
            s = (qb @ kb.transpose(1, 2)) * scale
            if causal:
                s = s.masked_fill(~mask, -math.inf)
            assert torch.allclose(lse[:, cq[b] : cq[b + 1]].double(), torch.logsumexp(s, -1), atol=1e-6)


# (q_lens, k_lens, causal): empty requests, k_len 0, causal with k_len > q_len
# (bottom-right) and k_len < q_len (leading rows see no key).
CASES = [
    ([17, 0, 70, 3], [40, 5, 70, 0], False),
    ([17, 70, 3], [17, 70, 3], True),
    ([5, 33], [20, 90], True),
    ([12, 4], [5, 0], True),
]


@pytest.mark.parametrize("dims", [(192, 128), (256, 256), (40, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_matches_reference(dims, dtype, case):
    q_lens, k_lens, causal = CASES[case]
    dqk, dv = dims
    n = 2
    q, k, v = make_qkv(q_lens, k_lens, n, dqk, dv, dtype, seed=case * 7 + dqk, strided=(case % 2 == 1))
    scale = 1.0 / math.sqrt(dqk)
    cq, ck = cu(q_lens), cu(k_lens)
    out = torch.full((q.shape[0], n, dv), float("nan"), dtype=dtype)
    lse = torch.full((n, q.shape[0]), float("nan"))
    varlen_attention_triton(q, k, v, cq, ck, max(q_lens), scale, causal, out, lse)
    ref_o, ref_lse = varlen_attention_ref(q, k, v, cq, ck, scale, causal, torch.float64)
    check(out, lse, ref_o, ref_lse, dtype)


@settings(max_examples=15, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=4),
    dims=st.sampled_from([(192, 128), (24, 40), (8, 8), (100, 60)]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_property_in_guarded_views(lens, dims, causal, seed):
    """Random request lengths (incl. empty) and head dims; o and lse are views
    inside GUARD-filled buffers that must stay untouched outside them."""
    q_lens, k_lens = [a for a, _ in lens], [b for _, b in lens]
    dqk, dv = dims
    n = 2
    q, k, v = make_qkv(q_lens, k_lens, n, dqk, dv, torch.float32, seed=seed)
    tq = q.shape[0]
    big_o = torch.full((tq + 2, n, dv + 9), 1234.5)
    out = big_o[1 : tq + 1, :, 4 : 4 + dv]
    out.fill_(float("nan"))
    big_l = torch.full((n + 2, tq + 5), 1234.5)
    lse = big_l[1 : n + 1, 2 : 2 + tq]
    lse.fill_(float("nan"))
    cq, ck = cu(q_lens), cu(k_lens)
    varlen_attention_triton(q, k, v, cq, ck, max(q_lens), 0.2, causal, out, lse)
    ref_o, ref_lse = varlen_attention_ref(q, k, v, cq, ck, 0.2, causal, torch.float64)
    if tq:
        check(out, lse, ref_o, ref_lse, torch.float32)
    keep_o = torch.ones_like(big_o, dtype=torch.bool)
    keep_o[1 : tq + 1, :, 4 : 4 + dv] = False
    keep_l = torch.ones_like(big_l, dtype=torch.bool)
    keep_l[1 : n + 1, 2 : 2 + tq] = False
    assert (big_o[keep_o] == 1234.5).all() and (big_l[keep_l] == 1234.5).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_api_dispatch_and_return_lse(backend):
    q_lens, k_lens = [9, 30], [9, 30]
    q, k, v = make_qkv(q_lens, k_lens, 2, 48, 32, torch.float16, seed=5)
    with ATTENTION.force(backend):
        o, lse = varlen_attention(q, k, v, cu(q_lens), cu(k_lens), 30, 30, 0.2, causal=True)
        only_o = varlen_attention(q, k, v, cu(q_lens), cu(k_lens), 30, 30, 0.2, causal=True, return_lse=False)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32 and lse.shape == (2, 39)
    assert torch.equal(o, only_o)
    ref_o, ref_lse = varlen_attention_ref(q, k, v, cu(q_lens), cu(k_lens), 0.2, True, torch.float64)
    check(o, lse, ref_o, ref_lse, torch.float16)


def test_rows_past_the_last_request_are_empty():
    q, k, v = make_qkv([6], [6], 2, 16, 16, torch.float32)
    q = torch.cat([q, torch.randn(3, 2, 16)])  # 3 trailing rows owned by no request
    o, lse = varlen_attention(q, k, v, cu([6]), cu([6]), 6, 6, 0.25, causal=False)
    assert (o[6:] == 0).all() and torch.isneginf(lse[:, 6:]).all()


def test_chunked_keys_merge_to_full_attention():
    """SPEC §1: attention over a split key set, merged, equals attention over all keys."""
    from mla_ext.attention import merge_attn_states

    q_lens, k_lens = [7, 11], [50, 23]
    q, k, v = make_qkv(q_lens, k_lens, 2, 40, 24, torch.float32, seed=9)
    full_o, full_lse = varlen_attention(q, k, v, cu(q_lens), cu(k_lens), 11, 50, 0.3, causal=False)
    # split request 0 at 32 keys, request 1 at 16
    idx1 = list(range(0, 32)) + list(range(50, 66))
    idx2 = list(range(32, 50)) + list(range(66, 73))
    o1, l1 = varlen_attention(q, k[idx1], v[idx1], cu(q_lens), cu([32, 16]), 11, 32, 0.3, causal=False)
    o2, l2 = varlen_attention(q, k[idx2], v[idx2], cu(q_lens), cu([18, 7]), 11, 18, 0.3, causal=False)
    o, lse = merge_attn_states(o1, l1, o2, l2)
    assert rel_fro(o, full_o) < 1e-5 and torch.allclose(lse, full_lse, atol=1e-5)


def test_attention_errors_name_the_argument():
    q, k, v = make_qkv([4], [4], 2, 16, 8, torch.float32)
    c = cu([4])
    with pytest.raises(ValueError, match="cu_seqlens_q.*int32"):
        varlen_attention(q, k, v, c.long(), c, 4, 4, 0.1, False)
    with pytest.raises(ValueError, match="k: expected head dim 16"):
        varlen_attention(q, k[..., :8], v, c, c, 4, 4, 0.1, False)
    with pytest.raises(ValueError, match="v: expected dtype"):
        varlen_attention(q, k, v.half(), c, c, 4, 4, 0.1, False)
    with pytest.raises(ValueError, match="softmax_scale"):
        varlen_attention(q, k, v, c, c, 4, 4, float("nan"), False)
    with pytest.raises(ValueError, match="cu_seqlens_k: last offset 9 exceeds"):
        varlen_attention(q, k, v, c, cu([9]), 4, 9, 0.1, False)
    with pytest.raises(ValueError, match="max_seqlen"):
        varlen_attention(q, k, v, c, c, 2, 4, 0.1, False)
    with pytest.raises(ValueError, match="q: the head dim must be contiguous"):
        varlen_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, c, c, 4, 4, 0.1, False)


@pytest.mark.cuda
@pytest.mark.parametrize("dims", [(192, 128), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_cuda(dims, dtype, case):
    q_lens, k_lens, causal = CASES[case]
    q_lens = [x * 9 for x in q_lens]
    k_lens = [x * 9 for x in k_lens]
    dqk, dv = dims
    q, k, v = make_qkv(q_lens, k_lens, 4, dqk, dv, dtype, device="cuda", seed=case, strided=True)
    cq, ck = cu(q_lens, "cuda"), cu(k_lens, "cuda")
    out = torch.full((q.shape[0], 4, dv), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((4, q.shape[0]), float("nan"), device="cuda")
    varlen_attention_triton(q, k, v, cq, ck, max(q_lens), 0.1, causal, out, lse)
    ref_o, ref_lse = varlen_attention_ref(q.cpu(), k.cpu(), v.cpu(), cq.cpu(), ck.cpu(), 0.1, causal, torch.float64)
    check(out, lse, ref_o, ref_lse, dtype)


_AOT_SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mla_ext.attention.triton_attention import _attn_fwd_kernel, _launch_config, _pad, qk_segments
for dt, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    sig = {"q_ptr": f"*{dt}", "k1_ptr": f"*{dt}", "k2_ptr": f"*{dt}", "v_ptr": f"*{dt}", "o_ptr": f"*{dt}",
           "lse_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "qk_scale_log2": "fp32"}
    for n in ["q_st", "q_sh", "k1_st", "k1_sh", "k2_st", "k2_sh", "v_st", "v_sh", "o_st", "o_sh", "lse_sh"]:
        sig[n] = "i64"
    sig["D1"] = sig["D2"] = sig["DV"] = "i32"
    # MLA (192 = 128 + 64 split, one key tensor or k_nope/k_rope), 256 whole, V 256.
    for dqk, dv in ((192, 128), (256, 128), (256, 256)):
        _, b1, _, b2 = qk_segments(dqk)
        bv = _pad(dv)
        bm, bn, warps, stages = _launch_config(b1 + b2, bv, tdt)
        const = dict(CAUSAL=True, LOWP_DOT=dt != "fp32", IEEE_FP32=dt == "fp32", BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_D1=b1, BLOCK_D2=b2, BLOCK_DV=bv)
        s = dict(sig, **{k: "constexpr" for k in const})
        for cc in (86, 90):
            k = triton.compile(ASTSource(fn=_attn_fwd_kernel, signature=s, constexprs=const),
                               target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
            assert k.metadata.shared <= 99 * 1024, (dt, dqk, dv, cc, k.metadata.shared)
print("AOT-OK")
"""


def test_triton_attention_compiles_for_sm86_and_sm90_within_shared_memory():
    """The GPU code path (16-bit tl.dot operands, launch config) compiles ahead
    of time for both build targets and each config fits sm_86's 99 KB of
    shared memory, so it launches on either GPU. Runs without a GPU, in a
    subprocess because this one has TRITON_INTERPRET set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("over, match", [
    (dict(max_seqlen_q=True), "max_seqlen_q: expected an int"),
    (dict(max_seqlen_q=4.7), "max_seqlen_q: expected an int"),
    (dict(max_seqlen_k=None), "max_seqlen_k: expected an int"),
    (dict(max_seqlen_k=-1), "max_seqlen_k: expected an int >= 0"),
    (dict(causal="no"), "causal: expected a bool"),
    (dict(causal=1), "causal: expected a bool"),
    (dict(softmax_scale="0.1"), "softmax_scale: expected a finite positive number"),
    (dict(softmax_scale=True), "softmax_scale: expected a finite positive number"),
])
def test_attention_scalar_arguments_are_checked(over, match):
    """Scalars are not coerced: 4.7 rows, causal="no" (truthy) or None would be silent wrong results."""
    q, k, v = make_qkv([4], [4], 2, 16, 8, torch.float32)
    args = dict(max_seqlen_q=4, max_seqlen_k=4, softmax_scale=0.1, causal=False)
    args.update(over)
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, k, v, cu([4]), cu([4]), **args)
