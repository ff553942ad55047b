"""Sparse latent attention straight from the paged cache (mla_ext/sparse/sparse_attention.py,
triton_sparse.py) against the float64 oracle, every cache format, both backends (Triton under
the interpreter), context and new tokens in one index space; dense lists give the dense answer."""
import pytest
import torch

from mla_ext.cache import api as cache_api
from mla_ext.cache.reference import decode_cache_rows
from mla_ext.config.formats import get_format
from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.sparse import reference as ref
from mla_ext.sparse import sparse_attention as SA
from helpers.numeric import rel_fro
from helpers.sparse_cache import paged_layout

B = 16
N, P, V = 4, 8, 8
FORMATS = ("auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla")
Q_LENS, CTX_LENS = [5, 3, 4], [40, 0, 23]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _dims(fmt):
    return (512, 64) if fmt.endswith("ds_mla") else (32, 8)


def _case(fmt, dtype=torch.float32, seed=0, topk=12, dense=False):
    g = torch.Generator().manual_seed(seed)
    L, R = _dims(fmt)
    T = sum(Q_LENS)
    f = get_format(fmt)
    table, nb, slots = paged_layout(CTX_LENS, B, seed=seed)
    cache = torch.full((nb, B, f.entry_elems(L, R)), 0x7F if f.is_quantized else float("nan"),
                       dtype=f.storage_dtype(dtype))
    ks = torch.tensor([0.05])
    ctx_rows = []
    for c, s in zip(CTX_LENS, slots):
        kv, pe = (torch.randn(c, L, generator=g) * 2).to(dtype), torch.randn(c, R, generator=g).to(dtype)
        if c:
            cache_api.concat_and_cache_mla(kv, pe, cache, s, fmt, ks)
            raw = cache[s // B, s % B]
            ctx_rows.append(decode_cache_rows(raw, fmt, ks)[:, :L + R])  # what the cache holds
        else:
            ctx_rows.append(torch.empty(0, L + R))
    new_kv, new_pe = torch.randn(T, L, generator=g).to(dtype), torch.randn(T, R, generator=g).to(dtype)
    q = (torch.randn(T, N, P + R, generator=g) * 0.5).to(dtype)
    w_kv_b = (torch.randn(N * (P + V), L, generator=g) / L ** 0.5).to(dtype)
    if dense:
        idx = ref.dense_indices(Q_LENS, CTX_LENS)
    else:  # random distinct visible positions, shuffled, -1 padded, plus one past the end (no key)
        rows = []
        for qn, c in zip(Q_LENS, CTX_LENS):
            for i in range(qn):
                vis = torch.randperm(c + i + 1, generator=g)[:topk]
                row = torch.full((topk + 1,), -1, dtype=torch.int32)
                row[:len(vis)] = vis.to(torch.int32)
                row[-1] = c + qn + 3
                rows.append(row)
        idx = torch.stack(rows)
    return dict(q=q, cache=cache, table=table, ks=ks, ctx_rows=ctx_rows, new_kv=new_kv, new_pe=new_pe,
                w=w_kv_b, idx=idx, L=L, R=R, fmt=fmt, scale=(P + R) ** -0.5)


def _absorb(c):
    w = c["w"].float().view(N, P + V, c["L"])
    q_lat = torch.einsum("tnp,npl->ntl", c["q"][..., :P].float(), w[:, :P]).to(c["q"].dtype)
    return q_lat, c["q"][..., P:], w[:, P:]


def _run(c, backend):
    q_lat, q_pe, w_uv = _absorb(c)
    with SA.SPARSE.force(backend):
        o_lat, lse = SA.sparse_latent_attention(q_lat, q_pe, c["cache"], c["fmt"], c["table"], c["idx"], c["new_kv"],
                                                c["new_pe"], c["ks"], c["scale"], q_lens=Q_LENS, ctx_lens=CTX_LENS)
    return torch.einsum("ntl,nvl->tnv", o_lat.float(), w_uv), lse


def _oracle(c):
    kv, pe, at = [], [], 0
    for r, (qn, cl) in enumerate(zip(Q_LENS, CTX_LENS)):
        rows = c["ctx_rows"][r]
        kv.append(torch.cat([rows[:, :c["L"]], c["new_kv"][at:at + qn].float()]))
        pe.append(torch.cat([rows[:, c["L"]:], c["new_pe"][at:at + qn].float()]))
        at += qn
    return ref.sparse_latent_attention_reference(c["q"], kv, pe, c["idx"], Q_LENS, c["w"], P, V, c["scale"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_format_matches_the_oracle(fmt, backend):
    dtype = torch.float32 if fmt == "auto" and backend == "torch" else torch.bfloat16
    c = _case(fmt, dtype)
    o, lse = _run(c, backend)
    o_ref, lse_ref = _oracle(c)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert rel_fro(o, o_ref) <= TOL[dtype], (fmt, backend)
    assert torch.allclose(lse, lse_ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_fp32_triton_matches_the_oracle_tightly():
    c = _case("auto", torch.float32, seed=3)
    o, lse = _run(c, "triton")
    o_ref, lse_ref = _oracle(c)
    assert rel_fro(o, o_ref) <= 1e-5 and torch.allclose(lse, lse_ref, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dense_lists_give_dense_prefill(backend):
    c = _case("auto", torch.float32, seed=1, dense=True)
    o, _ = _run(c, backend)
    L = c["L"]
    dense = mla_prefill_reference(c["q"], c["new_kv"], c["new_pe"], [r[:, :L] for r in c["ctx_rows"]],
                                  [r[:, L:] for r in c["ctx_rows"]], Q_LENS, c["w"], P, V, c["scale"])
    assert rel_fro(o, dense) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_key_and_bad_block_ids(backend):
    c = _case("fp8", torch.bfloat16, seed=2)
    c["idx"][0] = -1  # a query with no key: o = 0, lse = -inf
    c["table"][0, 0] = 10_000  # positions 0..15 of request 0 read zero rows (the gather's rule)
    o, lse = _run(c, backend)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[:, 0]).all()
    c2 = dict(c)
    c2["ctx_rows"] = [r.clone() for r in c["ctx_rows"]]
    c2["ctx_rows"][0][:B] = 0
    o_ref, lse_ref = _oracle(c2)
    assert rel_fro(o[1:], o_ref[1:]) <= 1e-2 and torch.allclose(lse[:, 1:], lse_ref[:, 1:], atol=1e-2)


def test_bad_arguments_are_value_errors():
    c = _case("auto", torch.float32)
    q_lat, q_pe, _ = _absorb(c)
    args = [q_lat, q_pe, c["cache"], "auto", c["table"], c["idx"], c["new_kv"], c["new_pe"], None, 1.0]
    with pytest.raises(ValueError, match="q_lens"):
        SA.sparse_latent_attention(*args, q_lens=[1, 2, 3], ctx_lens=CTX_LENS)
    bad = list(args)
    bad[5] = c["idx"][:3]
    with pytest.raises(ValueError, match="indices"):
        SA.sparse_latent_attention(*bad, q_lens=Q_LENS, ctx_lens=CTX_LENS)
    bad = list(args)
    bad[3] = "fp8"
    with pytest.raises(ValueError, match="k_scale"):
        SA.sparse_latent_attention(*bad, q_lens=Q_LENS, ctx_lens=CTX_LENS)
    with pytest.raises(ValueError, match="ctx_lens"):
        SA.sparse_latent_attention(*args, q_lens=Q_LENS, ctx_lens=[1.0, 0, 2])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_requests_without_new_tokens(backend):
    c = _case("auto", torch.float32, seed=4)
    q_lat, q_pe, _ = _absorb(c)
    with SA.SPARSE.force(backend):
        o, lse = SA.sparse_latent_attention(q_lat[:, :0], q_pe[:0], c["cache"], "auto", c["table"], c["idx"][:0],
                                            c["new_kv"][:0], c["new_pe"][:0], None, 1.0, q_lens=[0, 0, 0],
                                            ctx_lens=CTX_LENS)
    assert o.shape == (N, 0, c["L"]) and lse.shape == (N, 0)
