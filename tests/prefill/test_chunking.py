"""The context chunk planner (SPEC §8): workspace sizing and every packing invariant."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_ext.prefill import chunking
from mla_ext.prefill.chunking import plan_context_chunks, plan_from_config, workspace_rows


# ---------------------------------------------------------------------------
# Workspace sizing
# ---------------------------------------------------------------------------

def test_workspace_default_formula():
    # 8 * max_model_len dominates, below the cap
    assert workspace_rows(1024, 16, 16) == 8192
    # 4 * max_num_seqs * B dominates
    assert workspace_rows(100, 256, 64) == 4 * 256 * 64
    # capped at 65,536
    assert workspace_rows(163_840, 256, 64) == 65_536
    # rounded up to B
    assert workspace_rows(1001, 1, 64) == 8064  # 8008 -> 8064
    # a tiny model still gets 4 blocks per sequence
    assert workspace_rows(1, 1, 64) == 256
    # under context parallelism, at least one alignment unit: lcm(16, 8 * 64) = 512
    assert workspace_rows(1, 1, 16, cp_size=8, cp_interleave=64) == 512


def test_workspace_context_parallel_alignment_and_override():
    # lcm(B=64, cp 4 * I 48 = 192) = 192
    assert chunking.workspace_alignment(64, 4, 48) == 192
    w = workspace_rows(163_840, 256, 64, cp_size=4, cp_interleave=48)
    assert w % 192 == 0 and 65_536 <= w < 65_536 + 192
    assert workspace_rows(4096, 8, 16, override=1000) == 1008  # rounded up to B
    assert workspace_rows(4096, 8, 16, override=2048) == 2048
    for bad in (0, -16, 1.5, True):
        with pytest.raises(ValueError, match="override"):
            workspace_rows(4096, 8, 16, override=bad)
    with pytest.raises(ValueError, match="block_size"):
        workspace_rows(4096, 8, 0)
    with pytest.raises(ValueError, match="cp_size"):
        workspace_rows(4096, 8, 16, cp_size=0)


# ---------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------

def check_plan(plan, ctx, qlens):
    """Asserts every SPEC §8 invariant; returns the number of chunks."""
    W, A = plan.workspace_rows, plan.alignment
    qsl = [0]
    for x in qlens:
        qsl.append(qsl[-1] + x)
    seen = [[] for _ in ctx]  # per request: (seq_start, len) pieces in chunk order
    first_chunk_of = {}
    for i, c in enumerate(plan.chunks):
        assert c.index == i
        assert 0 < c.total_rows <= W, "a chunk exceeds the workspace (or is empty)"
        assert len(c.seq_starts) == len(c.chunk_lens) == c.num_reqs
        assert list(c.cu_seq_lens) == [0] + list(torch.tensor(c.chunk_lens).cumsum(0).tolist())
        assert c.chunk_lens[0] > 0 and c.chunk_lens[-1] > 0
        # query rows: the requests' slice of the prefill batch
        assert (c.token_start, c.token_end) == (qsl[c.req_start], qsl[c.req_end])
        assert [c.token_start + x for x in c.cu_seqlens_q] == qsl[c.req_start : c.req_end + 1]
        for j, r in enumerate(c.req_ids):
            s, n = c.seq_starts[j], c.chunk_lens[j]
            if ctx[r] == 0:
                assert n == 0
                continue
            assert n > 0, "a request with context takes no rows inside its chunk"
            continues = r in first_chunk_of
            # only the first request of a chunk can continue an earlier chunk
            assert not continues or j == 0
            if j == 0:
                assert c.is_continuation == continues
                assert c.merge_token_end == (qsl[r + 1] if continues else c.token_start)
            if s % A:
                raise AssertionError(f"split point {s} of request {r} is not a multiple of {A}")
            first_chunk_of.setdefault(r, i)
            seen[r].append((s, n))
    # every context row of every request gathered exactly once, in order
    for r, pieces in enumerate(seen):
        rows = []
        for s, n in pieces:
            rows.extend(range(s, s + n))
        assert rows == list(range(ctx[r])), f"request {r}: rows {pieces} != 0..{ctx[r]}"
    assert set(plan.no_context_req_ids) == {r for r, x in enumerate(ctx) if x == 0}
    covered = {r for c in plan.chunks for r in c.req_ids}
    assert set(plan.empty_req_ids) == set(plan.no_context_req_ids) - covered
    # every non-last chunk is nearly full, which bounds the chunk count
    for c in plan.chunks[:-1]:
        assert c.total_rows > W - A
    total = sum(ctx)
    assert len(plan.chunks) <= math.ceil(total / (W - A + 1))
    return len(plan.chunks)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    block=st.sampled_from([1, 16, 64]),
    blocks_per_w=st.integers(1, 12),
)
def test_plan_invariants_property(data, block, blocks_per_w):
    W = block * blocks_per_w
    n = data.draw(st.integers(0, 24))
    ctx = data.draw(st.lists(st.one_of(st.just(0), st.integers(0, 3 * W)), min_size=n, max_size=n))
    qlens = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    plan = plan_context_chunks(ctx, qlens, W, block)
    check_plan(plan, ctx, qlens)


@pytest.mark.parametrize("W", [65_536, 8_192, 2_048])
@pytest.mark.parametrize("short", [16, 100, 2_000])
def test_one_long_request_plus_31_short_does_not_take_30_chunks(W, short):
    ctx = [60_000] + [short] * 31
    qlens = [8] * 32
    plan = plan_context_chunks(ctx, qlens, W, 16)
    n = check_plan(plan, ctx, qlens)
    total = sum(ctx)
    assert n <= math.ceil(total / W) + 1, f"{n} chunks for {total} rows in a {W}-row workspace"
    if W == 65_536 and short == 16:
        assert n == 1  # 60,496 rows fit in one chunk
    # the long request last, too
    plan = plan_context_chunks(ctx[::-1], qlens, W, 16)
    assert check_plan(plan, ctx[::-1], qlens) <= math.ceil(total / W) + 1


def test_known_layouts():
    # upstream test shapes: [960, 16 x 7] and [2048, 320] in a 1,024-row workspace
    plan = plan_context_chunks([960] + [16] * 7, [1] * 8, 1024, 16)
    check_plan(plan, [960] + [16] * 7, [1] * 8)
    assert [c.chunk_lens for c in plan.chunks] == [(960, 16, 16, 16, 16), (16, 16, 16)]
    assert not plan.chunks[1].is_continuation
    plan = plan_context_chunks([2048, 320], [3, 2], 1024, 16)
    assert [(c.req_start, c.seq_starts, c.chunk_lens) for c in plan.chunks] == [
        (0, (0,), (1024,)),
        (0, (1024,), (1024,)),
        (1, (0,), (320,)),
    ]
    assert plan.chunks[1].is_continuation and plan.chunks[1].merge_token_end == 3
    # zero-context requests: skipped at the edges, carried with 0 keys inside a chunk
    plan = plan_context_chunks([0, 4, 0, 2, 0], [1, 2, 3, 4, 5], 64, 16)
    assert len(plan.chunks) == 1
    c = plan.chunks[0]
    assert (c.req_start, c.req_end, c.chunk_lens, c.cu_seq_lens) == (1, 4, (4, 0, 2), (0, 4, 4, 6))
    assert (c.token_start, c.token_end, c.cu_seqlens_q) == (1, 10, (0, 2, 5, 9))
    assert plan.empty_req_ids == (0, 4) and plan.no_context_req_ids == (0, 2, 4)
    # a request that does not fit splits at a block boundary inside the free room
    plan = plan_context_chunks([40, 100], [1, 1], 64, 16)
    assert [(c.req_start, c.seq_starts, c.chunk_lens) for c in plan.chunks] == [
        (0, (0, 0), (40, 16)),
        (1, (16,), (64,)),
        (1, (80,), (20,)),
    ]
    # no context at all: no chunks
    assert plan_context_chunks([0, 0], [3, 3], 64, 16).chunks == ()


def test_chunk_tensors_and_config_entry():
    plan = plan_from_config([100, 7], [5, 6], max_model_len=16, max_num_seqs=1, block_size=16)
    assert plan.workspace_rows == 128
    c = plan.chunks[0]
    t = c.tensors("cpu")
    assert t.cu_seq_lens.dtype == torch.int32 and t.cu_seq_lens.tolist() == [0, 100, 107]
    assert t.seq_starts.tolist() == [0, 0] and t.cu_seqlens_q.tolist() == [0, 5, 11]
    assert (c.max_seq_len, c.max_query_len, c.total_rows) == (100, 6, 107)


def test_plan_errors():
    with pytest.raises(ValueError, match="query_lens.*entries"):
        plan_context_chunks([1, 2], [1], 64, 16)
    with pytest.raises(ValueError, match="context_lens"):
        plan_context_chunks([-1], [1], 64, 16)
    with pytest.raises(ValueError, match="workspace_rows.*multiple"):
        plan_context_chunks([1], [1], 72, 16)
    with pytest.raises(ValueError, match="alignment"):
        plan_context_chunks([1], [1], 64, 0)


def test_plan_drives_gather_and_attention_end_to_end():
    """Following a plan (gather rows by seq_starts/cu_seq_lens, attend, merge)
    reproduces attention over each request's whole context."""
    from mla_ext.attention import merge_attn_states, varlen_attention

    g = torch.Generator().manual_seed(0)
    ctx, qlens = [70, 0, 5, 33, 0], [3, 2, 4, 1, 2]
    n, d = 2, 16
    keys = [torch.randn(x, n, d, generator=g) for x in ctx]
    vals = [torch.randn(x, n, d, generator=g) for x in ctx]
    q = torch.randn(sum(qlens), n, d, generator=g)
    plan = plan_context_chunks(ctx, qlens, 32, 16)
    acc_o = torch.zeros(q.shape[0], n, d)
    acc_lse = torch.full((n, q.shape[0]), float("-inf"))
    for c in plan.chunks:
        t = c.tensors()
        k = torch.cat([keys[r][s : s + m] for r, s, m in zip(c.req_ids, c.seq_starts, c.chunk_lens)])
        v = torch.cat([vals[r][s : s + m] for r, s, m in zip(c.req_ids, c.seq_starts, c.chunk_lens)])
        o, lse = varlen_attention(q[c.token_start : c.token_end], k, v, t.cu_seqlens_q, t.cu_seq_lens,
                                  c.max_query_len, c.max_seq_len, 0.25, causal=False)
        so, sl = acc_o[c.token_start : c.token_end], acc_lse[:, c.token_start : c.token_end]
        merge_attn_states(so, sl, o, lse, out=so, out_lse=sl)
    cuk = torch.tensor([0] + torch.tensor(ctx).cumsum(0).tolist(), dtype=torch.int32)
    cuq = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    full_o, full_lse = varlen_attention(q, torch.cat(keys), torch.cat(vals), cuq, cuk, 4, 70, 0.25, causal=False)
    assert torch.allclose(acc_o, full_o, atol=1e-5)
    assert torch.equal(torch.isneginf(acc_lse), torch.isneginf(full_lse))
    fin = torch.isfinite(full_lse)
    assert torch.allclose(acc_lse[fin], full_lse[fin], atol=1e-5)


@pytest.mark.parametrize("bad", [5.5, True, "7", None])
def test_lengths_must_be_ints(bad):
    """int(5.5) would plan 5 rows of a 5.5-row context: lengths are checked, not coerced."""
    with pytest.raises(ValueError, match=r"context_lens\[1\]: expected an int >= 0"):
        plan_context_chunks([4, bad], [1, 1], 16, 4)
    with pytest.raises(ValueError, match=r"query_lens\[0\]: expected an int >= 0"):
        plan_context_chunks([4, 4], [bad, 1], 16, 4)


def test_numpy_ints_are_lengths():
    np = pytest.importorskip("numpy")
    plan = plan_context_chunks(np.array([4, 8]), np.array([1, 2]), 16, 4)
    assert plan.chunks[0].chunk_lens == (4, 8)
