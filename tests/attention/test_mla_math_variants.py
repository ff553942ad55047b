"""The attention math the newer MLA families need, against the
float64 oracle (mla_ext/prefill/reference.py) and the attention reference:

- R = 0 (no rope part: glm5_next, mistral_large4's no-rope layers) through every
  attention backend that runs here, both context paths and every cache format that
  has a layout for it (nvfp4_ds_mla has none and says so);
- attention sinks (hy_v4: one logit per head joining every softmax) on every
  attention backend, the up-projected and the absorbed context path; the sink enters
  once however many chunks the context is cut into;
- per-layer dims (dots3_note's sliding layers: another L, P and head count;
  no-rope layers) in the model config, the cache policy, the planner and the layer.
"""
from __future__ import annotations

import pytest
import torch

from mla_ext.attention import reference as attn_ref
from mla_ext.attention.api import ATTENTION, varlen_attention
from mla_ext.kv_b_proj.weights import DenseWeight
from mla_ext.config.models import LayerDims, MLAModelConfig
from mla_ext.config.planner import plan_model
from mla_ext.config.policy import CacheConfig, resolve_layer
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.prefill.synthetic import SyntheticBatch
from helpers.numeric import rel_fro

BLOCK = 16
CTX, QL = [40, 0, 9], [3, 2, 1]
BACKENDS = ["torch", "triton", "flex_attention"]


def _model(L=64, R=16, heads=2, **kw) -> MLAModelConfig:
    return MLAModelConfig("t", L=L, R=R, P=16, V=16, num_heads=heads, num_layers=2,
                          model_dtype=torch.float32, max_model_len=256, **kw)


def _prefill_vs_oracle(model, fmt, backend, path, sinks=None, rows=32, seed=0, layer=0):
    gen = torch.Generator().manual_seed(seed)
    m = model.for_layer(layer)
    w = torch.randn(m.num_heads * (m.P + m.V), m.L, generator=gen) / m.L ** 0.5
    pf = MLAPrefill(model, CacheConfig(fmt, block_size=BLOCK, calculate_kv_scales=fmt == "fp8"),
                    DenseWeight(w), layer=layer, workspace_rows_override=rows, max_num_seqs=3,
                    context_attention=path, sinks=sinks)
    b = SyntheticBatch(pf.model, CTX, QL, BLOCK, seed=seed)
    kv, pe = b.layer_context(layer)
    ks = pf.compute_kv_scale(kv, pe)
    cache = b.fill_cache(pf, kv, pe, ks)
    with ATTENTION.force(backend):
        out = pf(b.q, b.kv_c_new, b.k_pe_new, cache, b.metadata(ks), k_scale=ks)
    held = b.cached_rows(pf, cache, ks)
    ref = mla_prefill_reference(b.q, b.kv_c_new, b.k_pe_new, *held, b.q_lens, w, m.P, m.V,
                                pf.softmax_scale, sinks=sinks)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return rel_fro(out, ref), pf


# -- R = 0 -------------------------------------------------------------------

@pytest.mark.parametrize("fmt,backend,path", [
    ("auto", "torch", "up_project"), ("auto", "torch", "absorbed"),
    ("auto", "triton", "up_project"), ("auto", "triton", "absorbed"),
    ("auto", "flex_attention", "up_project"),
    ("fp8", "torch", "up_project"), ("fp8", "triton", "absorbed"),
    ("fp8_ds_mla", "torch", "up_project"), ("fp8_ds_mla", "torch", "absorbed"),
    ("fp8_ds_mla", "triton", "up_project"),
])
def test_no_rope_part_matches_the_oracle(fmt, backend, path):
    model = _model(L=512 if fmt == "fp8_ds_mla" else 64, R=0)
    err, pf = _prefill_vs_oracle(model, fmt, backend, path)
    assert err <= 1e-5, err
    assert pf.softmax_scale == pytest.approx(16 ** -0.5)


def test_nvfp4_ds_mla_refuses_no_rope_with_the_reason():
    with pytest.raises(ValueError, match=r"R=0.*fixed 64-value e4m3 rope section.*fp8_ds_mla"):
        resolve_layer(CacheConfig("nvfp4_ds_mla"), _model(L=512, R=0), layer=0)


