"""Context-parallel gather (mla_ext.prefill.context_parallel), SPEC §6.

A "world" holds the same random tokens twice: in one global paged cache (what a
single rank would have) and split over cp_size local caches by the interleaved
rule. The CP gather (local gathers, all-gather, reorder) must equal the
single-rank gather of the same chunks, bit for bit. Two real processes over
gloo test the all-gather; the rest is simulated in-process.
"""
from __future__ import annotations

import random

import pytest
import torch

from mla_ext.prefill import context_parallel as cp
from mla_ext.cache import reference as ref
from mla_ext.config.formats import get_format
from helpers.dist import run_on_gloo_ranks
from helpers.numeric import same_bits


def _table(rng, num_reqs, need_blocks, pool):
    """Per request, `need` distinct shuffled block ids from `pool` ids; -1 padded."""
    ids = list(range(pool))
    rng.shuffle(ids)
    width = max(need_blocks + [1])
    table, used = [], 0
    for n in need_blocks:
        table.append(ids[used: used + n] + [-1] * (width - n))
        used += n
    return torch.tensor(table, dtype=torch.int32)


def make_world(seed, fmt, ctx_lens, cp_size, interleave, B=16, L=512, R=64):
    """(global cache, global table, [(local cache, local table)] per rank, k_scale)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    f = get_format(fmt)
    dtype = f.storage_dtype(torch.bfloat16)
    entry = f.entry_elems(L, R)
    ks = torch.tensor([0.02])
    tokens = [(torch.randn(n, L, generator=gen), torch.randn(n, R, generator=gen)) for n in ctx_lens]

    def fill(lens_per_req, positions_per_req):
        need = [-(-n // B) for n in lens_per_req]
        table = _table(rng, len(lens_per_req), need, sum(need) + 2)
        cache = torch.empty(sum(need) + 2, B, entry, dtype=dtype)
        cache.view(torch.uint8).fill_(0x5A)
        for r, pos in enumerate(positions_per_req):
            if not pos:
                continue
            j = torch.arange(len(pos))
            slots = table[r].long()[j // B] * B + j % B
            kv_c, k_pe = tokens[r]
            idx = torch.tensor(pos)
            ref.concat_and_cache_mla_ref(kv_c[idx].bfloat16(), k_pe[idx].bfloat16(), cache, slots,
                                         fmt, ks)
        return cache, table

    glob = fill(ctx_lens, [list(range(n)) for n in ctx_lens])
    local = []
    for k in range(cp_size):
        pos = [[p for p in range(n) if cp.cp_rank_of(p, cp_size, interleave) == k] for n in ctx_lens]
        local.append(fill([len(p) for p in pos], pos))
    return glob, local, ks


def _chunks(rng, ctx_lens):
    starts = [rng.randint(0, n) for n in ctx_lens]
    lens = [rng.randint(0, n - s) for s, n in zip(starts, ctx_lens)]
    return lens, starts


def _want(glob, lens, starts, fmt, ks, dtype, width):
    cache, table = glob
    cu = torch.tensor(cp._cumsum0(lens), dtype=torch.int32)
    out = torch.full((sum(lens), width), float("nan"), dtype=dtype)
    ref.gather_ref(cache, out, table, cu, len(lens), fmt, ks, torch.tensor(starts, dtype=torch.int32))
    return out


def test_local_lens_and_index_match_brute_force():
    for cp_size in (1, 2, 3, 4):
        for interleave in (1, 2, 5, 16):
            for n in range(0, 3 * cp_size * interleave + 7):
                owners = [cp.cp_rank_of(p, cp_size, interleave) for p in range(n)]
                for k in range(cp_size):
                    mine = [p for p in range(n) if owners[p] == k]
                    assert cp.cp_local_lens(n, cp_size, k, interleave) == len(mine)
                    assert [cp.cp_local_index(p, cp_size, interleave) for p in mine] == list(range(len(mine)))
            lens = torch.arange(0, 50)
            for k in range(cp_size):
                assert cp.cp_local_lens(lens, cp_size, k, interleave).tolist() == \
                    cp.cp_local_lens(lens.tolist(), cp_size, k, interleave)
    with pytest.raises(ValueError, match="rank"):
        cp.cp_local_lens(5, 2, 2, 1)
    with pytest.raises(ValueError, match="interleave"):
        cp.cp_local_lens(5, 2, 0, 0)


@pytest.mark.parametrize("fmt,cp_size,interleave", [
    ("fp8", 2, 1), ("fp8_ds_mla", 3, 16), ("bfloat16", 4, 5), ("fp8_e5m2", 2, 64),
])
def test_simulated_cp_equals_single_rank(fmt, cp_size, interleave):
    """Local gathers + stack (the all-gather) + reorder == global gather; also the loop reference."""
    rng = random.Random(cp_size * 100 + interleave)
    ctx_lens = [0, 1, 37, 130, 77][: 2 + cp_size]
    glob, local, ks = make_world(7, fmt, ctx_lens, cp_size, interleave)
    dtype = torch.bfloat16
    width = 576
    for _ in range(3):
        lens, starts = _chunks(rng, ctx_lens)
        want = _want(glob, lens, starts, fmt, ks, dtype, width)
        padded = cp.cp_padded_rows(lens, starts, cp_size, interleave)
        per_rank, stacked = [], torch.full((cp_size, max(padded, 1), width), float("nan"), dtype=dtype)
        for k, (cache, table) in enumerate(local):
            ll, ls = cp.cp_local_chunk(lens, starts, cp_size, k, interleave)
            buf = stacked[k, : sum(ll)]
            ref.gather_ref(cache, buf, table, torch.tensor(cp._cumsum0(ll), dtype=torch.int32),
                           len(lens), fmt, ks, torch.tensor(ls, dtype=torch.int32))
            per_rank.append(buf)
        assert same_bits(cp.cp_reorder_ref(per_rank, lens, starts, cp_size, interleave), want)
        assert same_bits(cp.cp_reorder(stacked, lens, starts, cp_size, interleave), want)


def test_cp_size_one_is_a_plain_gather():
    glob, _, ks = make_world(3, "fp8", [20, 50], 1, 1)
    dst = torch.full((80, 576), float("nan"))
    got = cp.cp_gather_context(glob[0], dst, glob[1], [20, 30], "fp8", ks, cp_size=1, rank=0,
                               interleave=1, seq_starts=[0, 20], gather=ref.gather_ref)
    assert got.data_ptr() == dst.data_ptr() and got.shape == (50, 576)
    assert same_bits(got, _want(glob, [20, 30], [0, 20], "fp8", ks, torch.float32, 576))
    assert dst[50:].isnan().all()
    with pytest.raises(ValueError, match="dst"):
        cp.cp_gather_context(glob[0], dst[:10], glob[1], [20, 30], "fp8", ks, cp_size=1, rank=0,
                             interleave=1)


# -- two processes over gloo --------------------------------------------------

CASES = [  # (fmt, interleave, gather backend, dst dtype, fixed chunk lens or None: random)
    ("fp8", 1, "reference", torch.bfloat16, None),
    ("fp8_ds_mla", 16, "triton", torch.bfloat16, None),
    ("bfloat16", 3, "triton", torch.bfloat16, None),
    ("fp8_e5m2", 5, "api", torch.float32, None),  # the default: the public op
    ("fp8", 64, "triton", torch.float32, [0, 0, 0, 0]),  # nothing to gather on any rank
    ("fp8", 64, "triton", torch.float32, [40, 0, 60, 1]),  # rank 1 holds no row of the chunks
]


def _worker(rank: int, world: int) -> None:
    from mla_ext.cache.triton_gather import gather_triton
    gathers = {"reference": ref.gather_ref, "triton": gather_triton, "api": None}
    for i, (fmt, interleave, backend, dtype, fixed) in enumerate(CASES):
        ctx_lens = [45, 0, 130, 1]
        glob, local, ks = make_world(11 + i, fmt, ctx_lens, world, interleave)
        lens, starts = _chunks(random.Random(i), ctx_lens)
        if fixed is not None:
            lens, starts = fixed, [0] * len(fixed)
        dst = torch.full((sum(lens) + 4, 576), float("nan"), dtype=dtype)
        cache, table = local[rank]
        got = cp.cp_gather_context(cache, dst, table, lens, fmt, ks, cp_size=world, rank=rank,
                                   interleave=interleave, seq_starts=starts,
                                   gather=gathers[backend])
        want = _want(glob, lens, starts, fmt, ks, dtype, 576)
        if dtype == torch.bfloat16 and backend == "triton":
            # Interpreter stores round toward zero: within one bf16 ulp.
            ok = torch.allclose(got.float(), want.float(), rtol=2.0**-7, atol=0)
        else:
            ok = same_bits(got, want)
        assert ok, f"rank {rank}: case {CASES[i]} differs from the single-rank gather"
        assert dst[sum(lens):].isnan().all(), "rows past the chunk were written"


def test_two_ranks_over_gloo_equal_single_rank_gather():
    run_on_gloo_ranks(_worker, world=2)


@pytest.mark.parametrize("kw, match", [
    (dict(cp_size=True), "cp_size"), (dict(interleave=True), "interleave"), (dict(rank=False), "rank"),
    (dict(cp_size=2.0), "cp_size"),
])
def test_cp_arguments_reject_bools_and_floats(kw, match):
    args = dict(cp_size=2, rank=0, interleave=1)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        cp.cp_local_lens(10, args["cp_size"], args["rank"], args["interleave"])
