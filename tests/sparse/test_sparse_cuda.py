"""The sparse (DSA) path on a GPU: the Triton kernels chosen for CUDA tensors against the CPU paths
and the float64 oracle. Skipped without a GPU (benchmarks/gpu_check.sh runs it on a lent one)."""
import pytest
import torch

from mla_ext.sparse import index_cache as ic
from mla_ext.sparse import reference as ref
from mla_ext.sparse import sparse_attention as SA
from mla_ext.sparse.topk import indexer_topk
from helpers.numeric import rel_fro

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla", "nvfp4_ds_mla", "fp8"])
def test_sparse_attention_on_cuda_chooses_triton_and_matches_the_oracle(fmt):
    import test_sparse_attention as T

    c = T._case(fmt, torch.bfloat16, seed=7)
    q_lat, q_pe, w_uv = T._absorb(c)
    dev = "cuda"
    args = [q_lat.to(dev), q_pe.to(dev), c["cache"].to(dev), fmt, c["table"].to(dev), c["idx"].to(dev),
            c["new_kv"].to(dev), c["new_pe"].to(dev), c["ks"].to(dev), c["scale"]]
    x = SA.SparseInputs(*args[:6], tuple(T.Q_LENS), tuple(T.CTX_LENS), *args[6:])
    assert SA.SPARSE.choose(x).name == "triton", SA.SPARSE.explain(x)
    o_lat, lse = SA.sparse_latent_attention(*args, q_lens=T.Q_LENS, ctx_lens=T.CTX_LENS)
    o = torch.einsum("ntl,nvl->tnv", o_lat.float().cpu(), w_uv)
    o_ref, lse_ref = T._oracle(c)
    assert rel_fro(o, o_ref) <= 1e-2 and torch.allclose(lse.cpu(), lse_ref, atol=1e-2)


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
def test_indexer_and_index_cache_on_cuda(fmt):
    import test_sparse_topk as T

    q, w, k_new, cache, table, keys = T._batch(fmt, seed=3)
    dev = "cuda"
    got = indexer_topk(q.to(dev), w.to(dev), k_new.to(dev), cache.to(dev), table.to(dev), T.Q_LENS, T.CTX_LENS, 16,
                       index_cache_dtype=fmt, chunk=32, backend="triton").cpu()
    want = ref.select_reference(q, keys, w, T.Q_LENS, T.CTX_LENS, 16)
    scores = torch.cat([torch.nn.functional.pad(s, (0, 64 - s.shape[1]), value=float("-inf"))
                        for s in ref.indexer_scores_reference(q, keys, w, T.Q_LENS, T.CTX_LENS)])
    assert T.tie_equivalent(got, want, scores, rtol=1e-5) == []
    # the CUDA writer (Triton) stores the CPU writer's bytes; the CUDA gather returns the CPU gather's rows
    k = torch.randn(40, T.D) * 3
    slots = torch.randperm(cache.shape[0] * T.B)[:40]
    a = torch.zeros_like(cache)
    ic.write_index_cache(k, a, slots, fmt, scale_fmt="ue8m0" if fmt == "fp8" else None)
    b = torch.zeros_like(cache, device=dev)
    ic.write_index_cache(k.to(dev), b, slots.to(dev), fmt, scale_fmt="ue8m0" if fmt == "fp8" else None)
    assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    cu = torch.tensor([0, 37, 37, 87, 90], dtype=torch.int32)
    assert torch.equal(ic.gather_index_keys(b, table.to(dev), cu.to(dev), fmt, head_dim=T.D).cpu(),
                       ic.gather_index_keys(a, table, cu, fmt, head_dim=T.D))
