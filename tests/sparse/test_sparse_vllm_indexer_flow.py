"""vLLM 0.33's DSA indexer chain on mla_ext's ops, as its sparse_attn_indexer runs them: keys written
into the fp8 index cache (indexer_k_quant_and_cache), prefill = raw gather (cp_gather_indexer_k_quant_cache)
-> compressed logits (fp8_fp4_mqa_logits) -> top_k_per_row_prefill; decode = paged logits
(fp8_fp4_paged_mqa_logits) -> top_k_per_row_decode / persistent_topk. The selected positions equal
mla_ext.sparse.reference.select_reference on the same (dequantized) operands up to ties (scores
within float32 rounding of the k-th). Both logits backends (Triton forced under the interpreter)."""
import pytest
import torch

from mla_ext.sparse import mqa_logits as ML
from mla_ext.sparse.reference import indexer_scores_reference, select_reference
from mla_ext.vllm import _indexer_ops as ops
from mla_ext.vllm import deep_gemm_ops as dg

H, D, BS, TOPK = 4, 32, 16, 12


def assert_same_up_to_ties(got: torch.Tensor, want: torch.Tensor, scores: list[torch.Tensor]) -> None:
    """got/want int32 [T, K] (-1 padded); scores[t] the float64 scores of token t's index space."""
    for t in range(got.shape[0]):
        g, w = set(got[t][got[t] >= 0].tolist()), set(want[t][want[t] >= 0].tolist())
        assert len(g) == int((got[t] >= 0).sum()) and len(g) == len(w), t
        if g == w:
            continue
        s = scores[t]
        kth = min(float(s[i]) for i in w)
        tol = 1e-5 * float(s[torch.isfinite(s)].abs().max())
        assert all(abs(float(s[i]) - kth) <= tol for i in g ^ w), f"token {t}: differs beyond ties"


def _quant_q(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) e4m3 with a power-of-two scale folded into the weights (vLLM's FP8 path)."""
    amax = q.abs().amax(-1).clamp_min(1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return (q / scale[..., None]).to(torch.float8_e4m3fn), w * scale


def _setup(seed, ctx_lens, q_lens):
    g = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(ctx_lens, q_lens)]
    nblk = [-(-t // BS) for t in totals]
    perm = torch.randperm(sum(nblk) + 2, generator=g)
    bt = torch.zeros(len(totals), max(nblk), dtype=torch.int32)
    cache = torch.zeros(sum(nblk) + 2, BS, D + 4, dtype=torch.uint8)
    keys, j = [], 0
    for r, t in enumerate(totals):
        bt[r, :nblk[r]] = perm[j:j + nblk[r]]
        j += nblk[r]
        k = torch.randn(t, D, generator=g)
        pos = torch.arange(t)
        ops.indexer_k_quant_and_cache(k, cache, (bt[r, pos // BS].long() * BS + pos % BS), D, "ue8m0")
        keys.append(k)
    T = sum(q_lens)
    q, w = _quant_q(torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g))
    # the keys as the cache holds them (the oracle scores the same operands)
    cu = torch.tensor([0] + totals).cumsum(0).to(torch.int32)
    kq = torch.empty(int(cu[-1]), D, dtype=torch.float8_e4m3fn)
    ksc = torch.empty(int(cu[-1]), 4, dtype=torch.uint8)
    ops.cp_gather_indexer_k_quant_cache(cache, kq, ksc, bt, cu)
    kdq = kq.float() * ksc.view(torch.float32)
    k_idx = [kdq[cu[r]:cu[r + 1]] for r in range(len(totals))]
    scores = [row for s in indexer_scores_reference(q.float(), k_idx, w, list(q_lens), list(ctx_lens)) for row in s]
    want = select_reference(q.float(), k_idx, w, list(q_lens), list(ctx_lens), TOPK)
    return dict(cache=cache, bt=bt, q=q, w=w, cu=cu, kq=kq, ksc=ksc, scores=scores, want=want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_chain_selects_the_oracles_positions(backend):
    ctx_lens, q_lens = [0, 20, 37], [5, 9, 4]
    c = _setup(0, ctx_lens, q_lens)
    ks = torch.cat([torch.full((n,), int(c["cu"][r]), dtype=torch.int32) for r, n in enumerate(q_lens)])
    ke = torch.cat([c["cu"][r] + ctx + torch.arange(1, n + 1, dtype=torch.int32)
                    for r, (ctx, n) in enumerate(zip(ctx_lens, q_lens))]).to(torch.int32)
    with ML.MQA_LOGITS.force(backend):
        logits = dg.fp8_fp4_mqa_logits((c["q"], None), (c["kq"], c["ksc"].view(torch.float32).squeeze(-1)), c["w"],
                                       ks, ke, int((ke - ks).max()))
    out = torch.full((sum(q_lens), TOPK), 0x7EEE, dtype=torch.int32)
    row_ends = ke - ks
    ops.top_k_per_row_prefill(logits, torch.zeros_like(row_ends), row_ends, out, out.shape[0], logits.stride(0),
                              logits.stride(1), TOPK)
    assert_same_up_to_ties(out, c["want"], c["scores"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_chain_selects_the_oracles_positions(backend, next_n):
    ctx_lens = [3, 30, 47 - next_n]
    q_lens = [next_n] * 3
    c = _setup(1, ctx_lens, q_lens)
    seq_lens = torch.tensor([[x + next_n] for x in ctx_lens], dtype=torch.int32)  # [B, 1]: per request
    with ML.PAGED_MQA_LOGITS.force(backend):
        logits = dg.fp8_fp4_paged_mqa_logits((c["q"].view(3, next_n, H, D), None), c["cache"].unsqueeze(2), c["w"],
                                             seq_lens, c["bt"], dg.get_paged_mqa_logits_metadata(seq_lens, BS, 4), 64)
    out = torch.full((3 * next_n, TOPK), 0x7EEE, dtype=torch.int32)
    ops.top_k_per_row_decode(logits, next_n, seq_lens, out, out.shape[0], logits.stride(0), logits.stride(1), TOPK)
    assert_same_up_to_ties(out, c["want"], c["scores"])
    if next_n == 1:  # vLLM's persistent_topk on the same logits (its topk is 512/1024/2048 there)
        big = torch.full((3, 512), 0x7EEE, dtype=torch.int32)
        ops.persistent_topk(logits, seq_lens.view(-1), big, torch.zeros(8, dtype=torch.uint8), 512, 64)
        assert [int((big[r] >= 0).sum()) for r in range(3)] == [int(x) for x in seq_lens.view(-1)]
        assert torch.equal(big[:, :TOPK], out)
