"""The vLLM 0.33 op surface (mla_ext.vllm._custom_ops).

1. Signatures: every op has vLLM 0.33's name, argument order, keyword names,
   defaults and in-place outputs (the torch schema says so).
2. Each op against the stage references (mla_ext/cache/reference.py,
   mla_ext/attention/reference.py) and the native API, on the C++ CPU kernels
   and, forced, on the Triton kernels (interpreter here, GPU in `cuda` runs).
3. Every refusal, eagerly and in the fake kernels, names its argument.
4. torch.library.opcheck for each op; torch.compile(fullgraph=True) traces a
   function that calls them all.
5. Parity: vLLM's chunked-context MLA prefill, written as vLLM writes it
   (its chunk metadata, its calls with its keyword names or positionally in
   its order, merge across chunks and with the suffix), run through the
   surface, against mla_ext's MLAPrefill and the one-shot oracle on the same
   random inputs, for every cache format (and vLLM's FP8-prefill raw gather);
   outputs and workspaces are poisoned so an unwritten row shows.
"""
from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
import torch.nn.functional as F

import mla_ext.vllm
from mla_ext import _ext
from mla_ext.attention import api as attn_api
from mla_ext.attention import reference as attn_ref
from mla_ext.cache import api as cache_api
from mla_ext.cache import reference as cache_ref
from mla_ext.config.formats import get_format
from mla_ext.kv_b_proj import weights as W
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.vllm import _custom_ops as ops
from helpers.gather import POISON_BYTE, make_batch, make_cache, poisoned_dst
from helpers.numeric import assert_same_bits, assert_within_one_ulp, rel_fro, same_bits
from helpers.prefill import BLOCK, TINY, Batch

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

BF16 = torch.bfloat16
I32 = torch.int32
FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")
# The nvfp4_ds_mla upconvert exists exactly when mla_ext.config.formats has the format.
HAS_NVFP4 = hasattr(ops, "cp_gather_and_upconvert_nvfp4_kv_cache")
needs_nvfp4 = pytest.mark.skipif(not HAS_NVFP4, reason="mla_ext.config.formats has no nvfp4_ds_mla format")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# 1. Signatures
# ---------------------------------------------------------------------------

_REQ = object()  # no default
VLLM_0_33 = {  # name -> arguments in order: a name (required) or (name, default)
    "concat_and_cache_mla": (
        "kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale", ("skip_scale", False)),
    "gather_and_maybe_dequant_cache": (
        "src_cache", "dst", "block_table", "cu_seq_lens", "token_to_seq", "num_tokens", "kv_cache_dtype",
        "scale", ("seq_starts", None)),
    "cp_gather_cache": (
        "src_cache", "dst", "block_table", "cu_seq_lens", "batch_size", ("seq_starts", None)),
    "cp_gather_and_upconvert_fp8_kv_cache": (
        "src_cache", "dst", "block_table", "workspace_starts", "batch_size", ("seq_starts", None),
        ("host_cache", None), ("host_row_ids", None), ("device_row_ids", None)),
    "cp_gather_and_upconvert_nvfp4_kv_cache": (
        "src_cache", "dst", "block_table", "workspace_starts", "batch_size"),
    "merge_attn_states": (
        "output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", ("output_lse", None),
        ("prefill_tokens_with_context", None), ("output_scale", None)),
}
WRITES = {
    "concat_and_cache_mla": {"kv_cache"},
    "gather_and_maybe_dequant_cache": {"dst"},
    "cp_gather_cache": {"dst"},
    "cp_gather_and_upconvert_fp8_kv_cache": {"dst"},
    "cp_gather_and_upconvert_nvfp4_kv_cache": {"dst"},
    "merge_attn_states": {"output", "output_lse"},
}


@pytest.mark.parametrize("name", sorted(VLLM_0_33))
def test_signature_is_vllms(name):
    if name.endswith("nvfp4_kv_cache") and not HAS_NVFP4:
        pytest.skip("mla_ext.config.formats has no nvfp4_ds_mla format")
    schema = getattr(torch.ops.mla_ext_vllm, name).default._schema
    want = [(a, _REQ) if isinstance(a, str) else a for a in VLLM_0_33[name]]
    if name == "merge_attn_states":
        # Defaults on the Python function (torch 2.11's custom_op cannot take a
        # default on a mutated optional argument); the schema has the same names.
        import inspect

        params = inspect.signature(ops.merge_attn_states).parameters.values()
        got = [(p.name, _REQ if p.default is inspect.Parameter.empty else p.default) for p in params]
        # The op's schema has torch.ops._C.merge_attn_states's order (vLLM's csrc
        # torch_bindings): output, output_lse, prefix_output, prefix_lse,
        # suffix_output, suffix_lse, prefill_tokens_with_context, output_scale.
        assert [a.name for a in schema.arguments] == [
            "output", "output_lse", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
            "prefill_tokens_with_context", "output_scale"]
    else:
        got = [(a.name, a.default_value if a.has_default_value() else _REQ) for a in schema.arguments]
    assert got == want
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[name]
    assert not schema.returns  # in place, returns None like vLLM's
    assert getattr(ops, name) is getattr(mla_ext.vllm, name)
    assert ops.NAMESPACE == "mla_ext_vllm"


def test_nvfp4_upconvert_exists_exactly_with_its_format():
    """cp_gather_and_upconvert_nvfp4_kv_cache belongs to the nvfp4_ds_mla format;
    the surface offers it exactly when mla_ext.config.formats knows that format."""
    from mla_ext.config import formats

    has_format = "nvfp4_ds_mla" in formats.ALL_NAMES
    assert hasattr(ops, "cp_gather_and_upconvert_nvfp4_kv_cache") == has_format


# ---------------------------------------------------------------------------
# 2. Each op against the references
# ---------------------------------------------------------------------------

def _poisoned_cache(shape, dtype):
    cache = torch.empty(shape, dtype=dtype)
    if dtype.is_floating_point and dtype.itemsize > 1:
        cache.fill_(float("nan"))
    else:
        cache.view(torch.uint8).fill_(POISON_BYTE)
    return cache


