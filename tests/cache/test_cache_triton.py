"""The Triton gather (mla_ext.cache.triton_gather, the paged kernel) against
reference.gather_ref. Its ahead-of-time compile check is in test_cache_paged_gather.py.

Runs in the Triton interpreter on the CPU (conftest sets TRITON_INTERPRET) and
on a GPU when one is visible (`cuda` tests). Interpreter fp32 -> bf16/fp16
stores round toward zero, so 16-bit outputs are compared within one ulp there
and bit-exactly on a GPU; fp32 outputs are always bit-exact (SPEC §9: fp8
exact against the reference decode; fp8_ds_mla k_pe bit-exact).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_ext.cache import reference as ref
from mla_ext.cache import triton_gather as tg
from helpers.gather import make_batch, make_cache, poisoned_dst, strided_copy
from helpers.numeric import assert_same_bits, assert_within_one_ulp, same_bits

pytestmark = pytest.mark.skipif(tg.triton is None, reason="triton is not installed")

def _run_ref(cache, dst, bt, cu, n, fmt, ks, starts):
    if dst.dtype == cache.dtype:
        ref.cp_gather_ref(cache, dst, bt, cu, n, starts)
    else:
        ref.gather_ref(cache, dst, bt, cu, n, fmt, ks, starts)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, exact: bool):
    # Not exact: one ulp, the interpreter truncates where the reference rounds to nearest.
    (assert_same_bits if exact else assert_within_one_ulp)(got, want, "gathered rows")


def _check_case(device, fmt, model_dtype, dst_dtype, B, num_blocks, max_blocks, num_reqs,
                L, R, strided, bad_ids, seed, pad_cols=0, extra_rows=5):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache, ks = make_cache(fmt, num_blocks, B, L, R, model_dtype, strided=strided, gen=gen)
    bt, cu, starts = make_batch(rng, num_reqs, num_blocks, B, max_blocks, bad_ids=bad_ids)
    width = (L + R) if fmt != "fp8_ds_mla" or dst_dtype != torch.uint8 else cache.shape[2]
    T = int(cu[-1]) + extra_rows
    want, want_buf = poisoned_dst(T, width, dst_dtype, pad_cols=pad_cols)
    _run_ref(cache, want, bt, cu, num_reqs, fmt, ks, starts)

    got, got_buf = poisoned_dst(T, width, dst_dtype, pad_cols=pad_cols)
    if device != "cpu":
        got_buf = got_buf.to(device)
        got = got_buf[3: 3 + T, :width]
        cache = strided_copy(cache, device)
        bt, cu, starts, ks = (t.to(device) for t in (bt, cu, starts, ks))
    tg.gather_triton(cache, got, bt, cu, num_reqs, fmt, ks, starts)
    # Rows past cu[-1], the guard rows around dst and the padding columns stay poisoned.
    _assert_matches(got_buf.cpu(), want_buf, exact=device != "cpu")


def _dst_dtypes(fmt, model_dtype):
    if fmt in ("auto", "bfloat16", "float16"):
        return [model_dtype]
    return [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


FORMAT_CASES = [
    ("auto", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
    ("fp8", torch.bfloat16), ("fp8_e5m2", torch.bfloat16), ("fp8_ds_mla", torch.bfloat16),
]


def _draw_case(data, fmt, model_dtype):
    B = data.draw(st.sampled_from([1, 16, 64]), label="block_size")
    num_blocks = data.draw(st.integers(4, 24 if B == 1 else 6), label="num_blocks")
    max_blocks = data.draw(st.integers(1, 24 if B == 1 else 5), label="max_blocks")
    if fmt == "fp8_ds_mla":
        L, R = 512, data.draw(st.sampled_from([64, 0]), label="R")
    else:
        L, R = data.draw(st.sampled_from([(512, 64), (256, 64)]), label="L,R")
    return dict(
        fmt=fmt, model_dtype=model_dtype,
        dst_dtype=data.draw(st.sampled_from(_dst_dtypes(fmt, model_dtype)), label="dst"),
        B=B, num_blocks=num_blocks, max_blocks=max_blocks,
        num_reqs=data.draw(st.integers(1, 8), label="num_reqs"), L=L, R=R,
        strided=data.draw(st.booleans(), label="strided"),
        bad_ids=data.draw(st.booleans(), label="bad_ids"),
        pad_cols=data.draw(st.sampled_from([0, 8]), label="pad_cols"),
        seed=data.draw(st.integers(0, 2**31), label="seed"),
    )


@pytest.mark.parametrize("fmt,model_dtype", FORMAT_CASES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_gather_matches_reference(fmt, model_dtype, data):
    _check_case("cpu", **_draw_case(data, fmt, model_dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,model_dtype", FORMAT_CASES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_gather_matches_reference_cuda(fmt, model_dtype, data):
    _check_case("cuda", **_draw_case(data, fmt, model_dtype))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # NaN/inf lanes in numpy
@pytest.mark.parametrize("fp8_dtype,fmt", [(torch.float8_e4m3fn, "fp8"),
                                           (torch.float8_e5m2, "fp8_e5m2")])
def test_every_fp8_byte_decodes_exactly(fp8_dtype, fmt):
    """All 256 encodings (subnormals, max, NaN) against torch's fp8 decode."""
    cache = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 256)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    dst = torch.full((1, 256), -1.0)
    tg.gather_triton(cache, dst, bt, cu, 1, fmt, torch.tensor([1.0]))
    assert same_bits(dst[0], cache.reshape(256).view(fp8_dtype).float())
    # A cache typed as fp8 (not uint8) decodes the same, and gathers raw into fp8.
    dst.fill_(-1.0)
    tg.gather_triton(cache.view(fp8_dtype), dst, bt, cu, 1, fmt, torch.tensor([1.0]))
    assert same_bits(dst[0], cache.reshape(256).view(fp8_dtype).float())
    raw = torch.zeros(1, 256, dtype=fp8_dtype)
    tg.gather_triton(cache.view(fp8_dtype), raw, bt, cu, 1, fmt, None)
    assert torch.equal(raw.view(torch.uint8), cache[0])