def test_attention_reference_takes_zero_width_rope():
    q = torch.randn(5, 3, 8)
    k, v = torch.randn(7, 3, 8), torch.randn(7, 3, 4)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    split = attn_ref.varlen_attention_ref(q, k, v, cu_q, cu_k, 0.3, True, k_rope=torch.randn(7, 0))
    whole = attn_ref.varlen_attention_ref(q, k, v, cu_q, cu_k, 0.3, True)
    torch.testing.assert_close(split, whole, rtol=0, atol=0)


# -- attention sinks ---------------------------------------------------------

def _brute_sink_attention(q, k, v, scale, sinks, causal):
    """One request: the sink as an explicit extra logit column (float64)."""
    s = torch.einsum("qnd,knd->nqk", q.double(), k.double()) * scale
    if causal:
        tq, tk = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.arange(tk)[None] > torch.arange(tq)[:, None] + (tk - tq), float("-inf"))
    col = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    return torch.einsum("nqk,knd->qnd", p, v.double())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_on_every_attention_backend(backend):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, d, generator=gen) for n, d in ((6, 24), (9, 24), (9, 16)))
    sinks = torch.tensor([0.7, -1.5])
    cu_q, cu_k = torch.tensor([0, 2, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    with ATTENTION.force(backend):
        o, lse = varlen_attention(q, k, v, cu_q, cu_k, 4, 4, 0.4, causal=True, sinks=sinks)
    o_ref, lse_ref = attn_ref.varlen_attention_ref(q, k, v, cu_q, cu_k, 0.4, True, sinks=sinks)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    for (a, b), (c, d) in (((0, 2), (0, 4)), ((2, 6), (5, 9))):
        brute = _brute_sink_attention(q[a:b], k[c:d], v[c:d], 0.4, sinks, True)
        torch.testing.assert_close(o[a:b].double(), brute, rtol=1e-5, atol=1e-6)


def test_a_row_with_only_the_sink_is_zero_with_the_sink_as_lse():
    q, k, v = torch.randn(2, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 4)
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    sinks = torch.tensor([0.5, 2.0])
    for backend in ("torch", "triton"):
        with ATTENTION.force(backend):
            o, lse = varlen_attention(q, k, v, cu_q, cu_k, 2, 0, 1.0, causal=False, sinks=sinks)
        assert (o == 0).all()
        torch.testing.assert_close(lse, sinks[:, None].expand(2, 2))


@pytest.mark.parametrize("path,rows,backend", [("up_project", 32, "torch"), ("absorbed", 32, "torch"),
                                               ("up_project", 256, "triton"), ("absorbed", 32, "triton")])
def test_prefill_with_sinks_matches_the_oracle(path, rows, backend):
    sinks = torch.tensor([1.5, -0.5])
    err, pf = _prefill_vs_oracle(_model(), "auto", backend, path, sinks=sinks, rows=rows)
    assert err <= 1e-5, err
    assert "attention sinks" in pf.explain()
    # The sinks matter at this size (so a sink that entered twice, or never, shows).
    err_without, _ = _prefill_vs_oracle(_model(), "auto", "torch", path, sinks=None, rows=rows)
    ref_with_sinks_err = _rel_between_oracles(sinks)
    assert ref_with_sinks_err > 1e-2 and err_without <= 1e-5


def _rel_between_oracles(sinks) -> float:
    gen = torch.Generator().manual_seed(1)
    q, kv, pe = torch.randn(4, 2, 32, generator=gen), torch.randn(4, 64, generator=gen), torch.randn(4, 16, generator=gen)
    w = torch.randn(64, 64, generator=gen) / 8
    ctx = ([torch.randn(30, 64, generator=gen)], [torch.randn(30, 16, generator=gen)])
    a = mla_prefill_reference(q, kv, pe, *ctx, [4], w, 16, 16, 0.25)
    b = mla_prefill_reference(q, kv, pe, *ctx, [4], w, 16, 16, 0.25, sinks=sinks)
    return rel_fro(b, a)


def test_sinks_are_checked_at_construction():
    w = DenseWeight(torch.randn(64, 64))
    for bad, what in ((torch.zeros(3), r"\[2\]"), ([0.0, 1.0], "float tensor"),
                      (torch.tensor([0.0, float("nan")]), "finite")):
        with pytest.raises(ValueError, match=f"sinks: .*{what}"):
            MLAPrefill(_model(), CacheConfig("auto"), w, layer=0, sinks=bad)


# -- per-layer dims ----------------------------------------------------------

def _per_layer_model() -> MLAModelConfig:
    # Layer 1 like dots3_note's sliding layers: other L, P and heads; layer 0 the model's.
    return MLAModelConfig("per-layer", L=512, R=64, P=128, V=128, num_heads=4, num_layers=3,
                          model_dtype=torch.bfloat16, max_model_len=256,
                          layer_dims={1: LayerDims(L=1024, R=64, P=192, V=128, num_heads=8),
                                      2: LayerDims(L=512, R=0, P=192, V=128, num_heads=4)})


def test_per_layer_dims_size_each_layers_cache_and_plan():
    model = _per_layer_model()
    specs = [resolve_layer(CacheConfig("auto", block_size=BLOCK), model, layer=i) for i in range(3)]
    assert [s.entry_elems for s in specs] == [576, 1088, 512]
    plan = plan_model(CacheConfig("auto", block_size=BLOCK), model, memory_bytes=1 << 20)
    assert [p.shape[2] for p in plan.layers] == [576, 1088, 512]
    assert [p.page_bytes for p in plan.layers] == [BLOCK * 2 * e for e in (576, 1088, 512)]
    lay = model.for_layer(1)
    assert (lay.L, lay.R, lay.P, lay.num_heads) == (1024, 64, 192, 8)
    assert lay.softmax_scale == pytest.approx(256 ** -0.5)
    assert model.for_layer(2).softmax_scale == pytest.approx(192 ** -0.5)
    assert "layer 1: L=1024 R=64 P=192" in model.describe()
    shard = model.shard(2, 1)
    assert shard.for_layer(1).num_heads == 4 and shard.for_layer(0).num_heads == 2


def test_per_layer_dims_in_the_prefill_layer():
    model = MLAModelConfig("t", L=64, R=16, P=16, V=16, num_heads=2, num_layers=2,
                           model_dtype=torch.float32, max_model_len=256,
                           layer_dims={1: LayerDims(L=32, R=0, P=24, V=8, num_heads=3)})
    err, pf = _prefill_vs_oracle(model, "auto", "torch", "up_project", layer=1)
    assert err <= 1e-5 and (pf.model.L, pf.model.R, pf.model.num_heads) == (32, 0, 3)
    with pytest.raises(ValueError, match=r"kv_b_proj: expected a \[64, 64\]"):
        MLAPrefill(model, CacheConfig("auto"), DenseWeight(torch.randn(3 * 32, 32)), layer=0)


def test_layer_dims_and_kv_sources_are_checked():
    with pytest.raises(ValueError, match=r"layer_dims keys must be layer indices in \[0, 2\)"):
        _model(layer_dims={5: LayerDims(64, 16, 16, 16, 2)})
    with pytest.raises(ValueError, match=r"layer_dims\[1\].R must be an integer >= 0"):
        _model(layer_dims={1: LayerDims(64, -1, 16, 16, 2)})
    with pytest.raises(ValueError, match=r"kv_source_layers\[1\] must name another layer"):
        _model(kv_source_layers={1: 1})
    assert _model(kv_source_layers={1: 0}).kv_source(1) == 0


def test_kv_sharing_layers_plan_no_cache_of_their_own():
    """mistral_large4's KV sharing: layer 2 reads layer 0's cache. Its spec is its
    source's (format, entry), it takes no bytes, and allocate() hands it the source's
    tensor itself, shared buffer or not."""
    model = _model(kv_source_layers={1: 0}, layer_dims={0: LayerDims(64, 16, 16, 16, 2)})
    cfg = CacheConfig("fp8", block_size=BLOCK, skip_layers=(0,))
    spec = resolve_layer(cfg, model, layer=1)
    assert spec.kv_source == 0 and spec.layer_index == 1 and spec.kv_cache_dtype == "auto"
    plan = plan_model(cfg, model, memory_bytes=1 << 16)
    own, shared = plan.layers
    assert shared.bytes == 0 and shared.kv_source == 0 and shared.offset == own.offset
    assert plan.bytes_used == own.bytes
    for flag in (False, True):
        caches = plan.allocate(shared=flag)
        assert caches[1] is caches[0]
    assert plan.to_dict()["layers"][1]["kv_source"] == 0