@pytest.mark.parametrize("fmt", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"])
@pytest.mark.parametrize("skip_scale", [False, True])
def test_concat_and_cache_mla_matches_reference(fmt, skip_scale):
    g = _gen(3)
    L, R, B, nb, T = 512, 64, 16, 4, 23
    kv_c = (torch.randn(T, L, generator=g) * 3).to(BF16)
    k_pe = torch.randn(T, R, generator=g).to(BF16)
    slots = torch.randperm(nb * B, generator=g)[:T]
    slots[[3, 10]] = -1  # padding tokens: skipped
    scale = torch.tensor(0.05, dtype=torch.float32)  # vLLM keeps layer scales as 0-dim tensors
    f = get_format(fmt)
    shape = f.cache_shape(nb, B, L, R)
    want = _poisoned_cache(shape, f.storage_dtype(BF16))
    got, kw = want.clone(), want.clone()
    ref_scale = torch.ones(1) if skip_scale else scale
    cache_ref.concat_and_cache_mla_ref(kv_c, k_pe, want, slots, fmt, ref_scale)
    ops.concat_and_cache_mla(kv_c, k_pe, got, slots, fmt, scale, skip_scale)
    ops.concat_and_cache_mla(kv_c=kv_c, k_pe=k_pe, kv_cache=kw, slot_mapping=slots, kv_cache_dtype=fmt,
                             scale=scale, skip_scale=skip_scale)
    assert same_bits(got, want) and same_bits(kw, want)
    if skip_scale and f.fp8_dtype is not None and fmt != "fp8_ds_mla":
        scaled = _poisoned_cache(shape, f.storage_dtype(BF16))
        ops.concat_and_cache_mla(kv_c, k_pe, scaled, slots, fmt, scale)
        assert not same_bits(scaled, got)  # skip_scale really stores x, not x / scale


# (format, L, R, dst dtype): dst widths 576, 512 and 320, as vLLM allows.
GATHER_CASES = [
    ("auto", 512, 64, BF16),
    ("fp8", 512, 64, BF16),
    ("fp8_e4m3", 256, 64, torch.float16),  # width 320
    ("fp8_e5m2", 448, 64, torch.float32),  # width 512
    ("fp8_ds_mla", 512, 64, BF16),
    ("fp8_ds_mla", 512, 0, BF16),  # width 512
]


def _token_to_seq(cu: torch.Tensor, pad: int) -> torch.Tensor:
    lens = (cu[1:] - cu[:-1]).long()
    t2s = torch.repeat_interleave(torch.arange(lens.numel()), lens).to(I32)
    return torch.cat([t2s, torch.zeros(pad, dtype=I32)])  # vLLM pads to the largest chunk


def _gather_inputs(fmt, L, R, seed, bad_ids=False, num_reqs=4):
    rng = random.Random(seed)
    cache, ks = make_cache(fmt, 6, 16, L, R, gen=_gen(seed), strided=seed % 2 == 1)
    bt, cu, starts = make_batch(rng, num_reqs, 6, 16, 5, bad_ids=bad_ids)
    return cache, ks, bt, cu, starts


def _assert_close_or_exact(got, want, exact):
    # Not exact: the Triton interpreter truncates 16-bit stores, one ulp.
    (assert_same_bits if exact else assert_within_one_ulp)(got, want, "gathered rows")


@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"{c[0]}-{c[1] + c[2]}-{str(c[3])[6:]}")
@pytest.mark.parametrize("seed", range(3))
def test_gather_and_maybe_dequant_cache_matches_reference(case, seed):
    fmt, L, R, dtype = case
    cache, ks, bt, cu, starts = _gather_inputs(fmt, L, R, seed, bad_ids=seed == 2)
    starts = starts if seed != 1 else None
    toks = int(cu[-1])
    width = L + R
    want, _ = poisoned_dst(toks + 4, width, dtype)  # 4 rows past the chunk: untouched
    cache_ref.gather_ref(cache, want, bt, cu, 4, fmt, ks, starts)
    t2s = _token_to_seq(cu, 7)
    got, _ = poisoned_dst(toks + 4, width, dtype)
    ops.gather_and_maybe_dequant_cache(cache, got, bt, cu, t2s, toks, fmt, ks, starts)
    assert same_bits(got, want)
    kw, _ = poisoned_dst(toks + 4, width, dtype)
    ops.gather_and_maybe_dequant_cache(src_cache=cache, dst=kw, block_table=bt, cu_seq_lens=cu, token_to_seq=t2s,
                                       num_tokens=toks, kv_cache_dtype=fmt, scale=ks, seq_starts=starts)
    assert same_bits(kw, want)


def test_gather_rows_past_the_block_table_are_zero():
    """Documented difference: vLLM leaves rows past what the block table covers
    untouched; mla_ext writes them as zeros (its defined out-of-range result)."""
    cache, ks = make_cache("fp8", 4, 16, 512, 64, gen=_gen(0))
    bt = torch.tensor([[2, 0]], dtype=I32)  # covers tokens 0..31
    cu = torch.tensor([0, 40], dtype=I32)
    dst, _ = poisoned_dst(40, 576, BF16)
    ops.gather_and_maybe_dequant_cache(cache, dst, bt, cu, _token_to_seq(cu, 0), 40, "fp8", ks)
    want, _ = poisoned_dst(40, 576, BF16)
    cache_ref.gather_ref(cache, want, bt, cu, 1, "fp8", ks)
    assert same_bits(dst, want)
    assert not dst[:32].isnan().any() and (dst[:32] != 0).any() and (dst[32:] == 0).all()


@pytest.mark.parametrize("fmt,dst_dtype", [
    ("auto", BF16), ("fp8", torch.uint8), ("fp8", FP8), ("fp8_e5m2", torch.float8_e5m2),
    ("fp8_ds_mla", torch.uint8),
])
@pytest.mark.parametrize("seed", range(2))
def test_cp_gather_cache_matches_reference(fmt, dst_dtype, seed):
    cache, _, bt, cu, starts = _gather_inputs(fmt, 512, 64, seed, bad_ids=seed == 1)
    toks, entry = int(cu[-1]), cache.shape[2]
    want, _ = poisoned_dst(toks + 2, entry, cache.dtype)
    cache_ref.cp_gather_ref(cache, want, bt, cu, 4, starts)
    got, _ = poisoned_dst(toks + 2, entry, cache.dtype)
    got = got.view(dst_dtype)  # a float8 dst of a uint8 cache: raw bytes
    ops.cp_gather_cache(cache, got, bt, cu, 4, starts)
    assert same_bits(got.view(cache.dtype), want)


def _upconvert_want(cache, bt, workspace_starts, rows, starts, fmt="fp8_ds_mla"):
    """The reference gather with vLLM's row rule: request r owns rows
    [workspace_starts[r], workspace_starts[r + 1]), the last one up to dst's end."""
    cu = torch.cat([workspace_starts, torch.tensor([rows], dtype=I32)])
    want, _ = poisoned_dst(rows, 576, BF16)
    cache_ref.gather_ref(cache, want, bt, cu, workspace_starts.numel(), fmt, torch.ones(1), starts)
    return want


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("extra_rows", [0, 5])
def test_upconvert_fp8_matches_reference(seed, extra_rows):
    cache, _, bt, cu, starts = _gather_inputs("fp8_ds_mla", 512, 64, seed, bad_ids=seed == 2)
    starts = starts if seed != 1 else None
    rows = int(cu[-1]) + extra_rows  # extra rows belong to the last request (vLLM's rule)
    ws = cu[:-1].clone()
    want = _upconvert_want(cache, bt, ws, rows, starts)
    got, _ = poisoned_dst(rows, 576, BF16)
    ops.cp_gather_and_upconvert_fp8_kv_cache(cache, got, bt, ws, 4, starts)
    assert same_bits(got, want)
    kw, _ = poisoned_dst(rows, 576, BF16)
    ops.cp_gather_and_upconvert_fp8_kv_cache(src_cache=cache, dst=kw, block_table=bt, workspace_starts=ws,
                                             batch_size=4, seq_starts=starts)
    assert same_bits(kw, want)


@needs_nvfp4
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("extra_rows", [0, 5])
def test_upconvert_nvfp4_matches_reference(seed, extra_rows):
    cache, _, bt, cu, _ = _gather_inputs("nvfp4_ds_mla", 512, 64, seed, bad_ids=seed == 2)
    rows = int(cu[-1]) + extra_rows
    ws = cu[:-1].clone()
    want = _upconvert_want(cache, bt, ws, rows, None, "nvfp4_ds_mla")  # no seq_starts in vLLM's signature
    got, _ = poisoned_dst(rows, 576, BF16)
    ops.cp_gather_and_upconvert_nvfp4_kv_cache(cache, got, bt, ws, 4)
    assert same_bits(got, want)
    kw, _ = poisoned_dst(rows, 576, BF16)
    ops.cp_gather_and_upconvert_nvfp4_kv_cache(src_cache=cache, dst=kw, block_table=bt, workspace_starts=ws,
                                               batch_size=4)
    assert same_bits(kw, want)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", pytest.param("nvfp4_ds_mla", marks=needs_nvfp4)])