def test_ds_mla_k_pe_and_scales_exact():
    """bf16 dst: k_pe bit-exact, kv_c = fp8 value x power-of-two scale, exactly."""
    gen = torch.Generator().manual_seed(3)
    cache, ks = make_cache("fp8_ds_mla", 3, 16, 512, 64, gen=gen)
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    cu = torch.tensor([0, 48], dtype=torch.int32)
    dst, _ = poisoned_dst(48, 576, torch.bfloat16)
    tg.gather_triton(cache, dst, bt, cu, 1, "fp8_ds_mla", ks)
    rows = cache[bt[0].long()].reshape(48, 656)
    kv_c, k_pe, _ = ref.decode_ds_mla_row(rows)
    assert same_bits(dst[:, 512:], k_pe)
    # A power-of-two multiple of an e4m3 value fits a bf16 exactly: no rounding even in
    # the interpreter.
    assert same_bits(dst[:, :512], kv_c.to(torch.bfloat16))


def test_out_of_range_rows_are_zero_and_no_op_cases():
    gen = torch.Generator().manual_seed(5)
    cache, ks = make_cache("fp8", 4, 16, 256, 64, gen=gen)
    bt = torch.tensor([[0, -1, 4], [2**31 - 1, 1, 3]], dtype=torch.int32)
    # request 0: token 10 (block 0) ok, tokens 16.. in block -1, 32.. block 4 (bad);
    # request 1: start past the table width (3 blocks x 16) -> zeros; negative start too.
    cu = torch.tensor([0, 40, 44], dtype=torch.int32)
    starts = torch.tensor([10, 60], dtype=torch.int32)
    dst, _ = poisoned_dst(44, 320, torch.float32)
    tg.gather_triton(cache, dst, bt, cu, 2, "fp8", ks, starts)
    want, _ = poisoned_dst(44, 320, torch.float32)
    ref.gather_ref(cache, want, bt, cu, 2, "fp8", ks, starts)
    assert same_bits(dst, want)
    assert (dst[6:] == 0).all() and (dst[:6] != 0).any()

    neg = torch.tensor([-5, 0], dtype=torch.int32)
    tg.gather_triton(cache, dst, bt, cu, 2, "fp8", ks, neg)
    assert (dst[:5] == 0).all()

    # Zero tokens (and zero requests) write nothing.
    before = dst.clone()
    tg.gather_triton(cache, dst, bt, torch.zeros(3, dtype=torch.int32), 2, "fp8", ks)
    tg.gather_triton(cache, dst, bt, cu, 0, "fp8", ks)
    assert same_bits(dst, before)


def test_empty_table_width_gives_zero_rows():
    cache, ks = make_cache("bfloat16", 2, 16, 256, 64)
    bt = torch.empty(1, 0, dtype=torch.int32)
    dst, _ = poisoned_dst(4, 320, torch.bfloat16)
    tg.gather_triton(cache, dst, bt, torch.tensor([0, 4], dtype=torch.int32), 1, "bfloat16", ks)
    assert (dst == 0).all()


