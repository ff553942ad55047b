"""The sparse layer end to end: TransformersMLA (the one integration for every family) over
transformers' DeepSeek-V3.2 / GLM-5 attention modules runs sparse (indexer -> chunked top-k -> sparse latent attention from the
paged cache), several requests, context + new tokens well past index_topk, every cache format:
selections equal transformers' (fp32 scoring, float32 index cache) up to ties, outputs equal
transformers' (fp32, native cache) or the float64 oracle on what the cache holds (quantized
formats); sparse == dense when index_topk >= context + new; dense families stay dense."""
import functools

import pytest
import torch

from mla_ext.cache.reference import decode_cache_rows
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import PrefillMetadata
from mla_ext.sparse import reference as ref
from mla_ext.sparse.index_cache import get_index_format
from mla_ext.prefill.sparse import SparseConfig, sparse_forward

pytest.importorskip("transformers")
from mla_ext.integrations.transformers_deepseek import TransformersMLA  # noqa: E402
from helpers.sparse_cache import paged_layout  # noqa: E402
from helpers.numeric import rel_fro  # noqa: E402
from helpers.sparse import run_with_context, tie_equivalent, tiny_model  # noqa: E402

B = 16
KS = torch.tensor([0.02])  # per-tensor fp8 K scale
REQUESTS = [(40, 12), (0, 30), (23, 5)]  # (context, new); index_topk = 16


@functools.lru_cache(maxsize=None)
def _model(family, ds, topk):
    """The tiny model and transformers' own forward of every request (shared by the tests)."""
    model = tiny_model(family, topk=topk, **(dict(L=512, R=64, heads=2, index_dim=128) if ds else {}))
    return model, [run_with_context(model, c, q, seed=20 + i) for i, (c, q) in enumerate(REQUESTS)]


def _setup(family, fmt, index_fmt="float32", topk=16):
    model, caps = _model(family, fmt.endswith("ds_mla"), topk)
    attn = model.layers[0].self_attn
    layer = TransformersMLA(attn, CacheConfig(fmt, block_size=B), index_cache_dtype=index_fmt)
    ctx = [c for c, _ in REQUESTS]
    table, nb, slots = paged_layout(ctx, B, seed=1)
    spec = layer.prefill.spec
    kv_cache = torch.zeros(spec.cache_shape(nb), dtype=spec.storage_dtype)
    D = attn.indexer.head_dim
    index_cache = get_index_format(index_fmt).empty(nb, B, D, D).zero_()
    for (c, _), cap, s in zip(REQUESTS, caps, slots):
        if c:
            layer.write_cache(cap.hidden[:c], _pos(cap)[:c], kv_cache, s, KS, index_cache=index_cache)
    new = [slice(c, c + q) for c, q in REQUESTS]
    hidden = torch.cat([cap.hidden[s] for cap, s in zip(caps, new)])
    pos = torch.cat([_pos(cap)[s] for cap, s in zip(caps, new)])
    meta = PrefillMetadata(table, ctx, [q for _, q in REQUESTS], KS, block_size=B)
    return model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta


def _pos(cap):
    """The positions of a captured request's tokens (context then new: 0, 1, ...)."""
    return torch.arange(cap.hidden.shape[0])