@pytest.mark.parametrize("batch_size", [4, 2, 0])
def test_upconvert_takes_vllms_own_call(fmt, batch_size):
    """vLLM 0.33's _compute_prefill_context (and its context-parallel variant) passes
    workspace_starts=chunk.cu_seq_lens, R + 1 entries, with batch_size=R, and
    dst=workspace[:toks]; its kernel reads the first batch_size entries and runs the
    last request to dst's end. A shorter batch_size reads a prefix of the array."""
    cache, _, bt, cu, starts = _gather_inputs(fmt, 512, 64, 7)
    starts = starts if fmt == "fp8_ds_mla" else None
    rows = int(cu[batch_size]) if batch_size else 0
    want = _upconvert_want(cache, bt[:batch_size], cu[:batch_size].clone(), rows,
                           None if starts is None else starts[:batch_size], fmt)
    got, _ = poisoned_dst(rows, 576, BF16)
    op = (ops.cp_gather_and_upconvert_fp8_kv_cache if fmt == "fp8_ds_mla"
          else ops.cp_gather_and_upconvert_nvfp4_kv_cache)
    extra = {"seq_starts": starts} if fmt == "fp8_ds_mla" else {}
    op(src_cache=cache, dst=got, block_table=bt, workspace_starts=cu.clone(), batch_size=batch_size, **extra)
    assert same_bits(got, want)


def test_gathers_through_the_triton_backend():
    """Forced onto the Triton gather: the same rows as the reference (1 ulp under the interpreter)."""
    exact = torch.cuda.is_available()
    cache, ks, bt, cu, starts = _gather_inputs("fp8", 512, 64, 5)
    toks = int(cu[-1])
    want, _ = poisoned_dst(toks, 576, BF16)
    cache_ref.gather_ref(cache, want, bt, cu, 4, "fp8", ks, starts)
    got, _ = poisoned_dst(toks, 576, BF16)
    raw_want, _ = poisoned_dst(toks, 576, torch.uint8)
    cache_ref.cp_gather_ref(cache, raw_want, bt, cu, 4, starts)
    raw, _ = poisoned_dst(toks, 576, FP8)
    ds, _, dbt, dcu, dstarts = _gather_inputs("fp8_ds_mla", 512, 64, 6)
    ws = dcu[:-1].clone()
    ds_want = _upconvert_want(ds, dbt, ws, int(dcu[-1]), dstarts)
    ds_got, _ = poisoned_dst(int(dcu[-1]), 576, BF16)
    if HAS_NVFP4:
        nv, _, nbt, ncu, _ = _gather_inputs("nvfp4_ds_mla", 512, 64, 7)
        nws = ncu[:-1].clone()
        nv_want = _upconvert_want(nv, nbt, nws, int(ncu[-1]), None, "nvfp4_ds_mla")
        nv_got, _ = poisoned_dst(int(ncu[-1]), 576, BF16)
    with cache_api.GATHER.force("triton_paged"):
        ops.gather_and_maybe_dequant_cache(cache, got, bt, cu, _token_to_seq(cu, 0), toks, "fp8", ks, starts)
        ops.cp_gather_cache(cache, raw, bt, cu, 4, starts)
        ops.cp_gather_and_upconvert_fp8_kv_cache(ds, ds_got, dbt, ws, 4, dstarts)
        if HAS_NVFP4:
            ops.cp_gather_and_upconvert_nvfp4_kv_cache(nv, nv_got, nbt, nws, 4)
    _assert_close_or_exact(got, want, exact)
    assert same_bits(raw.view(torch.uint8), raw_want)
    _assert_close_or_exact(ds_got, ds_want, exact)
    if HAS_NVFP4:
        _assert_close_or_exact(nv_got, nv_want, exact)


def _merge_inputs(T, N, D, dtype, seed):
    g = _gen(seed)
    o1 = torch.randn(T, N, D, generator=g).to(dtype)
    o2 = torch.randn(T, N, D, generator=g).to(dtype)
    lse1 = torch.randn(N, T, generator=g) * 3
    lse2 = torch.randn(N, T, generator=g) * 3
    lse1[0, 1] = NEG_INF            # prefix empty: the suffix unchanged
    lse2[1, 2] = NEG_INF            # suffix empty
    lse1[:, 3] = NEG_INF            # both empty: 0 and -inf (SPEC §7)
    lse2[:, 3] = NEG_INF
    lse2[0, 4] = float("inf")       # +inf counts as -inf
    o1[1, 0] = float("nan")         # never read: its side is empty
    return o1, lse1, o2, lse2


def _expected_merge(o1, lse1, o2, lse2, p):
    o, lse = attn_ref.merge_attn_states_ref(o1, lse1, o2, lse2)
    n = o2.shape[0] if p is None else p
    return torch.cat([o[:n], o2[n:]]), torch.cat([lse[:, :n], lse2[:, n:]], dim=1)


MERGE_TOL = {BF16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("p", [None, 0, 5, 9])
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("backend", ["default", "triton"])
def test_merge_attn_states_matches_reference(dtype, p, with_lse, backend):
    T, N, D = 9, 3, 40
    o1, lse1, o2, lse2 = _merge_inputs(T, N, D, dtype, seed=11 + (p or 0))
    want_o, want_lse = _expected_merge(o1, lse1, o2, lse2, p)
    out = torch.full_like(o2, float("nan"))
    out_lse = torch.full_like(lse2, float("nan")) if with_lse else None
    force = attn_api.MERGE.force("triton") if backend == "triton" else contextlib.nullcontext()
    with force:
        ops.merge_attn_states(out, o1, lse1, o2, lse2, out_lse, p)
    n = T if p is None else p
    assert same_bits(out[n:], o2[n:])  # tokens without context: the suffix, copied
    torch.testing.assert_close(out.float(), want_o.float(), rtol=MERGE_TOL[dtype], atol=MERGE_TOL[dtype])
    assert (out[3] == 0).all() if n > 3 else same_bits(out[3], o2[3])
    if with_lse:
        assert same_bits(out_lse[:, n:], lse2[:, n:])
        torch.testing.assert_close(out_lse, want_lse, rtol=1e-5, atol=1e-5)
    if backend == "default" and n:  # on the first n tokens: exactly the native merge
        nat, nat_lse = attn_api.merge_attn_states(o1[:n], lse1[:, :n], o2[:n], lse2[:, :n])
        assert same_bits(out[:n], nat)
        if with_lse:
            assert same_bits(out_lse[:, :n], nat_lse)


def test_merge_prefix_may_hold_only_the_context_tokens():
    """With prefill_tokens_with_context = p the prefix is read for p tokens only:
    a [p, N, D] prefix (vLLM's context pass over the first p tokens) works."""
    o1, lse1, o2, lse2 = _merge_inputs(9, 3, 40, torch.float32, seed=2)
    want_o, want_lse = _expected_merge(o1, lse1, o2, lse2, 6)
    out, out_lse = torch.full_like(o2, float("nan")), torch.full_like(lse2, float("nan"))
    ops.merge_attn_states(out, o1[:6].clone(), lse1[:, :6].clone(), o2, lse2, out_lse,
                          prefill_tokens_with_context=6)
    torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [None, 4])
