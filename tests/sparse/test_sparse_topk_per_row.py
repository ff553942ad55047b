"""vLLM _C's DSA top-k ops on the mla_ext_vllm surface (mla_ext/vllm/_indexer_ops.py over
mla_ext/sparse/topk_per_row.py): vLLM's signatures, indices relative to the row start, -1 padding,
the decode next_n rule, against the oracle's selection (mla_ext/sparse/indexer_ops_reference.py) on
seeded random logits with outputs poisoned first; ties allowed to differ only among equal scores."""
import pytest
import torch

from mla_ext.sparse.indexer_ops_reference import decode_row_ends, top_k_per_row_reference
from mla_ext.vllm import _indexer_ops as ops

SIGS = {
    "top_k_per_row_prefill": (["logits", "cu_seqlen_ks", "cu_seqlen_ke", "raw_topk_indices", "num_rows", "stride0",
                               "stride1", "topk_tokens"], {"raw_topk_indices"}),
    "top_k_per_row_decode": (["logits", "next_n", "seq_lens", "raw_topk_indices", "num_rows", "stride0", "stride1",
                              "topk_tokens"], {"raw_topk_indices"}),
    "persistent_topk": (["logits", "lengths", "output", "workspace", "k", "max_seq_len"], {"output", "workspace"}),
}


@pytest.mark.parametrize("name", sorted(SIGS))
def test_signature_is_vllms(name):
    schema = getattr(torch.ops.mla_ext_vllm, name).default._schema
    assert [a.name for a in schema.arguments] == SIGS[name][0] and not schema.returns
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == SIGS[name][1]
    fn = getattr(ops, name)  # the routed plain function: vLLM's name, mla_ext's module
    assert fn.__module__ == "mla_ext.vllm._indexer_ops" and fn.__name__ == name


def same_up_to_ties(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, starts) -> None:
    """Row by row: equal -1 counts and equal selected sets, except that entries may be swapped for
    others of the same score as the smallest selected one (the k-th)."""
    for m in range(got.shape[0]):
        g, w = got[m], want[m]
        assert int((g == -1).sum()) == int((w == -1).sum()), m
        gs, ws = set(g[g >= 0].tolist()), set(w[w >= 0].tolist())
        assert len(gs) == int((g >= 0).sum()), f"row {m}: repeated indices"
        if gs == ws:
            continue
        s0 = int(starts[m])
        val = lambda i: float(logits[m, s0 + i])  # noqa: E731
        kth = min(val(i) for i in ws)
        assert all(val(i) == kth for i in gs ^ ws), f"row {m}: differs beyond ties"


def _logits(M, W, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, W, generator=g)
    if ties:
        x = (x * 2).round() / 2  # many equal values
    return x


@pytest.mark.parametrize("ties", [False, True])
def test_prefill_rows_relative_to_their_start(ties):
    M, W, k = 7, 90, 16
    lg = _logits(M, W, 0, ties)
    ks = torch.tensor([0, 5, 10, 40, 40, 0, 89], dtype=torch.int32)
    ke = torch.tensor([90, 12, 10, 80, 56, 16, 90], dtype=torch.int32)  # rows of 7, 0, 16, 1 columns
    out = torch.full((M + 2, k + 3), 0x7EEE, dtype=torch.int32)
    ops.top_k_per_row_prefill(lg, ks, ke, out[:M, :k], M, lg.stride(0), lg.stride(1), k)
    assert bool((out[M:] == 0x7EEE).all()) and bool((out[:, k:] == 0x7EEE).all())  # nothing past the view
    same_up_to_ties(out[:M, :k], top_k_per_row_reference(lg, ks, ke, k), lg, ks)
    assert out[2, :k].tolist() == [-1] * k and sorted(out[1, :7].tolist()) == list(range(7))


def test_decode_next_n_rule_and_per_row_lengths():
    B, next_n, W, k = 4, 3, 64, 8
    lg = _logits(B * next_n, W, 1)
    for seq_lens in (torch.tensor([[2], [10], [64], [0]], dtype=torch.int32),
                     torch.randint(0, W + 1, (B, next_n), dtype=torch.int32)):
        out = torch.full((B * next_n, k), 0x7EEE, dtype=torch.int32)
        ops.top_k_per_row_decode(lg, next_n, seq_lens, out, B * next_n, W, 1, k)
        ends = decode_row_ends(seq_lens, next_n, B * next_n)
        same_up_to_ties(out, top_k_per_row_reference(lg, torch.zeros_like(ends), ends, k), lg, [0] * (B * next_n))
    assert decode_row_ends(torch.tensor([[2], [10]]), 3, 6).tolist() == [0, 1, 2, 8, 9, 10]


def test_persistent_topk_contract():
    M, W, k = 5, 1100, 512
    lg = _logits(M, W, 2)
    lengths = torch.tensor([0, 100, 512, 700, 1100], dtype=torch.int32)
    out = torch.full((M, k), 0x7EEE, dtype=torch.int32)
    ws = torch.zeros(16, dtype=torch.uint8)
    ops.persistent_topk(lg, lengths, out, ws, k, 1100)
    same_up_to_ties(out, top_k_per_row_reference(lg, torch.zeros(M), lengths, k), lg, [0] * M)


def test_errors_name_the_argument():
    lg = torch.randn(3, 10)
    out = torch.zeros(3, 4, dtype=torch.int32)
    ks, ke = torch.zeros(3, dtype=torch.int32), torch.full((3,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="logits: expected a 2-D float32"):
        ops.top_k_per_row_prefill(lg.double(), ks, ke, out, 3, 10, 1, 4)
    with pytest.raises(ValueError, match="stride0 / stride1"):
        ops.top_k_per_row_prefill(lg, ks, ke, out, 3, 11, 1, 4)
    with pytest.raises(ValueError, match="raw_topk_indices: expected int32"):
        ops.top_k_per_row_prefill(lg, ks, ke, out.long(), 3, 10, 1, 4)
    with pytest.raises(ValueError, match="raw_topk_indices: expected int32"):
        ops.top_k_per_row_decode(lg, 1, ke, out, 3, 10, 1, 5)
    with pytest.raises(ValueError, match="seq_lens: expected"):
        ops.top_k_per_row_decode(lg, 2, ke[:1], out, 3, 10, 1, 4)
    with pytest.raises(ValueError, match="lengths: expected one entry per logits row"):
        ops.persistent_topk(lg, ke[:2], out, torch.zeros(1, dtype=torch.uint8), 4, 10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_the_cpu_selection():
    M, W, k = 40, 5000, 2048
    lg = _logits(M, W, 3)
    ke = torch.randint(1, W + 1, (M,), dtype=torch.int32)
    ks = torch.zeros(M, dtype=torch.int32)
    out = torch.full((M, k), 0x7EEE, dtype=torch.int32, device="cuda")
    ops.top_k_per_row_prefill(lg.cuda(), ks.cuda(), ke.cuda(), out, M, W, 1, k)
    same_up_to_ties(out.cpu(), top_k_per_row_reference(lg, ks, ke, k), lg, ks)