def _oracle_on_cache(layer, attn, caps, kv_cache, slots, sel, fmt):
    """float64 sparse attention with the layer's selection over what the cache holds."""
    qs, kvs, pes = [], [], []
    L, R = attn.kv_lora_rank, attn.qk_rope_head_dim
    for (c, qn), cap, s in zip(REQUESTS, caps, slots):
        q, kv_c, k_pe, _ = layer.inputs(cap.hidden, _pos(cap))
        held = decode_cache_rows(kv_cache[s // B, s % B], fmt, KS)[:, :L + R] if c else None
        kvs.append(torch.cat([held[:, :L], kv_c[c:]]) if c else kv_c)
        pes.append(torch.cat([held[:, L:], k_pe[c:]]) if c else k_pe)
        qs.append(q[c:])
    o, _ = ref.sparse_latent_attention_reference(torch.cat(qs), kvs, pes, sel, [q for _, q in REQUESTS],
                                                 attn.kv_b_proj.weight, attn.qk_nope_head_dim, attn.v_head_dim,
                                                 attn.scaling)
    return o


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_matches_transformers_past_index_topk(family):
    model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta = _setup(family, "auto")
    out = layer(hidden, pos, kv_cache, meta, index_cache=index_cache)
    assert "sparse (DSA): index_topk=16" in layer.prefill.explain("cpu")
    sel = layer.prefill.last_selection
    y = layer.o_proj(out)
    start, agree = 0, 0
    for (c, qn), cap in zip(REQUESTS, caps):
        rows = slice(start, start + qn)
        start += qn
        x = ref.indexer_scores_reference(*_index_inputs(layer, cap, c), [qn], [c])[0]
        assert tie_equivalent(sel[rows], cap.topk, x, rtol=1e-5) == [], family
        same = [t for t in range(qn) if {int(i) for i in sel[rows][t] if i >= 0}
                == {int(i) for i in cap.topk[t] if i <= c + t}]
        agree += len(same)
        assert rel_fro(y[rows][same], cap.out[same]) <= 1e-5, family
    assert agree >= sum(q for _, q in REQUESTS) * 3 // 4


def _index_inputs(layer, cap, c):
    _, _, _, ix = layer.inputs(cap.hidden, _pos(cap))
    return ix.q[c:].double(), [ix.k.double()], ix.weights[c:].double()


@pytest.mark.parametrize("fmt,index_fmt", [("fp8", "bfloat16"), ("fp8_e5m2", "float32"), ("fp8_ds_mla", "fp8"),
                                           ("nvfp4_ds_mla", "float32")])
def test_every_cache_format(fmt, index_fmt):
    family = "deepseek_v32" if fmt != "fp8_ds_mla" else "glm_moe_dsa"
    model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta = _setup(family, fmt, index_fmt)
    out = layer(hidden, pos, kv_cache, meta, index_cache=index_cache)
    sel = layer.prefill.last_selection
    seen = torch.tensor([min(16, c + i + 1) for c, q in REQUESTS for i in range(q)])
    assert torch.isfinite(out).all() and torch.equal((sel >= 0).sum(1), seen)
    assert rel_fro(out, _oracle_on_cache(layer, attn, caps, kv_cache, slots, sel, fmt)) <= 1e-4, fmt
    # the selections against transformers' (fp32 scoring): equal up to ties with a float32 index cache;
    # a bf16 / fp8 index cache rounds the keys, so near ties may go the other way (measured: 42-46 of
    # 47 rows equal)
    start, equal = 0, 0
    for (c, qn), cap in zip(REQUESTS, caps):
        rows = slice(start, start + qn)
        start += qn
        if index_fmt == "float32":
            x = ref.indexer_scores_reference(*_index_inputs(layer, cap, c), [qn], [c])[0]
            assert tie_equivalent(sel[rows], cap.topk, x, rtol=1e-5) == [], fmt
        equal += sum({int(i) for i in sel[rows][t] if i >= 0} == {int(i) for i in cap.topk[t] if i <= c + t}
                     for t in range(qn))
    assert equal >= 0.8 * len(seen)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "nvfp4_ds_mla"])
def test_sparse_equals_dense_when_nothing_is_dropped(fmt):
    model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta = _setup(
        "deepseek_v32", fmt, "bfloat16", topk=64)  # a model of its own: index_topk 64 >= 52
    q, kv_c, k_pe, ix = layer.inputs(hidden, pos)
    ix.cache = index_cache
    assert not layer.prefill.sparse.drops(meta.context_lens, meta.query_lens)
    dense = layer.prefill(q, kv_c, k_pe, kv_cache, meta)  # runs dense: nothing would be dropped
    sparse = sparse_forward(layer.prefill, q, kv_c, k_pe, kv_cache, meta, ix, None)
    assert rel_fro(sparse, dense) <= 1e-5  # on an fp8 cache: both read the same rows


