"""The DSA indexer logits in DeepGEMM's contracts (mla_ext/sparse/mqa_logits.py; vLLM's names in
mla_ext/vllm/deep_gemm_ops.py) against the float64 oracle (mla_ext/sparse/indexer_ops_reference.py):
both backends (Triton forced under the interpreter at small shapes), outputs poisoned first, the
-inf layout exact, refusals naming the argument. CUDA cases skip without a GPU."""
import pytest
import torch

from mla_ext.sparse import mqa_logits as ML
from mla_ext.sparse.index_cache import write_index_cache
from mla_ext.sparse.indexer_ops_reference import mqa_logits_reference, paged_mqa_logits_reference
from mla_ext.vllm import deep_gemm_ops as dg

BACKENDS = ["torch", "triton"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fp8(shape, gen, scale=2.0):
    return (torch.randn(shape, generator=gen) * scale).to(torch.float8_e4m3fn)


def _prefill_case(seed=0, M=9, H=4, D=32, N=70):
    g = torch.Generator().manual_seed(seed)
    # two requests in the gathered keys: rows 0-4 see [0, 1..30), rows 5-8 see [30, 30 + 11..40)
    ks = torch.tensor([0] * 5 + [30] * 4, dtype=torch.int32)
    ke = torch.tensor([1, 9, 17, 25, 30, 41, 52, 63, 70], dtype=torch.int32)
    return dict(q=_fp8((M, H, D), g), k=_fp8((N, D), g), k_scale=torch.rand(N, generator=g) + 0.05,
                w=torch.randn(M, H, generator=g), ks=ks, ke=ke, W=int((ke - ks).max()))


def _check_logits(out, ref):
    fin = torch.isfinite(ref)
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isfinite(out), fin) and bool((out[~fin] == float("-inf")).all())
    scale = ref[fin].abs().max()
    assert float((out[fin] - ref[fin]).abs().max()) <= 1e-5 * float(scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_are_compressed_rows_against_the_oracle(backend):
    c = _prefill_case()
    ref = mqa_logits_reference(c["q"], c["k"], c["k_scale"], c["w"], c["ks"], c["ke"], c["W"])
    out = torch.full((9, c["W"]), float("nan"))
    with ML.MQA_LOGITS.force(backend):
        ML.mqa_logits(c["q"], c["k"], c["k_scale"], c["w"], c["ks"], c["ke"], c["W"], out=out)
    _check_logits(out, ref)
    # row m column c is key ks[m] + c: row 6 (ks 30, ke 52) holds 22 finite entries
    assert int(torch.isfinite(out[6]).sum()) == 22


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_rows_with_different_starts_in_one_tile_and_a_short_width(backend):
    g = torch.Generator().manual_seed(3)
    M, H, D, N = 6, 3, 16, 40
    ks = torch.tensor([0, 7, 3, 20, 39, 5], dtype=torch.int32)
    ke = torch.tensor([5, 30, 3, 40, 40, 45], dtype=torch.int32)  # an empty row; ke past N reads nothing past N
    q, k, s, w = _fp8((M, H, D), g), _fp8((N, D), g), torch.rand(N, generator=g) + 0.1, torch.randn(M, H, generator=g)
    W = 12  # narrower than some rows: max_seqlen_k bounds the columns
    ke_in = ke.clamp(max=N)
    ref = mqa_logits_reference(q, k, s, w, ks, ke_in, W)
    with ML.MQA_LOGITS.force(backend):
        out = dg.fp8_fp4_mqa_logits((q, None), (k, s), w, ks, ke, W)
    _check_logits(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_decode_logits_against_the_oracle(backend):
    g = torch.Generator().manual_seed(1)
    B, next_n, H, D, bs, nb = 3, 2, 4, 32, 16, 10
    cache = torch.zeros(nb, bs, D + 4, dtype=torch.uint8)
    write_index_cache(torch.randn(nb * bs, D, generator=g), cache, torch.arange(nb * bs), "fp8",
                      quant_block_size=D, scale_fmt="ue8m0")
    q = _fp8((B, next_n, H, D), g)
    w = torch.randn(B * next_n, H, generator=g)
    bt = torch.tensor([[4, 1, 7, 0], [9, 2, 0, 0], [3, 5, 6, 8]], dtype=torch.int32)
    for lens in (torch.tensor([[5], [32], [60]], dtype=torch.int32),  # per request: L - next_n + j + 1
                 torch.tensor([[1, 2], [0, 17], [63, 64]], dtype=torch.int32)):  # per row
        ref = paged_mqa_logits_reference(q, cache.unsqueeze(2), w, lens, bt, 70)
        with ML.PAGED_MQA_LOGITS.force(backend):
            out = dg.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(2), w, lens, bt,
                                              dg.get_paged_mqa_logits_metadata(lens, bs, 8), 70)
        _check_logits(out, ref)
    assert int(torch.isfinite(out[0]).sum()) == 1 and int(torch.isfinite(out[2]).sum()) == 0


def test_metadata_has_deep_gemms_shape():
    m = dg.get_paged_mqa_logits_metadata(torch.ones(4, 1, dtype=torch.int32), 64, 132)
    assert m.shape == (133, 2) and m.dtype == torch.int32


def test_errors_name_the_argument():
    c = _prefill_case()
    args = [c["q"], c["k"], c["k_scale"], c["w"], c["ks"], c["ke"], c["W"]]
    with pytest.raises(ValueError, match="q: expected float8_e4m3fn"):
        ML.mqa_logits(c["q"].float(), *args[1:])
    with pytest.raises(ValueError, match="k_scale: expected float32"):
        ML.mqa_logits(*args[:2], c["k_scale"][:3], *args[3:])
    with pytest.raises(ValueError, match="weights: expected"):
        ML.mqa_logits(*args[:3], c["w"][:, :2], *args[4:])
    with pytest.raises(ValueError, match="cu_seqlen_ke: expected an int32"):
        ML.mqa_logits(*args[:5], c["ke"].float(), c["W"])
    with pytest.raises(ValueError, match=r"q: the MXFP4"):
        dg.fp8_fp4_mqa_logits((c["q"], torch.zeros(9, 4, dtype=torch.int32)), (c["k"], c["k_scale"]), c["w"],
                              c["ks"], c["ke"], c["W"])
    q4 = c["q"][:2].unsqueeze(1)
    with pytest.raises(ValueError, match="kv_cache: expected uint8"):
        ML.paged_mqa_logits(q4, torch.zeros(2, 16, 1, 40, dtype=torch.uint8), c["w"][:2],
                            torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="indices: the varlen"):
        dg.fp8_fp4_paged_mqa_logits((q4, None), torch.zeros(2, 16, 1, 36, dtype=torch.uint8), c["w"][:2],
                                    torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                                    None, 8, indices=torch.zeros(2, dtype=torch.int32))


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("H,D", [(64, 128), (32, 128)])
def test_cuda_triton_matches_the_oracle(paged, H, D):
    g = torch.Generator().manual_seed(5)
    if not paged:
        M, N = 300, 900
        ks = torch.cat([torch.zeros(100), torch.full((200,), 200)]).int()
        ke = torch.cat([torch.arange(101, 201), torch.arange(701, 901)]).int()
        q, k, s, w = _fp8((M, H, D), g), _fp8((N, D), g), torch.rand(N, generator=g) + 0.1, torch.randn(M, H, generator=g)
        ref = mqa_logits_reference(q, k, s, w, ks, ke, 700)
        x = ML.MqaInputs(q.cuda().view(torch.uint8), k.cuda().view(torch.uint8), s.cuda(), w.cuda(), ks.cuda(),
                         ke.cuda(), torch.empty(M, 700, device="cuda"))
        assert ML.MQA_LOGITS.choose(x).name == "triton"
        out = ML.mqa_logits(q.cuda(), k.cuda(), s.cuda(), w.cuda(), ks.cuda(), ke.cuda(), 700).cpu()
    else:
        B, next_n, bs, nb = 5, 2, 64, 40
        cache = torch.zeros(nb, bs, D + 4, dtype=torch.uint8)
        write_index_cache(torch.randn(nb * bs, D, generator=g), cache, torch.arange(nb * bs), "fp8",
                          quant_block_size=D)
        q, w = _fp8((B, next_n, H, D), g), torch.randn(B * next_n, H, generator=g)
        bt = torch.randperm(nb, generator=g)[:B * 8].view(B, 8).int()
        lens = torch.tensor([[1], [64], [65], [300], [512]], dtype=torch.int32)
        ref = paged_mqa_logits_reference(q, cache.unsqueeze(2), w, lens, bt, 600)
        out = dg.fp8_fp4_paged_mqa_logits((q.cuda(), None), cache.cuda().unsqueeze(2), w.cuda(), lens.cuda(),
                                          bt.cuda(), None, 600).cpu()
    _check_logits(out, ref)
