"""The float64 oracle of DSA prefill with context (mla_ext/sparse/reference.py) against
transformers' own DeepSeek-V3.2 and GLM-5 attention forward, context + new tokens well past
index_topk, several requests in one varlen call; and sparse == dense when nothing is dropped."""
import pytest
import torch

from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.sparse import reference as ref
from mla_ext.integrations.transformers_indexer import IndexerParams, project

pytest.importorskip("transformers")
from helpers.numeric import rel_fro  # noqa: E402
from helpers.sparse import FAMILIES, reference_layer, run_with_context, tie_equivalent, tiny_model  # noqa: E402

# (ctx, q_len) per request: context and new tokens both past index_topk=16, one short, one without context.
REQUESTS = [(40, 12), (70, 5), (0, 30), (9, 3)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    model = tiny_model(request.param, topk=16)
    caps = [run_with_context(model, c, q, seed=10 + i) for i, (c, q) in enumerate(REQUESTS)]
    return request.param, model, caps


def _batched_reference(model, caps, topk):
    """One varlen call over every request (the serving layout), from the captured hidden states."""
    attn = model.layers[0].self_attn
    ix = IndexerParams.from_module(attn)
    xs = [project(attn, ix, c.hidden, c.cos, c.sin) for c in caps]
    q_lens = [q for _, q in REQUESTS]
    ctx_lens = [c for c, _ in REQUESTS]
    new = [slice(c, c + q) for c, q in REQUESTS]
    q_idx = torch.cat([x.q_idx[s] for x, s in zip(xs, new)])
    w = torch.cat([x.w_idx[s] for x, s in zip(xs, new)])
    sel = ref.select_reference(q_idx, [x.k_idx for x in xs], w, q_lens, ctx_lens, topk)
    q = torch.cat([x.q[s] for x, s in zip(xs, new)])
    o, lse = ref.sparse_latent_attention_reference(q, [x.kv_c for x in xs], [x.k_pe for x in xs], sel, q_lens,
                                                   attn.kv_b_proj.weight, attn.qk_nope_head_dim,
                                                   attn.v_head_dim, attn.scaling)
    return xs, sel, o, lse


@torch.no_grad()
def test_selection_and_output_match_transformers(family):
    name, model, caps = family
    attn = model.layers[0].self_attn
    _, sel, o, lse = _batched_reference(model, caps, 16)
    start = 0
    for (ctx, qn), cap in zip(REQUESTS, caps):
        one = reference_layer(model, cap, ctx)
        rows = slice(start, start + qn)
        start += qn
        assert torch.equal(sel[rows], one.selected) and torch.equal(o[rows], one.o)  # batched == per request
        # transformers pads a short row with masked positions; ours with -1 and the same visible set
        assert tie_equivalent(one.selected, cap.topk, one.scores) == [], name
        assert all((one.selected[t] >= 0).sum() == min(16, ctx + t + 1) for t in range(qn))
        # output against the module's own, with the module's own selection (ties may pick differently)
        theirs = cap.topk.clone()
        theirs[theirs > ctx + torch.arange(qn)[:, None]] = -1
        o2, _ = ref.sparse_latent_attention_reference(one.inputs.q[ctx:], [one.inputs.kv_c], [one.inputs.k_pe],
                                                      theirs, [qn], attn.kv_b_proj.weight,
                                                      attn.qk_nope_head_dim, attn.v_head_dim, attn.scaling)
        out = o2.to(torch.float64).reshape(qn, -1) @ attn.o_proj.weight.to(torch.float64).t()
        assert rel_fro(cap.out, out) <= 1e-5, name
        same = [t for t in range(qn) if set(one.selected[t].tolist()) - {-1} == set(theirs[t].tolist()) - {-1}]
        assert len(same) >= qn // 2
        assert rel_fro(cap.out[same], one.out[same]) <= 1e-5, name
    assert torch.isfinite(lse[:, sum(q for c, q in REQUESTS if c == 0):]).all()


@torch.no_grad()
def test_dropping_matters_past_topk(family):
    """The dense answer is far from the model's once context + new > index_topk (the bug this fixes)."""
    name, model, caps = family
    ctx, qn = REQUESTS[0]
    full = reference_layer(model, caps[0], ctx, topk=ctx + qn)
    assert rel_fro(caps[0].out, full.out) > 1e-2, name


@torch.no_grad()
def test_sparse_equals_dense_when_nothing_is_dropped(family):
    name, model, caps = family
    attn = model.layers[0].self_attn
    big = max(c + q for c, q in REQUESTS)
    xs, sel, o, _ = _batched_reference(model, caps, big)
    q_lens, ctx_lens = [q for _, q in REQUESTS], [c for c, _ in REQUESTS]
    assert torch.equal(sel.sort(dim=1).values, ref.dense_indices(q_lens, ctx_lens, big).sort(dim=1).values)
    new = [slice(c, c + q) for c, q in REQUESTS]
    dense = mla_prefill_reference(torch.cat([x.q[s] for x, s in zip(xs, new)]),
                                  torch.cat([x.kv_c[s] for x, s in zip(xs, new)]),
                                  torch.cat([x.k_pe[s] for x, s in zip(xs, new)]),
                                  [x.kv_c[:c] for x, (c, _) in zip(xs, REQUESTS)],
                                  [x.k_pe[:c] for x, (c, _) in zip(xs, REQUESTS)], q_lens,
                                  attn.kv_b_proj.weight, attn.qk_nope_head_dim, attn.v_head_dim, attn.scaling)
    assert rel_fro(o, dense) <= 1e-6
    # and the model itself, run with index_topk >= ctx + q_len, gives the dense answer
    ctx, qn = REQUESTS[0]
    wide = tiny_model(name, topk=ctx + qn)
    cap = run_with_context(wide, ctx, qn, seed=10)
    assert rel_fro(cap.out, reference_layer(wide, cap, ctx).out) <= 1e-5


def test_topk_tie_rule_is_lower_position_first():
    s = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, float("-inf")]], dtype=torch.float64)
    assert ref.topk_reference(s, 3).tolist() == [[1, 3, 0]]
    assert ref.topk_reference(s, 7).tolist() == [[1, 3, 0, 2, 4, -1, -1]]