def test_merge_in_place(p):
    o1, lse1, o2, lse2 = _merge_inputs(9, 3, 40, torch.float32, seed=4)
    want_o, want_lse = _expected_merge(o1, lse1, o2, lse2, p)
    a, a_lse = o1.clone(), lse1.clone()
    ops.merge_attn_states(a, a, a_lse, o2, lse2, a_lse, p)  # output is the prefix
    b, b_lse = o2.clone(), lse2.clone()
    ops.merge_attn_states(b, o1, lse1, b, b_lse, b_lse, p)  # output is the suffix
    for o, lse in ((a, a_lse), (b, b_lse)):
        torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def _e4m3_ordinal(x: torch.Tensor) -> torch.Tensor:
    b = x.view(torch.uint8).to(torch.int32)
    mag = b & 0x7F
    return torch.where(b & 0x80 != 0, -mag, mag)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("p", [None, 5, 0])
@pytest.mark.parametrize("backend", ["default", "triton"])
def test_merge_fp8_output_scale(dtype, p, backend):
    """output_scale: output is e4m3 = saturate(merged / output_scale): within one
    e4m3 step of the fp32 reference (the merge rounds to the inputs' dtype
    first), and bit for bit the native merge's result quantized once."""
    T, N, D = 9, 3, 40
    o1, lse1, o2, lse2 = _merge_inputs(T, N, D, dtype, seed=21)
    o2[6, 0, :4] = torch.tensor([100.0, -100.0, 1e-4, 0.0]).to(dtype)  # saturates both ways; tiny
    want_o, want_lse = _expected_merge(o1, lse1, o2, lse2, p)
    scale = torch.tensor(0.05, dtype=torch.float32)
    want = (want_o.float() / scale).clamp(-448, 448).to(FP8)
    out = torch.full((T, N, D), 0x7F, dtype=torch.uint8).view(FP8)  # e4m3 NaN bytes
    out_lse = torch.full_like(lse2, float("nan"))
    force = attn_api.MERGE.force("triton") if backend == "triton" else contextlib.nullcontext()
    with force:
        ops.merge_attn_states(out, o1, lse1, o2, lse2, out_lse, p, scale)
    assert not out.float().isnan().any()
    assert (_e4m3_ordinal(out) - _e4m3_ordinal(want)).abs().max() <= 1
    n = T if p is None else p
    if backend == "default":  # exactly the native merge, divided, saturated, cast once
        nat, _ = attn_api.merge_attn_states(o1[:n], lse1[:, :n], o2[:n], lse2[:, :n])
        exact = (torch.cat([nat, o2[n:]]).float() / scale).clamp(-448, 448).to(FP8)
        assert same_bits(out.view(torch.uint8), exact.view(torch.uint8))
    if n <= 6:
        assert out[6, 0, 0].float() == 448 and out[6, 0, 1].float() == -448
    torch.testing.assert_close(out_lse, want_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# 3. Refusals name their argument
# ---------------------------------------------------------------------------

def _refusal_inputs():
    cache, ks, bt, cu, starts = _gather_inputs("fp8", 512, 64, 0)
    ds, _, dbt, dcu, dstarts = _gather_inputs("fp8_ds_mla", 512, 64, 0)
    toks, dtoks = int(cu[-1]), int(dcu[-1])
    o1, lse1, o2, lse2 = _merge_inputs(9, 3, 40, BF16, seed=0)
    return dict(cache=cache, ks=ks, bt=bt, cu=cu, starts=starts, toks=toks, t2s=_token_to_seq(cu, 0),
                dst=torch.empty(toks, 576, dtype=BF16), raw=torch.empty(toks, 576, dtype=torch.uint8),
                ds=ds, dbt=dbt, ws=dcu[:-1].clone(), dstarts=dstarts, ddst=torch.empty(dtoks, 576, dtype=BF16),
                o1=o1, lse1=lse1, o2=o2, lse2=lse2, out=torch.empty_like(o2))


def _upconvert(x, **kw):
    args = dict(src_cache=x["ds"], dst=x["ddst"], block_table=x["dbt"], workspace_starts=x["ws"], batch_size=4,
                seq_starts=x["dstarts"])
    args.update(kw)
    ops.cp_gather_and_upconvert_fp8_kv_cache(**args)


def _gather(x, **kw):
    args = dict(src_cache=x["cache"], dst=x["dst"], block_table=x["bt"], cu_seq_lens=x["cu"],
                token_to_seq=x["t2s"], num_tokens=x["toks"], kv_cache_dtype="fp8", scale=x["ks"],
                seq_starts=x["starts"])
    args.update(kw)
    ops.gather_and_maybe_dequant_cache(**args)


def _merge(x, **kw):
    args = dict(output=x["out"], prefix_output=x["o1"], prefix_lse=x["lse1"], suffix_output=x["o2"],
                suffix_lse=x["lse2"])
    args.update(kw)
    ops.merge_attn_states(**args)


REFUSALS = {
    "host_cache": (lambda x: _upconvert(x, host_cache=torch.empty(2, 16, 656, dtype=torch.uint8)),
                   r"host_cache: expected None; mla_ext does not support"),
    "host_row_ids": (lambda x: _upconvert(x, host_row_ids=torch.zeros(3, dtype=I32)), r"host_row_ids: expected None"),
    "device_row_ids": (lambda x: _upconvert(x, device_row_ids=torch.zeros(3, dtype=I32)),
                       r"device_row_ids: expected None"),
    "upconvert_batch_size": (lambda x: _upconvert(x, batch_size=5),
                             r"batch_size: expected an int in \[0, 4\] \(len\(workspace_starts\)"),
    "upconvert_dst_width": (lambda x: _upconvert(x, dst=x["ddst"][:, :512]), r"dst: expected 576 columns"),
    "upconvert_dst_dtype": (lambda x: _upconvert(x, dst=x["ddst"].half()), r"dst: expected dtype torch.bfloat16"),
    "upconvert_workspace_starts": (lambda x: _upconvert(x, workspace_starts=x["ws"].long()),
                                   r"workspace_starts: expected dtype torch.int32"),
    "cp_gather_batch_size": (
        lambda x: ops.cp_gather_cache(x["cache"], x["raw"], x["bt"], x["cu"], 3, x["starts"]),
        r"batch_size: expected len\(cu_seq_lens\) - 1 = 4, got 3"),
    "cp_gather_dst_dtype": (
        lambda x: ops.cp_gather_cache(x["cache"], x["dst"], x["bt"], x["cu"], 4, x["starts"]),
        r"dst: cp_gather_cache copies raw bytes"),
    "gather_dst_width": (lambda x: _gather(x, dst=torch.empty(x["toks"], 448, dtype=BF16)),
                         r"dst: expected 320, 512, 576 columns"),
    "gather_num_tokens": (lambda x: _gather(x, num_tokens=x["toks"] + 1), r"num_tokens: expected an int in \[0, "),
    "gather_token_to_seq_dtype": (lambda x: _gather(x, token_to_seq=x["t2s"].long()),
                                  r"token_to_seq: expected dtype torch.int32"),
    "gather_token_to_seq_short": (lambda x: _gather(x, token_to_seq=x["t2s"][:3]),
                                  r"token_to_seq: expected at least num_tokens="),
    "gather_format": (lambda x: _gather(x, kv_cache_dtype="fp4"), r"kv_cache_dtype: unknown KV-cache format"),
    "gather_native_into_other_dtype": (
        lambda x: _gather(x, src_cache=x["cache"].view(BF16)[..., :288].contiguous(), kv_cache_dtype="auto",
                          dst=torch.empty(x["toks"], 576, dtype=torch.float16)),
        r"dst: .*native"),
    "merge_p_high": (lambda x: _merge(x, prefill_tokens_with_context=10),
                     r"prefill_tokens_with_context: expected None or an int in \[0, 9\]"),
    "merge_p_negative": (lambda x: _merge(x, prefill_tokens_with_context=-1), r"prefill_tokens_with_context:"),
    "merge_fp8_without_scale": (lambda x: _merge(x, output=x["out"].to(FP8)),
                                r"output: expected dtype torch.bfloat16 .*needs output_scale"),
    "merge_scale_not_fp8": (lambda x: _merge(x, output_scale=torch.tensor(1.0)),
                            r"output: with output_scale, expected dtype torch.float8_e4m3fn"),
    "merge_scale_shape": (lambda x: _merge(x, output=x["out"].to(FP8), output_scale=torch.ones(2)),
                          r"output_scale: expected one element"),
    "merge_scale_dtype": (lambda x: _merge(x, output=x["out"].to(FP8), output_scale=torch.ones(1).double()),
                          r"output_scale: expected dtype torch.float32"),
    "merge_scale_value": (lambda x: _merge(x, output=x["out"].to(FP8), output_scale=torch.tensor(0.0)),
                          r"output_scale: expected a finite value > 0"),
    "merge_prefix_short": (lambda x: _merge(x, prefix_output=x["o1"][:8]), r"prefix_output: expected shape"),
    "merge_prefix_short_p": (lambda x: _merge(x, prefix_output=x["o1"][:4], prefill_tokens_with_context=5),
                             r"prefix_output: expected shape \[9, 3, 40\] \(as output\) or \[>= 5, 3, 40\]"),
    "merge_suffix_lse": (lambda x: _merge(x, suffix_lse=x["lse2"].t().contiguous()), r"suffix_lse: expected shape"),
    "merge_output_lse_dtype": (lambda x: _merge(x, output_lse=x["lse2"].double()),
                               r"output_lse: expected dtype torch.float32"),
    "merge_suffix_dtype": (lambda x: _merge(x, suffix_output=x["o2"].half(), output=x["out"].half()),
                           r"prefix_output: expected dtype torch.float16"),
    "merge_shifted_output": (lambda x: _merge(x, **_shifted_pair(x["o2"]), prefill_tokens_with_context=3),
                             r"output and suffix_output: share memory"),
    "merge_shifted_output_all_tokens": (lambda x: _merge(x, **_shifted_pair(x["o2"])),
                                        r"output and suffix_output: share memory"),
    "merge_shifted_output_lse": (lambda x: _merge(x, output_lse=x["lse1"][:, 1:], prefix_lse=x["lse1"][:, :-1],
                                                  **_trimmed(x)),
                                 r"output_lse and prefix_lse: share memory"),
}


if HAS_NVFP4:
    def _nvfp4(x, **kw):
        nv = torch.zeros(6, 16, 352, dtype=torch.uint8)
        args = dict(src_cache=nv, dst=x["ddst"], block_table=x["dbt"], workspace_starts=x["ws"], batch_size=4)
        args.update(kw)
        ops.cp_gather_and_upconvert_nvfp4_kv_cache(**args)

    REFUSALS.update({
        "nvfp4_batch_size": (lambda x: _nvfp4(x, batch_size=5), r"batch_size: expected an int in \[0, 4\]"),
        "nvfp4_dst_width": (lambda x: _nvfp4(x, dst=x["ddst"][:, :512]), r"dst: expected 576 columns"),
        "nvfp4_cache": (lambda x: _nvfp4(x, src_cache=x["ds"]), r"src_cache: "),
    })


def _shifted_pair(o):
    """suffix_output and an output one token further on in the same buffer."""
    buf = torch.empty(o.shape[0] + 1, *o.shape[1:], dtype=o.dtype)
    buf[:-1] = o
    return {"suffix_output": buf[:-1], "output": buf[1:]}


def _trimmed(x):
    """The merge's [T, N, D] tensors cut to T - 1 tokens (to go with shifted [N, T - 1] lse views)."""
    t = x["o2"].shape[0] - 1
    return {"output": x["out"][:t], "prefix_output": x["o1"][:t], "suffix_output": x["o2"][:t],
            "suffix_lse": x["lse2"][:, :t].contiguous()}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_their_argument(name):
    call, pattern = REFUSALS[name]
    with pytest.raises(ValueError, match="^" + pattern):
        call(_refusal_inputs())


FAKE_REFUSALS = ["host_cache", "upconvert_batch_size", "upconvert_dst_width", "cp_gather_batch_size",
                 "gather_dst_width", "gather_num_tokens", "gather_token_to_seq_short", "merge_p_high",
                 "merge_fp8_without_scale", "merge_prefix_short", "merge_scale_shape"]


@pytest.mark.parametrize("name", FAKE_REFUSALS)
def test_fake_kernels_refuse_too(name):
    """Under torch.compile the fake kernels run the same checks: the error comes at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    call, pattern = REFUSALS[name]
    mode = FakeTensorMode()
    x = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in _refusal_inputs().items()}
    with mode, pytest.raises(ValueError, match="^" + pattern):
        call(x)


# ---------------------------------------------------------------------------
# 4. opcheck and torch.compile
# ---------------------------------------------------------------------------

def _opcheck_cases():
    x = _refusal_inputs()
    merge_op = torch.ops.mla_ext_vllm.merge_attn_states.default
    g = _gen(8)
    kv_c = torch.randn(5, 512, generator=g).to(BF16)
    k_pe = torch.randn(5, 64, generator=g).to(BF16)
    slots = torch.tensor([0, 17, 40, -1, 3])
    fp8_cache = torch.zeros(4, 16, 576, dtype=torch.uint8)
    ds_cache = torch.zeros(4, 16, 656, dtype=torch.uint8)
    o1, lse1, o2, lse2 = x["o1"], x["lse1"], x["o2"], x["lse2"]
    fp8_out = torch.zeros(9, 3, 40, dtype=torch.uint8).view(FP8)
    return [
        ("concat_fp8", ops.concat_and_cache_mla, (kv_c, k_pe, fp8_cache, slots, "fp8", x["ks"]), {}),
        ("concat_skip_scale", ops.concat_and_cache_mla, (kv_c, k_pe, fp8_cache, slots, "fp8", x["ks"], True), {}),
        ("concat_ds_mla", ops.concat_and_cache_mla, (kv_c, k_pe, ds_cache, slots, "fp8_ds_mla", x["ks"]), {}),
        ("gather", ops.gather_and_maybe_dequant_cache,
         (x["cache"], x["dst"], x["bt"], x["cu"], x["t2s"], x["toks"], "fp8", x["ks"], x["starts"]), {}),
        ("gather_no_starts", ops.gather_and_maybe_dequant_cache,
         (x["cache"], x["dst"], x["bt"], x["cu"], x["t2s"], x["toks"], "fp8", x["ks"]), {}),
        ("cp_gather", ops.cp_gather_cache, (x["cache"], x["raw"], x["bt"], x["cu"], 4, x["starts"]), {}),
        ("upconvert", ops.cp_gather_and_upconvert_fp8_kv_cache,
         (x["ds"], x["ddst"], x["dbt"], x["ws"], 4, x["dstarts"]), {}),
        *([("upconvert_nvfp4", ops.cp_gather_and_upconvert_nvfp4_kv_cache,
            (torch.zeros(6, 16, 352, dtype=torch.uint8), x["ddst"], x["dbt"], x["ws"], 4), {})] if HAS_NVFP4 else []),
        # The merge op itself takes every argument (its defaults live on ops.merge_attn_states),
        # in torch.ops._C.merge_attn_states's order: output, output_lse, prefix..., suffix...
        ("merge", merge_op, (x["out"], None, o1, lse1, o2, lse2, None, None), {}),
        ("merge_lse", merge_op, (x["out"], torch.empty_like(lse1), o1, lse1, o2, lse2, None, None), {}),
        ("merge_p", merge_op, (x["out"], torch.empty_like(lse1), o1, lse1, o2, lse2),
         {"prefill_tokens_with_context": 4, "output_scale": None}),
        ("merge_fp8", merge_op, (fp8_out, torch.empty_like(lse1), o1, lse1, o2, lse2, 6,
                                 torch.tensor(0.1)), {}),
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda c: c[0])
def test_opcheck(case):
    name, op, args, kwargs = case
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if name == "merge_fp8":
        # test_schema compares tensors with arithmetic that torch has no CPU
        # float8 kernel for; the schema itself is held by test_signature_is_vllms.
        tests = tests[1:]
    torch.library.opcheck(op, args, kwargs, test_utils=tests)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    """One function calling every op (write, the three gathers, an up-projection,
    merges with and without prefill_tokens_with_context / output_scale) compiles
    with fullgraph=True and gives the eager result."""
    g = _gen(12)
    x = _refusal_inputs()
    kv_c = torch.randn(20, 512, generator=g).to(BF16)
    k_pe = torch.randn(20, 64, generator=g).to(BF16)
    slots = torch.randperm(64, generator=g)[:20]
    w = (torch.randn(3 * 40, 512, generator=g) / 23).to(BF16)

    def step(cache, ds_cache, dst, raw, ddst, out, out_lse, fp8_out):
        ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", x["ks"])
        ops.concat_and_cache_mla(kv_c, k_pe, ds_cache, slots, "fp8_ds_mla", x["ks"], skip_scale=True)
        ops.gather_and_maybe_dequant_cache(cache, dst, x["bt"], x["cu"], x["t2s"], x["toks"], "fp8", x["ks"],
                                           seq_starts=x["starts"])
        ops.cp_gather_cache(cache, raw, x["bt"], x["cu"], 4, x["starts"])
        ops.cp_gather_and_upconvert_fp8_kv_cache(ds_cache, ddst, x["dbt"], x["ws"], 4, x["dstarts"])
        kv = F.linear(dst[:, :512], w).sum(0).view(1, 3, 40)  # stands in for kv_b_proj
        ops.merge_attn_states(out, x["o1"] + kv, x["lse1"], x["o2"], x["lse2"], out_lse)
        ops.merge_attn_states(fp8_out, out, out_lse, x["o2"], x["lse2"], prefill_tokens_with_context=5,
                              output_scale=torch.tensor(0.05))
        return dst.sum(), ddst.float().sum()

    def fresh():
        return (torch.zeros(4, 16, 576, dtype=torch.uint8), torch.zeros(4, 16, 656, dtype=torch.uint8),
                torch.full_like(x["dst"], float("nan")), torch.zeros_like(x["raw"]),
                torch.full_like(x["ddst"], float("nan")), torch.full_like(x["o2"], float("nan")),
                torch.full_like(x["lse2"], float("nan")), torch.zeros(9, 3, 40, dtype=torch.uint8).view(FP8))

    eager, compiled = fresh(), fresh()
    torch._dynamo.reset()
    r_eager = step(*eager)
    r_comp = torch.compile(step, fullgraph=True, backend=backend)(*compiled)
    for a, b in zip(eager + r_eager, compiled + r_comp):
        a, b = (t.reshape(-1).view(torch.uint8) if t.dtype == FP8 else t.reshape(-1) for t in (a, b))
        assert same_bits(a, b)
    assert not eager[2].isnan().any() and not eager[4].isnan().any() and not eager[5].isnan().any()


# ---------------------------------------------------------------------------
# 5. Parity: vLLM's chunked-context MLA prefill through the surface
# ---------------------------------------------------------------------------

def vllm_chunk_metadata(ctx_lens, workspace_rows, block_size):
    """vLLM's chunked-context metadata: every request with context takes part in
    every chunk with an equal share of the workspace, rounded down to whole
    blocks. Returns (starts [chunks, reqs], cu_seq_lens [chunks, reqs + 1],
    token_to_seq [chunks, max chunk tokens], chunk totals) on the host."""
    n = len(ctx_lens)
    share = (workspace_rows // n) // block_size * block_size
    ctx = torch.tensor(ctx_lens, dtype=torch.int64)
    num_chunks = -(-int(ctx.max()) // share)
    starts = (torch.arange(num_chunks)[:, None] * share).expand(-1, n).contiguous()
    lens = (torch.minimum(ctx[None], starts + share) - starts).clamp(min=0)
    cu = torch.zeros(num_chunks, n + 1, dtype=torch.int64)
    cu[:, 1:] = lens.cumsum(1)
    totals = cu[:, -1].tolist()
    t2s = torch.zeros(num_chunks, max(totals), dtype=I32)
    for i in range(num_chunks):
        t2s[i, : totals[i]] = torch.repeat_interleave(torch.arange(n), lens[i]).to(I32)
    return starts.to(I32), cu.to(I32), t2s, totals


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)


def vllm_style_prefill(q, kv_c_new, k_pe_new, kv_cache, kv_cache_dtype, k_scale, block_table, ctx_lens,
                       q_lens, w_kv_b, softmax_scale, workspace_rows, *, fp8_prefill=False,
                       context_tokens_only=False, positional=False):
    """One MLA layer's prefill with context, the way vLLM's MLA attention runs it
    (chunked context: gather into the workspace, up-project, attention with LSE,
    merge across chunks; then merge with the new tokens), every cache op through
    the surface. `context_tokens_only`: requests with context come first and the
    context pass runs on their p tokens only; the final merge passes
    prefill_tokens_with_context=p. Workspaces and outputs are poisoned (NaN)."""
    m = TINY
    N, P, V, L = m.num_heads, m.P, m.V, m.L
    dt = q.dtype

    def up_project(latent, rope):  # kv_b_proj, split, keys
        kv = F.linear(latent.to(dt), w_kv_b).view(-1, N, P + V)
        k_nope, v = kv.split([P, V], dim=-1)
        k = torch.cat([k_nope, rope.to(dt)[:, None, :].expand(-1, N, -1)], dim=-1)
        return k, v.contiguous()

    dev = q.device
    cu_q = _cu(q_lens).to(dev)
    k, v = up_project(kv_c_new, k_pe_new)
    suffix_output, suffix_lse = attn_api.varlen_attention(q, k, v, cu_q, cu_q, max(q_lens), max(q_lens),
                                                          softmax_scale, causal=True)
    n_ctx = len(ctx_lens)
    if context_tokens_only:
        n_ctx = next((r for r, c in enumerate(ctx_lens) if c == 0), len(ctx_lens))
        assert all(c == 0 for c in ctx_lens[n_ctx:])
    p = sum(q_lens[:n_ctx])
    q_ctx, cu_q_ctx, max_q_ctx = q[:p], cu_q[: n_ctx + 1], max(q_lens[:n_ctx])
    table = block_table[:n_ctx]
    starts, cu_host, t2s, totals = vllm_chunk_metadata(ctx_lens[:n_ctx], workspace_rows, BLOCK)
    starts, cu, t2s = starts.to(dev), cu_host.to(dev), t2s.to(dev)  # vLLM copies its metadata once per batch
    fmt = get_format(kv_cache_dtype)
    raw_gather = fp8_prefill and fmt.name in ("fp8", "fp8_e5m2")
    ws_dtype = fmt.fp8_dtype if raw_gather else dt
    workspace = torch.empty(workspace_rows, L + m.R, dtype=ws_dtype, device=dev)
    context_output = context_lse = None
    for i, toks in enumerate(totals):
        workspace.view(torch.uint8).fill_(0x7F) if raw_gather else workspace.fill_(float("nan"))
        if fmt.name == "nvfp4_ds_mla":  # vLLM's signature has no seq_starts: one chunk from token 0
            assert i == 0
            if positional:
                ops.cp_gather_and_upconvert_nvfp4_kv_cache(kv_cache, workspace[:toks], table, cu[i], n_ctx)
            else:
                ops.cp_gather_and_upconvert_nvfp4_kv_cache(src_cache=kv_cache, dst=workspace[:toks],
                                                           block_table=table, workspace_starts=cu[i],
                                                           batch_size=n_ctx)
        elif fmt.name == "fp8_ds_mla":
            if positional:
                ops.cp_gather_and_upconvert_fp8_kv_cache(kv_cache, workspace[:toks], table, cu[i], n_ctx,
                                                         starts[i])
            else:
                ops.cp_gather_and_upconvert_fp8_kv_cache(
                    src_cache=kv_cache, dst=workspace[:toks], block_table=table, workspace_starts=cu[i],
                    batch_size=n_ctx, seq_starts=starts[i])
        elif raw_gather:  # FP8 prefill: the raw bytes, dequantized by the consumer
            if positional:
                ops.cp_gather_cache(kv_cache, workspace[:toks], table, cu[i], n_ctx, starts[i])
            else:
                ops.cp_gather_cache(src_cache=kv_cache, dst=workspace[:toks], block_table=table,
                                    cu_seq_lens=cu[i], batch_size=n_ctx, seq_starts=starts[i])
        elif positional:
            ops.gather_and_maybe_dequant_cache(kv_cache, workspace[:toks], table, cu[i], t2s[i], toks,
                                               kv_cache_dtype, k_scale, starts[i])
        else:
            ops.gather_and_maybe_dequant_cache(
                src_cache=kv_cache, dst=workspace, block_table=table, cu_seq_lens=cu[i], token_to_seq=t2s[i],
                num_tokens=toks, kv_cache_dtype=kv_cache_dtype, scale=k_scale, seq_starts=starts[i])
        rows = workspace[:toks]
        if raw_gather:
            rows = (rows.float() * k_scale).to(dt)
        k, v = up_project(rows[:, :L], rows[:, L:])
        max_k = int((cu_host[i, 1:] - cu_host[i, :-1]).max())
        o, lse = attn_api.varlen_attention(q_ctx, k, v, cu_q_ctx, cu[i], max_q_ctx, max_k, softmax_scale,
                                           causal=False)
        if context_output is None:
            context_output, context_lse = o, lse
            continue
        out_tmp, lse_tmp = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
        if positional:
            ops.merge_attn_states(out_tmp, context_output, context_lse, o, lse, lse_tmp)
        else:
            ops.merge_attn_states(output=out_tmp, prefix_output=context_output, prefix_lse=context_lse,
                                  suffix_output=o, suffix_lse=lse, output_lse=lse_tmp)
        context_output, context_lse = out_tmp, lse_tmp
    output = torch.full_like(suffix_output, float("nan"))
    with_ctx = p if context_tokens_only else None
    if positional:
        ops.merge_attn_states(output, context_output, context_lse, suffix_output, suffix_lse, None, with_ctx)
    else:
        ops.merge_attn_states(output=output, prefix_output=context_output, prefix_lse=context_lse,
                              suffix_output=suffix_output, suffix_lse=suffix_lse,
                              prefill_tokens_with_context=with_ctx)
    return output, len(totals)


def _cached_context(cache, fmt, k_scale, block_table, ctx_lens):
    """Per request, the context rows the cache holds, decoded by the float32
    cache reference: (kv_c list, k_pe list) for the oracle."""
    native = get_format(fmt).is_native
    rows = torch.empty(sum(ctx_lens), TINY.L + TINY.R, dtype=cache.dtype if native else torch.float32)
    cache_ref.gather_ref(cache, rows, block_table, _cu(ctx_lens), len(ctx_lens), fmt, k_scale)
    rows = rows.float().split(ctx_lens)
    return [r[:, :TINY.L] for r in rows], [r[:, TINY.L:] for r in rows]


@pytest.fixture
def torch_attention():
    """Attention is not a surface op: both sides use the same (torch) backend."""
    with attn_api.ATTENTION.force("torch"):
        yield


# (format, FP8 prefill, context tokens only)
PARITY_CASES = [
    ("auto", False, False),
    ("fp8", False, False),
    ("fp8_e5m2", False, False),
    ("fp8_ds_mla", False, False),
    ("fp8", True, False),        # vLLM's FP8 prefill: cp_gather_cache raw
    ("fp8_e5m2", True, False),
    ("fp8_ds_mla", False, True),  # prefill_tokens_with_context
    ("auto", False, True),
    *([("nvfp4_ds_mla", False, False)] if HAS_NVFP4 else []),  # one chunk (no seq_starts in vLLM's op)
]


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("seed", range(3))
def test_vllm_prefill_parity(case, seed, torch_attention):
    fmt, fp8_prefill, ctx_only = case
    rng = random.Random(seed * 31 + len(fmt))
    if ctx_only:
        ctx_lens = [rng.randint(33, 70), rng.randint(1, 40), 0, 0]  # shares of 32 rows: >= 2 chunks
    else:
        ctx_lens = [rng.randint(17, 70), 0, rng.randint(1, 40), rng.choice([1, 16, 17])]  # shares of 16
    q_lens = [rng.randint(1, 4) for _ in ctx_lens]
    batch = Batch(ctx_lens, q_lens, seed=seed)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=_gen(seed)) / math.sqrt(TINY.L)
    one_chunk = fmt == "nvfp4_ds_mla"
    workspace_rows = 320 if one_chunk else 64
    layer = MLAPrefill(TINY, CacheConfig(kv_cache_dtype=fmt, block_size=BLOCK), W.DenseWeight.from_dense(w, BF16),
                       layer=1, workspace_rows_override=workspace_rows, max_num_seqs=8)
    k_scale = torch.tensor(0.02 + 0.01 * seed, dtype=torch.float32)

    # The cache, written natively and through the surface: the same bytes.
    cache = batch.fill_cache(layer, k_scale)
    via_vllm = torch.empty_like(cache)
    via_vllm.fill_(0x7F) if via_vllm.dtype == torch.uint8 else via_vllm.fill_(float("nan"))
    ops.concat_and_cache_mla(torch.cat(batch.ctx_kv_c), torch.cat(batch.ctx_k_pe), via_vllm,
                             torch.cat(batch.slots), layer.kv_cache_dtype, k_scale)
    assert same_bits(via_vllm, cache)

    w_kv_b = layer.kv_b_proj.weight_format.dequantize_fp32().to(BF16)
    out, chunks = vllm_style_prefill(
        batch.q, batch.kv_c_new, batch.k_pe_new, via_vllm, layer.kv_cache_dtype, k_scale, batch.block_table,
        ctx_lens, q_lens, w_kv_b, layer.softmax_scale, workspace_rows, fp8_prefill=fp8_prefill,
        context_tokens_only=ctx_only, positional=seed % 2 == 1)
    assert chunks == 1 if one_chunk else chunks >= 2  # else the cross-chunk merge is exercised
    assert not out.isnan().any()

    meta = PrefillMetadata(batch.block_table, ctx_lens, q_lens, block_size=BLOCK)
    native = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, k_scale=k_scale)
    kv_c, k_pe = _cached_context(cache, layer.kv_cache_dtype, k_scale, batch.block_table, ctx_lens)
    oracle = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, q_lens,
                                   w_kv_b.float(), TINY.P, TINY.V, layer.softmax_scale)
    assert rel_fro(out, native) <= 1e-2, rel_fro(out, native)
    assert rel_fro(out, oracle) <= 1e-2 and rel_fro(native, oracle) <= 1e-2


# ---------------------------------------------------------------------------
# 6. On a GPU: the CUDA kernels behind the surface (skipped without one)
# ---------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_e5m2", "fp8_ds_mla"])
def test_cache_ops_on_cuda_match_cpu(fmt):
    """Every cache op of the surface on CUDA writes the bytes it writes on the CPU."""
    dev = torch.device("cuda")
    cache, ks, bt, cu, starts = _gather_inputs(fmt, 512, 64, 3)
    g = _gen(4)
    kv_c = (torch.randn(9, 512, generator=g) * 2).to(BF16)
    k_pe = torch.randn(9, 64, generator=g).to(BF16)
    slots = torch.randperm(cache.shape[0] * cache.shape[1], generator=g)[:9]
    on = {k: v.to(dev) for k, v in dict(kv_c=kv_c, k_pe=k_pe, slots=slots, ks=ks, bt=bt, cu=cu, starts=starts).items()}
    cpu_cache, gpu_cache = cache.clone(), cache.to(dev)
    ops.concat_and_cache_mla(kv_c, k_pe, cpu_cache, slots, fmt, ks)
    ops.concat_and_cache_mla(on["kv_c"], on["k_pe"], gpu_cache, on["slots"], fmt, on["ks"])
    assert same_bits(gpu_cache.cpu(), cpu_cache)
    toks = int(cu[-1])
    t2s = _token_to_seq(cu, 0)
    want, _ = poisoned_dst(toks, 576, BF16)
    ops.gather_and_maybe_dequant_cache(cpu_cache, want, bt, cu, t2s, toks, fmt, ks, starts)
    got = poisoned_dst(toks, 576, BF16)[0].to(dev)
    ops.gather_and_maybe_dequant_cache(gpu_cache, got, on["bt"], on["cu"], t2s.to(dev), toks, fmt, on["ks"],
                                       on["starts"])
    assert same_bits(got.cpu(), want)
    raw_want, _ = poisoned_dst(toks, cache.shape[2], cache.dtype)
    ops.cp_gather_cache(cpu_cache, raw_want, bt, cu, 4, starts)
    raw = poisoned_dst(toks, cache.shape[2], cache.dtype)[0].to(dev)
    ops.cp_gather_cache(gpu_cache, raw, on["bt"], on["cu"], 4, on["starts"])
    assert same_bits(raw.cpu(), raw_want)
    if fmt == "fp8_ds_mla":
        ws = cu[:-1].clone()
        up_want, _ = poisoned_dst(toks + 3, 576, BF16)
        ops.cp_gather_and_upconvert_fp8_kv_cache(cpu_cache, up_want, bt, ws, 4, starts)
        up = poisoned_dst(toks + 3, 576, BF16)[0].to(dev)
        ops.cp_gather_and_upconvert_fp8_kv_cache(gpu_cache, up, on["bt"], ws.to(dev), 4, on["starts"])
        assert same_bits(up.cpu(), up_want)


@pytest.mark.cuda
@pytest.mark.parametrize("p", [None, 5])
@pytest.mark.parametrize("scaled", [False, True])
def test_merge_on_cuda_matches_cpu(p, scaled):
    dev = torch.device("cuda")
    o1, lse1, o2, lse2 = _merge_inputs(9, 3, 40, BF16, seed=5)
    scale = torch.tensor(0.05) if scaled else None
    results = []
    for d in ("cpu", dev):
        out = torch.zeros(9, 3, 40, dtype=FP8 if scaled else BF16, device=d)
        out_lse = torch.full((3, 9), float("nan"), device=d)
        ops.merge_attn_states(out, o1.to(d), lse1.to(d), o2.to(d), lse2.to(d), out_lse, p,
                              scale.to(d) if scaled else None)
        results.append((out.cpu(), out_lse.cpu()))
    (a, a_lse), (b, b_lse) = results
    if scaled:
        assert (_e4m3_ordinal(a) - _e4m3_ordinal(b)).abs().max() <= 1
    else:
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(b_lse, a_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [("fp8", False, False), ("fp8_ds_mla", False, True), ("fp8", True, False)],
                         ids=lambda c: "-".join(map(str, c)))
def test_vllm_prefill_parity_cuda(case):
    """vLLM's call sequence on CUDA against MLAPrefill on CUDA and the CPU run."""
    dev = torch.device("cuda")
    fmt, fp8_prefill, ctx_only = case
    ctx_lens = [60, 25, 0, 0] if ctx_only else [60, 0, 25, 17]
    q_lens = [3, 2, 4, 1]
    batch = Batch(ctx_lens, q_lens, seed=1)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=_gen(1)) / math.sqrt(TINY.L)
    weight = W.DenseWeight.from_dense(w, BF16)
    layer = MLAPrefill(TINY, CacheConfig(kv_cache_dtype=fmt, block_size=BLOCK), weight.to(dev), layer=1,
                       workspace_rows_override=64, max_num_seqs=8)
    k_scale = torch.tensor(0.03, dtype=torch.float32)
    cache = batch.fill_cache(layer, k_scale)
    w_kv_b = weight.dequantize_fp32().to(BF16)
    args = (batch.q, batch.kv_c_new, batch.k_pe_new, cache, fmt, k_scale, batch.block_table, ctx_lens, q_lens)
    kw = dict(fp8_prefill=fp8_prefill, context_tokens_only=ctx_only)
    on_cpu, _ = vllm_style_prefill(*args, w_kv_b, layer.softmax_scale, 64, **kw)
    on_gpu, _ = vllm_style_prefill(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args),
                                   w_kv_b.to(dev), layer.softmax_scale, 64, **kw)
    meta = PrefillMetadata(batch.block_table.to(dev), ctx_lens, q_lens, block_size=BLOCK)
    native = layer(batch.q.to(dev), batch.kv_c_new.to(dev), batch.k_pe_new.to(dev), cache.to(dev), meta,
                   k_scale=k_scale.to(dev))
    assert not on_gpu.isnan().any()
    assert rel_fro(on_gpu.cpu(), native.cpu()) <= 1e-2
    assert rel_fro(on_gpu.cpu(), on_cpu) <= 1e-2