def test_not_supported_reasons(monkeypatch):
    cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    assert tg.triton_not_supported_reasons(cache, torch.zeros(4, 576, dtype=torch.bfloat16),
                                           "bfloat16") == []
    why = tg.triton_not_supported_reasons(cache, torch.zeros(4, 576), "bfloat16")
    assert any("gathers only into" in w for w in why)
    assert any("unknown KV-cache format" in w
               for w in tg.triton_not_supported_reasons(cache, cache[0], "int4"))
    ds = torch.zeros(2, 16, 576, dtype=torch.uint8)
    assert any("656" in w for w in tg.triton_not_supported_reasons(
        ds, torch.zeros(4, 576), "fp8_ds_mla"))
    assert any("differs" in w for w in tg.triton_not_supported_reasons(
        ds, torch.zeros(4, 512), "fp8"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("not on CUDA" in w for w in tg.triton_not_supported_reasons(
        cache, torch.zeros(4, 576, dtype=torch.bfloat16), "bfloat16"))
    with pytest.raises(ValueError, match="gather_triton"):
        tg.gather_triton(cache, torch.zeros(4, 576), torch.zeros(1, 1, dtype=torch.int32),
                         torch.tensor([0, 4], dtype=torch.int32), 1, "bfloat16", None)


@pytest.mark.cuda
def test_cuda_graph_capture():
    """No host sync: the gather is capturable and replays with new block tables."""
    cache, ks = make_cache("fp8_ds_mla", 8, 64, 512, 64, device="cuda")
    bt = torch.randperm(8, dtype=torch.int32, device="cuda").reshape(2, 4)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    starts = torch.tensor([3, 17], dtype=torch.int32, device="cuda")
    dst = torch.empty(300, 576, dtype=torch.bfloat16, device="cuda")
    tg.gather_triton(cache, dst, bt, cu, 2, "fp8_ds_mla", ks, starts)  # compile first
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tg.gather_triton(cache, dst, bt, cu, 2, "fp8_ds_mla", ks, starts)
    bt.copy_(bt.flip(1))
    dst.fill_(float("nan"))
    g.replay()
    want = torch.empty(300, 576, dtype=torch.bfloat16)
    ref.gather_ref(cache.cpu(), want, bt.cpu(), cu.cpu(), 2, "fp8_ds_mla", ks.cpu(), starts.cpu())
    assert same_bits(dst.cpu(), want)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "bfloat16"])
def test_public_ops_through_the_triton_backend(fmt):
    """The dispatcher's "triton_paged" backend serves both public gathers (dequant and raw)."""
    from mla_ext.cache import api

    rng = random.Random(9)
    cache, ks = make_cache(fmt, 6, 16, 512, 64, gen=torch.Generator().manual_seed(9))
    bt, cu, starts = make_batch(rng, 3, 6, 16, 5, lens=[33, 0, 50])
    width = 576 if fmt == "fp8_ds_mla" else cache.shape[2]
    for dtype, raw in ((torch.bfloat16, False), (cache.dtype, True)):
        if raw and fmt == "fp8_ds_mla":
            width = cache.shape[2]
        want, _ = poisoned_dst(83, width, dtype)
        got, _ = poisoned_dst(83, width, dtype)
        _run_ref(cache, want, bt, cu, 3, fmt, ks, starts)
        with api.GATHER.force("triton_paged"):
            if raw:
                api.cp_gather_cache(cache, got, bt, cu, 3, starts)
            else:
                api.gather_and_maybe_dequant_cache(cache, got, bt, cu, 3, fmt, ks, starts)
        _assert_matches(got, want, exact=False)


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_ds_mla_cache_at_any_byte_offset(offset):
    """Rows at 4-byte multiples use the fp32/bf16 views; odd offsets the byte path. Same result."""
    cache, ks = make_cache("fp8_ds_mla", 4, 16, 512, 64, gen=torch.Generator().manual_seed(1))
    buf = torch.full((cache.numel() + offset,), 0x5A, dtype=torch.uint8)
    buf[offset:] = cache.reshape(-1)
    shifted = buf[offset:].view(cache.shape)
    bt = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 61], dtype=torch.int32)
    starts = torch.tensor([2], dtype=torch.int32)
    want, _ = poisoned_dst(61, 576, torch.float32)
    ref.gather_ref(cache, want, bt, cu, 1, "fp8_ds_mla", ks, starts)
    got, _ = poisoned_dst(61, 576, torch.float32)
    tg.gather_triton(shifted, got, bt, cu, 1, "fp8_ds_mla", ks, starts)
    assert same_bits(got, want)
