"""The indexer q's RoPE + e4m3 quantization (mla_ext/sparse/indexer_q_quant.py; vLLM's
fused_indexer_q_rope_quant in mla_ext/vllm/indexer_quant.py): both backends bit for bit against the
oracle (mla_ext/sparse/indexer_ops_reference.py; Triton forced under the interpreter), the oracle
against an independent rotation (mla_ext.sparse.reference.rope) within e4m3's precision, the
power-of-two scales folded into the weights, refusals naming the argument."""
import pytest
import torch

from mla_ext.sparse import indexer_q_quant as QQ
from mla_ext.sparse.indexer_ops_reference import indexer_q_rope_quant_reference
from mla_ext.sparse.reference import rope
from mla_ext.vllm.indexer_quant import fused_indexer_q_rope_quant


def _case(seed, T=6, H=5, D=128, R=64, P=40):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=g) * 3).bfloat16()
    q[0, 0] = 0  # an all-zero head: the 1e-10 floor
    cs = torch.randn(P, R, generator=g)
    return (torch.randint(0, P, (T,), generator=g), q, cs, torch.randn(T, H, generator=g).bfloat16())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("neox", [True, False])
def test_backends_equal_the_oracle_bit_for_bit(backend, neox):
    pos, q, cs, w = _case(0)
    want_q, want_w = indexer_q_rope_quant_reference(pos, q, cs, w, 128 ** -0.5, 64 ** -0.5, neox)
    with QQ.INDEXER_Q_QUANT.force(backend):
        got_q, got_w = fused_indexer_q_rope_quant(pos, q, cs, w, 128 ** -0.5, 64 ** -0.5, neox)
    assert got_q.dtype == torch.float8_e4m3fn and got_w.dtype == torch.float32
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_w, want_w)


def test_oracle_against_an_independent_rotation():
    pos, q, cs, w = _case(1)
    qf, wf = indexer_q_rope_quant_reference(pos, q, cs, w, 1.0, 1.0, True)
    scale = wf / w.float()  # weights carry the power-of-two q scale
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    half = cs.shape[1] // 2
    cos = torch.cat([cs[pos, :half]] * 2, -1)[:, None].double()
    sin = torch.cat([cs[pos, half:]] * 2, -1)[:, None].double()
    want = rope(q.double(), cos, sin, interleaved=False)
    got = qf.float().double() * scale[..., None].double()
    err = (got - want).abs() / want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert float(err.max()) <= 2 ** -4  # e4m3's half ulp at the top of the range, plus the bf16 rounding
    assert float(qf.float().abs().amax()) <= 448 and float(qf.float().abs().amax(-1).flatten()[1:].min()) >= 224


def test_errors_name_the_argument():
    pos, q, cs, w = _case(2)
    with pytest.raises(ValueError, match="q: expected a bf16"):
        QQ.indexer_q_rope_quant(pos, q.to(torch.int8), cs, w, 1.0, 1.0, True)
    with pytest.raises(ValueError, match="cos_sin_cache: expected"):
        QQ.indexer_q_rope_quant(pos, q, cs[:, :63], w, 1.0, 1.0, True)
    with pytest.raises(ValueError, match="positions: expected int"):
        QQ.indexer_q_rope_quant(pos.float(), q, cs, w, 1.0, 1.0, True)
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 40\)"):
        QQ.indexer_q_rope_quant(pos + 40, q, cs, w, 1.0, 1.0, True)
    with pytest.raises(ValueError, match="weights: expected a float"):
        QQ.indexer_q_rope_quant(pos, q, cs, w[:, :2], 1.0, 1.0, True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("neox", [True, False])
def test_cuda_triton_against_the_oracle(neox):
    pos, q, cs, w = _case(3, T=300, H=64)
    want_q, want_w = indexer_q_rope_quant_reference(pos, q, cs, w, 0.088, 0.125, neox)
    got_q, got_w = fused_indexer_q_rope_quant(pos.cuda(), q.cuda(), cs.cuda(), w.cuda(), 0.088, 0.125, neox)
    # a GPU may contract x*cos - y*sin into an fma: a rotated value may round to the next bf16, moving a
    # code by one; the scales (and so the weights) follow the amax, which may move the same way
    diff = (got_q.cpu().view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
    assert float((diff > 0).float().mean()) < 1e-3 and int(diff.max()) <= 1
    assert float(((got_w.cpu() - want_w).abs() / want_w.abs().clamp_min(1e-30)).max()) <= 1e-6 or \
        float((got_w.cpu() != want_w).float().mean()) < 1e-2