def test_refusals_and_dense_families():
    model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta = _setup("deepseek_v32", "auto")
    q, kv_c, k_pe, _ = layer.inputs(hidden, pos)
    with pytest.raises(ValueError, match="index"):
        layer.prefill(q, kv_c, k_pe, kv_cache, meta)
    assert SparseConfig.from_config({"model_type": "deepseek_v3", "kv_lora_rank": 512}) is None
    with pytest.raises(ValueError, match="needs all of"):
        SparseConfig.from_config({"index_topk": 16})
    with pytest.raises(ValueError, match="index_topk"):
        SparseConfig(0, 4, 16)
    cfg = SparseConfig.from_config(model.config)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim, cfg.rope_interleaved) == (16, 4, 16, False)


def test_a_given_selection_is_used_as_is_and_checkpoint_weights_load():
    from mla_ext.integrations.transformers_indexer import IndexerParams

    model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta = _setup("glm_moe_dsa", "fp8")
    out = layer(hidden, pos, kv_cache, meta, index_cache=index_cache)
    sel = layer.last_selection.clone()
    q, kv_c, k_pe, _ = layer.inputs(hidden, pos)
    again = layer.prefill(q, kv_c, k_pe, kv_cache, meta, index=sel)  # a "shared" layer's call
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="selection"):
        layer.prefill(q, kv_c, k_pe, kv_cache, meta, index=sel[:3])
    state = {f"model.layers.0.self_attn.indexer.{k}": v for k, v in attn.indexer.state_dict().items()}
    ck = IndexerParams.from_state_dict(state, "model.layers.0.self_attn.indexer.", model.config, True)
    mod = IndexerParams.from_module(attn)
    assert all(torch.equal(getattr(ck, f), getattr(mod, f)) for f in ("wq_b", "wk", "k_norm_weight", "weights_proj"))
    assert (ck.n_heads, ck.head_dim, ck.rope_dim, ck.topk, ck.rope_interleaved) == \
        (mod.n_heads, mod.head_dim, mod.rope_dim, mod.topk, mod.rope_interleaved)
    with pytest.raises(ValueError, match="missing"):
        IndexerParams.from_state_dict({}, "x.", model.config, True)


def test_glm5_shared_layer_reuses_the_full_layers_selection():
    """GLM-5 ("full", "shared") layers: layer 1 has no indexer and attends layer 0's top-k."""
    model = tiny_model("glm_moe_dsa", topk=16, num_hidden_layers=2, indexer_types=["full", "shared"])
    full_attn, shared_attn = model.layers[0].self_attn, model.layers[1].self_attn
    assert shared_attn.indexer is None
    reqs = REQUESTS[:2]
    caps0 = [run_with_context(model, c, q, seed=40 + i, layer_idx=0) for i, (c, q) in enumerate(reqs)]
    caps1 = [run_with_context(model, c, q, seed=40 + i, layer_idx=1) for i, (c, q) in enumerate(reqs)]
    full = TransformersMLA(full_attn, CacheConfig("auto", block_size=B), index_cache_dtype="float32")
    shared = TransformersMLA(shared_attn, CacheConfig("auto", block_size=B))
    ctx = [c for c, _ in reqs]
    table, nb, slots = paged_layout(ctx, B, seed=2)
    caches = {n: torch.zeros(lay.prefill.spec.cache_shape(nb), dtype=lay.prefill.spec.storage_dtype)
              for n, lay in (("full", full), ("shared", shared))}
    index_cache = get_index_format("float32").empty(nb, B, 16, 16).zero_()
    for (c, _), c0, c1, s in zip(reqs, caps0, caps1, slots):
        if c:
            full.write_cache(c0.hidden[:c], _pos(c0)[:c], caches["full"], s, index_cache=index_cache)
            shared.write_cache(c1.hidden[:c], _pos(c1)[:c], caches["shared"], s)
    meta = PrefillMetadata(table, ctx, [q for _, q in reqs], block_size=B)

    def new(caps, field):
        return torch.cat([(_pos(cp) if field == "pos" else getattr(cp, field))[c:c + q]
                          for cp, (c, q) in zip(caps, reqs)])

    full(new(caps0, "hidden"), new(caps0, "pos"), caches["full"], meta, index_cache=index_cache)
    sel = full.last_selection
    with pytest.raises(ValueError, match="selection"):
        shared(new(caps1, "hidden"), new(caps1, "pos"), caches["shared"], meta)
    with pytest.raises(ValueError, match="index_cache: .*no indexer"):
        shared(new(caps1, "hidden"), new(caps1, "pos"), caches["shared"], meta, index_cache=index_cache)
    y = shared.o_proj(shared(new(caps1, "hidden"), new(caps1, "pos"), caches["shared"], meta, selection=sel))
    start = 0
    for (c, qn), c0, c1 in zip(reqs, caps0, caps1):
        rows = slice(start, start + qn)
        start += qn
        same = [t for t in range(qn) if {int(i) for i in sel[rows][t] if i >= 0}
                == {int(i) for i in c0.topk[t] if i <= c + t}]
        assert len(same) >= qn * 3 // 4
        assert rel_fro(y[rows][same], c1.out[same]) <= 1e-5


