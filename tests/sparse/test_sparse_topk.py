"""Chunked indexer scoring + running top-k (mla_ext/sparse/topk.py) against the float64 oracle,
keys from the paged index cache in both formats, chunks and query blocks far smaller than the
context; and the Triton scorer under the interpreter."""
import pytest
import torch

from mla_ext.sparse import index_cache as ic
from mla_ext.sparse import reference as ref
from mla_ext.sparse.topk import indexer_topk
from helpers.sparse_cache import paged_layout
from helpers.sparse import tie_equivalent

H, D, B = 4, 32, 8
Q_LENS, CTX_LENS = [9, 1, 14, 6], [37, 0, 50, 3]


def _batch(fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = sum(Q_LENS)
    q = torch.randn(T, H, D, generator=g)
    w = torch.randn(T, H, generator=g)
    k_new = torch.randn(T, D, generator=g)
    k_ctx = [torch.randn(c, D, generator=g) for c in CTX_LENS]
    table, nb, slots = paged_layout(CTX_LENS, B, seed=seed)
    cache = ic.get_index_format(fmt).empty(nb, B, D, D).fill_(0)
    ic.write_index_cache(torch.cat(k_ctx), cache, torch.cat(slots), fmt)
    cu = torch.tensor([0] + torch.tensor(CTX_LENS).cumsum(0).tolist(), dtype=torch.int32)
    stored = ic.gather_index_keys(cache, table, cu, fmt, head_dim=D)  # what the cache holds
    keys, at, qs = [], 0, 0
    for c, qn in zip(CTX_LENS, Q_LENS):
        keys.append(torch.cat([stored[at:at + c], k_new[qs:qs + qn]]))
        at, qs = at + c, qs + qn
    return q, w, k_new, cache, table, keys


@pytest.mark.parametrize("fmt,chunk,qblock", [("bfloat16", 7, 5), ("fp8", 64, 256), ("fp8", 1, 3)])
def test_chunked_topk_equals_reference(fmt, chunk, qblock):
    q, w, k_new, cache, table, keys = _batch(fmt)
    for topk in (16, 200):
        got = indexer_topk(q, w, k_new, cache, table, Q_LENS, CTX_LENS, topk, index_cache_dtype=fmt,
                           chunk=chunk, query_block=qblock, compute_dtype=torch.float64)
        want = ref.select_reference(q, keys, w, Q_LENS, CTX_LENS, topk)
        scores = torch.cat([torch.nn.functional.pad(s, (0, 64 - s.shape[1]), value=float("-inf"))
                            for s in ref.indexer_scores_reference(q, keys, w, Q_LENS, CTX_LENS)])
        assert tie_equivalent(got, want, scores, rtol=1e-9) == []
        assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))  # same padding


def test_fp32_matches_reference_up_to_near_ties():
    q, w, k_new, cache, table, keys = _batch("bfloat16", seed=1)
    got = indexer_topk(q, w, k_new, cache, table, Q_LENS, CTX_LENS, 16, chunk=16, query_block=4)
    want = ref.select_reference(q, keys, w, Q_LENS, CTX_LENS, 16)
    scores = torch.cat([torch.nn.functional.pad(s, (0, 64 - s.shape[1]), value=float("-inf"))
                        for s in ref.indexer_scores_reference(q, keys, w, Q_LENS, CTX_LENS)])
    assert tie_equivalent(got, want, scores, rtol=1e-5) == []


def test_ties_go_to_the_lower_position_across_chunks():
    q, w, k_new, cache, table, _ = _batch("bfloat16")
    zero = torch.zeros_like(q)  # every score exactly 0
    got = indexer_topk(zero, w, k_new, cache, table, Q_LENS, CTX_LENS, 5, chunk=3, query_block=2)
    for t, (r, i) in enumerate((r, i) for r, n in enumerate(Q_LENS) for i in range(n)):
        n_vis = CTX_LENS[r] + i + 1
        want = list(range(min(5, n_vis))) + [-1] * max(0, 5 - n_vis)
        assert got[t].tolist() == want


def test_no_context_and_errors():
    q, w, k_new = torch.randn(3, H, D), torch.randn(3, H), torch.randn(3, D)
    got = indexer_topk(q, w, k_new, None, None, [3], [0], 2)
    assert got[0].tolist() == [0, -1]
    with pytest.raises(ValueError, match="index_cache"):
        indexer_topk(q, w, k_new, None, None, [3], [4], 2)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, w, k_new, None, None, [3], [0], 0)
    with pytest.raises(ValueError, match="k_new"):
        indexer_topk(q, w, k_new[:2], None, None, [3], [0], 2)
    with pytest.raises(ValueError, match="out"):
        indexer_topk(q, w, k_new, None, None, [3], [0], 2, out=torch.empty(3, 2, dtype=torch.int64))


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
def test_triton_scorer_under_the_interpreter(fmt):
    q, w, k_new, cache, table, keys = _batch(fmt, seed=2)
    got = indexer_topk(q, w, k_new, cache, table, Q_LENS, CTX_LENS, 16, index_cache_dtype=fmt, chunk=40,
                       query_block=16, backend="triton")
    want = ref.select_reference(q, keys, w, Q_LENS, CTX_LENS, 16)
    scores = torch.cat([torch.nn.functional.pad(s, (0, 64 - s.shape[1]), value=float("-inf"))
                        for s in ref.indexer_scores_reference(q, keys, w, Q_LENS, CTX_LENS)])
    assert tie_equivalent(got, want, scores, rtol=1e-5) == []


def test_triton_scores_equal_the_reference_scores():
    from mla_ext.sparse.triton_indexer import score_range_triton

    q, w, k_new, cache, table, keys = _batch("fp8", seed=4)
    r, c, qn, q0 = 2, CTX_LENS[2], Q_LENS[2], sum(Q_LENS[:2])
    out = torch.full((qn, 34), float("nan"))
    score_range_triton(q[q0:q0 + qn], w[q0:q0 + qn], cache, True, table[r], k_new[q0:q0 + qn], c, 30, 64, c, D,
                       out=out)
    want = ref.indexer_scores_reference(q[q0:q0 + qn], [keys[r]], w[q0:q0 + qn], [qn], [c])[0][:, 30:64]
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(out[fin].double(), want[fin], rtol=1e-5, atol=1e-5)


def test_tie_keys_order_is_the_tie_rule():
    from mla_ext.sparse.topk import tie_keys

    s = torch.tensor([[0.0, -0.0, 1.5, -2.0, float("-inf"), 1.5, -1e-30, 3e38, -3e38, 0.0]])
    pos = torch.arange(s.shape[1])[None]
    order = torch.topk(tie_keys(s, pos), s.shape[1], dim=1).indices[0].tolist()
    want = sorted(range(s.shape[1]), key=lambda i: (-float(s[0, i]), i))
    assert order == want
