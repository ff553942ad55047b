"""Offset arguments of the index-cache gathers and vLLM's upconvert gathers are checked on the
host path (CPU tensors) with an error naming the argument: cu_seq_lens negative / decreasing /
past the output, seq_starts negative, workspace_starts negative / decreasing / past dst, an
output too short. One checker (mla_ext.cache.checks.check_offsets / check_block_ids) serves
these and the latent gathers' validate=True. (tests/fuzz/fuzz_cases_offsets.py derives the same
cases for every op with offsets; these pin the messages.)"""
from __future__ import annotations

import pytest
import torch

from mla_ext.cache import checks
from mla_ext.sparse import index_cache as ic
from mla_ext.sparse import index_cache_torch as ict
from mla_ext.vllm import _custom_ops as vops

I32 = torch.int32
D, B = 32, 4
TABLE = torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=I32)


def _index_cache(fmt="bfloat16", nb=6):
    gen = torch.Generator().manual_seed(0)
    cache = ic.get_index_format(fmt).empty(nb, B, D, 8)
    ic.write_index_cache(torch.randn(nb * B, D, generator=gen), cache, torch.arange(nb * B), fmt,
                         quant_block_size=8 if fmt == "fp8" else None)
    return cache


BAD_CU = [
    ([-1, 4, 9], None, r"cu_seq_lens: entry 0 is -1, expected >= 0"),
    ([0, 6, 5], None, r"cu_seq_lens: request 1 has a negative length \(6 -> 5\)"),
    ([0, 4, 12], None, r"cu_seq_lens: request 1 ends at row 12 but (out|dst|dst_k) has 9 rows"),
    ([0, 4, 9], [-2, 0], r"seq_starts: request 0 starts at -2, expected >= 0"),
]


def _index_calls():
    """Every host path of the index gather: the API (torch / compiled CPU backend), the compiled op,
    the Triton function (its own host check: it is callable directly)."""
    from mla_ext.sparse import triton_index_cache

    def api(cache, cu, st, out):
        ic.gather_index_keys(cache, TABLE, cu, "bfloat16", seq_starts=st, head_dim=D, out=out)

    def raw_op(cache, cu, st, out):
        torch.ops.mla_ext.index_cache_gather(cache, out, TABLE, cu, "bfloat16", D, st)

    def triton(cache, cu, st, out):
        triton_index_cache.gather_index_keys_triton(cache, TABLE, cu, "bfloat16", seq_starts=st, head_dim=D, out=out)
    return {"api": api, "compiled_op": raw_op, "triton": triton}


@pytest.mark.parametrize("path", ["api", "compiled_op", "triton"])
@pytest.mark.parametrize("cu,starts,match", BAD_CU)
def test_index_gather_refuses_bad_offsets_naming_them(path, cu, starts, match):
    cache = _index_cache()
    out = torch.full((9, D), 7.0)
    with pytest.raises(ValueError, match=match):
        _index_calls()[path](cache, torch.tensor(cu, dtype=I32), None if starts is None else torch.tensor(
            starts, dtype=I32), out)
    assert out.eq(7.0).all()  # refused before anything was written


@pytest.mark.parametrize("path", ["api", "compiled_op"])
def test_index_gather_valid_offsets_still_match_the_reference(path):
    cache = _index_cache()
    cu, st = torch.tensor([0, 4, 9], dtype=I32), torch.tensor([1, 3], dtype=I32)
    out = torch.full((9, D), float("nan"))
    _index_calls()[path](cache, cu, st, out)
    want = torch.empty(9, D)
    ict._gather_torch(_ref_inputs(cache, cu, st, want))
    assert torch.equal(out, want)


def _ref_inputs(cache, cu, st, out):
    from mla_ext.sparse.index_cache_backends import IndexGatherInputs

    return IndexGatherInputs(cache, TABLE, cu, ic.get_index_format("bfloat16"), st, D, out)


@pytest.mark.parametrize("surface", ["core", "vllm"])
@pytest.mark.parametrize("cu,rows,match", [
    ([0, 6, 5], 9, r"cu_seq_lens: request 1 has a negative length"),
    ([-3, 4, 9], 9, r"cu_seq_lens: entry 0 is -3"),
    ([0, 4, 9], 7, r"cu_seq_lens: request 1 ends at row 9 but dst_k has 7 rows"),
])
def test_cp_gather_indexer_k_quant_cache_refuses_bad_offsets_and_a_short_dst_k(surface, cu, rows, match):
    cache = _index_cache("fp8")
    fn = ic.cp_gather_indexer_k_quant_cache if surface == "core" else vops.cp_gather_indexer_k_quant_cache
    dst_k, dst_scale = torch.full((rows, D), 3, dtype=torch.uint8), torch.full((rows, 16), 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        fn(cache, dst_k, dst_scale, TABLE, torch.tensor(cu, dtype=I32))
    assert dst_k.eq(3).all() and dst_scale.eq(3).all()


def _ds_mla_cache(fmt):
    from mla_ext.cache import api

    gen = torch.Generator().manual_seed(1)
    entry = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}[fmt]
    cache = torch.empty(6, B, entry, dtype=torch.uint8)
    api.concat_and_cache_mla(torch.randn(24, 512, generator=gen), torch.randn(24, 64, generator=gen), cache,
                             torch.arange(24), fmt, torch.ones(1))
    return cache


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("ws,match", [
    ([-1, 4], r"workspace_starts: request 0 starts at row -1, expected >= 0"),
    ([5, 4], r"workspace_starts: request 1 starts at row 4, before request 0 \(row 5\)"),
    ([0, 10], r"workspace_starts: request 1 starts at row 10, past the 9 rows of dst"),
])
def test_upconvert_refuses_bad_workspace_starts_naming_them(fmt, ws, match):
    cache = _ds_mla_cache(fmt)
    dst = torch.full((9, 576), 2.0, dtype=torch.bfloat16)
    op = getattr(vops, f"cp_gather_and_upconvert_{fmt.split('_')[0]}_kv_cache")
    with pytest.raises(ValueError, match=match):
        op(cache, dst, TABLE, torch.tensor(ws, dtype=I32), 2)
    assert dst.eq(2.0).all()