def test_bf16_model_and_the_triton_backend_in_the_layer():
    """A bf16 model through the layer (Triton sparse kernel forced, interpreter) against the float64
    oracle on what the cache holds, SPEC §9's bf16 bound; context parallelism is refused."""
    from mla_ext.prefill.layer import ContextParallel, MLAPrefill
    from mla_ext.sparse import sparse_attention as SA

    model = tiny_model("deepseek_v32", topk=16, dtype=torch.bfloat16)
    attn = model.layers[0].self_attn
    caps = [run_with_context(model, c, q, seed=60 + i) for i, (c, q) in enumerate(REQUESTS)]
    layer = TransformersMLA(attn, CacheConfig("fp8", block_size=B), index_cache_dtype="bfloat16")
    ctx = [c for c, _ in REQUESTS]
    table, nb, slots = paged_layout(ctx, B, seed=3)
    kv_cache = torch.zeros(layer.prefill.spec.cache_shape(nb), dtype=layer.prefill.spec.storage_dtype)
    index_cache = get_index_format("bfloat16").empty(nb, B, 16, 16).zero_()
    for (c, _), cap, s in zip(REQUESTS, caps, slots):
        if c:
            layer.write_cache(cap.hidden[:c], _pos(cap)[:c], kv_cache, s, KS, index_cache=index_cache)
    new = [slice(c, c + q) for c, q in REQUESTS]
    hidden = torch.cat([cap.hidden[s] for cap, s in zip(caps, new)])
    pos = torch.cat([_pos(cap)[s] for cap, s in zip(caps, new)])
    meta = PrefillMetadata(table, ctx, [q for _, q in REQUESTS], KS, block_size=B)
    with SA.SPARSE.force("triton"):
        out = layer(hidden, pos, kv_cache, meta, index_cache=index_cache)
    assert out.dtype == torch.bfloat16
    want = _oracle_on_cache(layer, attn, caps, kv_cache, slots, layer.prefill.last_selection, "fp8")
    assert rel_fro(out, want) <= 1e-2
    with pytest.raises(ValueError, match="context parallel"):
        MLAPrefill(layer.prefill.model, CacheConfig("fp8", block_size=B), layer.prefill.kv_b_proj, layer=0,
                   sparse=layer.prefill.sparse, context_parallel=ContextParallel(None, 2, 0, 1))


def test_write_cache_stores_the_indexer_keys_beside_the_latents():
    """write_cache(..., index_cache=) stores each context token's indexer key at its latent slot."""
    model, attn, caps, layer, kv_cache, index_cache, slots, hidden, pos, meta = _setup("deepseek_v32", "auto")
    for (c, _), cap, s in zip(REQUESTS, caps, slots):
        if c:
            want = layer.inputs(cap.hidden[:c], _pos(cap)[:c]).index.k
            torch.testing.assert_close(index_cache[s // B, s % B], want.float(), rtol=1e-6, atol=1e-6)
    assert layer.index_cache_spec.cache_shape(5) == (5, B, attn.indexer.head_dim)


def test_transformers_dsa_is_a_deprecated_alias_of_transformers_mla():
    from mla_ext.integrations.transformers_dsa import TransformersDSA

    model, _ = _model("deepseek_v32", False, 16)
    with pytest.warns(DeprecationWarning, match="TransformersMLA"):
        layer = TransformersDSA(model.layers[0].self_attn, CacheConfig("auto", block_size=B))
    assert isinstance(layer, TransformersMLA) and layer.sparse.index_topk == 16