def test_rope_pairings():
    x = torch.randn(3, 6, dtype=torch.float64)
    ang = torch.rand(3, 2, dtype=torch.float64)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    half = ref.rope(x, cos, sin, interleaved=False)
    inter = ref.rope(x, cos, sin, interleaved=True)
    assert torch.equal(half[:, 4:], x[:, 4:]) and torch.equal(inter[:, 4:], x[:, 4:])
    assert torch.allclose(half[:, 0], x[:, 0] * ang[:, 0].cos() - x[:, 2] * ang[:, 0].sin())
    assert torch.allclose(inter[:, 0], x[:, 0] * ang[:, 0].cos() - x[:, 1] * ang[:, 0].sin())
    assert torch.allclose(half.norm(dim=-1), x.norm(dim=-1)) and torch.allclose(inter.norm(dim=-1), x.norm(dim=-1))


def test_bad_arguments_are_value_errors():
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="q_lens"):
        ref.indexer_scores_reference(q, [torch.randn(4, 8)], torch.randn(4, 2), [3], [0])
    with pytest.raises(ValueError, match="k_idx"):
        ref.indexer_scores_reference(q, [torch.randn(5, 8)], torch.randn(4, 2), [4], [0])
    with pytest.raises(ValueError, match="indices"):
        ref.sparse_latent_attention_reference(torch.randn(4, 2, 12), [torch.randn(4, 8)], [torch.randn(4, 4)],
                                              torch.zeros(3, 2, dtype=torch.int32), [4], torch.randn(32, 8),
                                              8, 8, 1.0)