def test_upconvert_refuses_a_negative_seq_start_and_keeps_valid_ones():
    cache = _ds_mla_cache("fp8_ds_mla")
    dst = torch.full((9, 576), 2.0, dtype=torch.bfloat16)
    ws = torch.tensor([0, 4], dtype=I32)
    with pytest.raises(ValueError, match=r"seq_starts: request 1 starts at -1, expected >= 0"):
        vops.cp_gather_and_upconvert_fp8_kv_cache(cache, dst, TABLE, ws, 2, torch.tensor([0, -1], dtype=I32))
    assert dst.eq(2.0).all()
    from mla_ext.cache import reference as ref

    st = torch.tensor([3, 1], dtype=I32)
    vops.cp_gather_and_upconvert_fp8_kv_cache(cache, dst, TABLE, ws, 2, st)
    want = torch.empty_like(dst)
    ref.gather_ref(cache, want, TABLE, torch.tensor([0, 4, 9], dtype=I32), 2, "fp8_ds_mla", torch.ones(1), st)
    assert torch.equal(dst, want)


def test_one_offset_checker_vectorised_names_the_first_bad_request():
    cu = torch.tensor([0, 2, 2, 1, 0], dtype=I32)  # requests 2 and 3 negative: the first is named
    with pytest.raises(ValueError, match=r"cu_seq_lens: request 2 has a negative length \(2 -> 1\)"):
        checks.check_offsets(cu, 4)
    # a request without rows may carry any start (nothing is read for it)
    checks.check_offsets(torch.tensor([0, 0, 3], dtype=I32), 2, torch.tensor([-5, 0], dtype=I32), 3)
    big = torch.arange(0, 200_001, dtype=I32)  # 200k requests: one vectorised pass
    assert checks.check_block_ids(torch.zeros(200_000, 1, dtype=I32), big, 200_000, None, 1, 1) == 200_000


@pytest.mark.parametrize("op", ["gather_and_maybe_dequant_cache", "cp_gather_cache"])
@pytest.mark.parametrize("cu,starts,match", [
    ([0, 6, 5], None, r"cu_seq_lens: request 1 has a negative length"),
    ([0, 4, 12], None, r"cu_seq_lens: request 1 ends at row 12 but dst has 9 rows"),
    ([0, 4, 9], [0, -1], r"seq_starts: request 1 starts at -1"),
])
def test_vllm_latent_gathers_refuse_bad_offsets_on_the_host(op, cu, starts, match):
    cache = torch.randn(6, B, 512).to(torch.bfloat16)
    dst = torch.full((9, 512), 5.0, dtype=torch.bfloat16)
    cu_t, st = torch.tensor(cu, dtype=I32), None if starts is None else torch.tensor(starts, dtype=I32)
    with pytest.raises(ValueError, match=match):
        if op == "cp_gather_cache":
            vops.cp_gather_cache(cache, dst, TABLE, cu_t, 2, st)
        else:
            vops.gather_and_maybe_dequant_cache(cache, dst, TABLE, cu_t, torch.zeros(9, dtype=I32), 9, "auto",
                                                torch.ones(1), st)
    assert dst.eq(5.0).all()


@pytest.mark.parametrize("cu,starts,match", [
    ([0, 12, 10], None, r"cu_seq_lens: request 1 has a negative length \(12 -> 10\)"),
    ([0, 10, 21], [0, -4], r"seq_starts: request 1 starts at -4, expected >= 0"),
])
def test_absorbed_context_attention_refuses_bad_offset_tensors_on_the_host(cu, starts, match):
    from mla_ext.attention import latent as A

    cache = torch.randn(6, B, 80)
    q_lat, q_pe = torch.randn(2, 3, 64), torch.randn(3, 2, 16)
    q_off, c_off = [0, 2, 3], [0, 10, 21]  # the host ints are valid: the tensors are what is read
    with pytest.raises(ValueError, match=match):
        A.latent_context_attention(q_lat, q_pe, cache, "auto", TABLE, torch.tensor(q_off, dtype=I32),
                                   torch.tensor(cu, dtype=I32), None if starts is None else torch.tensor(
                                       starts, dtype=I32), None, 0.125, q_offsets=q_off, ctx_offsets=c_off)
