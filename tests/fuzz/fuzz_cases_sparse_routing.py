"""Fuzz class "sparse routing": every entry point that attends a possibly sparse (DSA) layer, for
every source a sparse layer comes from (tests/helpers/sparse_routing.py: a given SparseConfig, the
model config's own, the built-in sparse models once the config reader gives them one), gets the
same cases by construction (the ENTRY x SOURCE tables below):

  * a batch past index_topk runs sparse (forward with the indexer's inputs: the sparse path's
    answer) or is refused naming index_topk (forward without them, forward_context), and the
    serving-engine hooks leave it to the engine with a reason naming index_topk;
  * a batch within index_topk is the dense layer's answer, bit for bit (nothing is dropped);
  * an index cache whose geometry does not fit the latent plan (page size, row width, dtype,
    blocks, not a tensor) is refused naming it, at prepare, check_index_cache and forward;
  * TransformersMLA over transformers' own DSA modules (deepseek_v32, glm_moe_dsa) runs sparse past
    index_topk with an index cache and refuses without one, naming index_cache.

A new entry point (a row of CONTEXT_ENTRIES / HOOKS) or source (sparse_routing_data.SOURCES) gets
every case."""
from __future__ import annotations

import types

import torch

from fuzz_harness import QUICK, Call, add
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.sparse.index_cache import get_index_format
from mla_ext.prefill.sparse import sparse_forward
from helpers.prefill import BLOCK
from helpers.sparse_routing import (SPARSE, SPARSE_TINY, available_sources, batch_for, model_config_says, past,
                                 sparse_layer, weight)

PREFILL = "mla_ext.prefill.layer:MLAPrefill"
FORWARD, CONTEXT = f"{PREFILL}.forward", f"{PREFILL}.forward_context"
PREPARE, CHECK = f"{PREFILL}.prepare", f"{PREFILL}.check_index_cache"
WITHIN = dict(ctx=[4, 0, 3], qlens=[2, 3, 4])  # within any index_topk >= 8


def _layer(source):
    """The source's sparse layer, built in the child (a model-config source answers there only)."""
    if source == "model_config":
        with model_config_says(SPARSE_TINY, SPARSE):
            return sparse_layer(source)
    return sparse_layer(source)


def _dense_twin(layer):
    """The same layer (model dims, weight, cache format), dense."""
    return MLAPrefill(replace_model(layer), CacheConfig(layer.kv_cache_dtype, block_size=BLOCK),
                      layer.kv_b_proj, layer=layer.layer_index, workspace_rows_override=layer.workspace_rows,
                      max_num_seqs=8)


def replace_model(layer):
    from dataclasses import replace

    return replace(layer.model, name=layer.model.name + " (dense twin)")


def _setup(source, lens):
    layer = _layer(source)
    lens = lens if isinstance(lens, dict) else past(layer.sparse.index_topk)
    return (layer, *batch_for(layer, **lens))


def _equal(want_fn):
    def check(got):
        want = want_fn()
        pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
        for a, b in pairs:
            assert torch.equal(a, b), "differs from the expected answer"
    return check


# -- MLAPrefill.forward / forward_context: sparse or refused past index_topk; dense within -----------

def _forward_past_without_index(source):
    def build(g):
        layer, q, kv_c, k_pe, cache, meta, ix = _setup(source, "past")
        return Call(lambda: layer(q, kv_c, k_pe, cache, meta))
    return build


def _forward_past_with_index(source):
    def build(g):
        layer, q, kv_c, k_pe, cache, meta, ix = _setup(source, "past")

        def run():
            out = layer(q, kv_c, k_pe, cache, meta, index=ix)
            assert getattr(layer, "last_selection", None) is not None, "the sparse path did not run"
            return out
        return Call(run, _equal(lambda: sparse_forward(layer, q, kv_c, k_pe, cache, meta, ix, None)))
    return build


def _forward_within(source):
    def build(g):
        layer, q, kv_c, k_pe, cache, meta, ix = _setup(source, WITHIN)
        twin = _dense_twin(layer)
        return Call(lambda: layer(q, kv_c, k_pe, cache, meta), _equal(lambda: twin(q, kv_c, k_pe, cache, meta)))
    return build


def _context_past(source):
    def build(g):
        layer, q, kv_c, k_pe, cache, meta, ix = _setup(source, "past")
        return Call(lambda: layer.forward_context(q, cache, meta))
    return build


def _context_within(source):
    def build(g):
        layer, q, kv_c, k_pe, cache, meta, ix = _setup(source, WITHIN)
        twin = _dense_twin(layer)
        return Call(lambda: layer.forward_context(q, cache, meta), _equal(lambda: twin.forward_context(q, cache, meta)))
    return build


# (entry, case name, build(source), expect, args a refusal must name)
CONTEXT_ENTRIES = (
    (FORWARD, "past_index_topk_without_index", _forward_past_without_index, "reject", ("index_topk",)),
    (FORWARD, "past_index_topk_runs_sparse", _forward_past_with_index, "accept", ()),
    (FORWARD, "within_index_topk_is_dense", _forward_within, "accept", ()),
    (CONTEXT, "past_index_topk", _context_past, "reject", ("index_topk",)),
    (CONTEXT, "within_index_topk_is_dense", _context_within, "accept", ()),
)


# -- the serving-engine context hooks: served within index_topk, left to the engine past it ---------

def _vllm_hook(source, which):
    def build(g):
        from mla_ext.vllm import absorbed_context as AC

        layer = _layer(source)
        lens = past(layer.sparse.index_topk) if which == "past" else WITHIN
        prefill = types.SimpleNamespace(chunked_context=types.SimpleNamespace(context_lens_list=lens["ctx"]),
                                        query_lens_cpu=torch.tensor(lens["qlens"]))
        md = types.SimpleNamespace(topk_tokens=layer.sparse.index_topk, prefill=prefill)

        def check(why):
            if which == "past":
                assert why is not None and f"index_topk={layer.sparse.index_topk}" in why, why
            else:
                assert why is None, why
        return Call(lambda: AC.sparse_refusal(types.SimpleNamespace(is_sparse=True), md), check)
    return build


def _sglang_hook(source, which):
    def build(g):
        from mla_ext.sglang import chunked_prefix as CP
        from mla_ext.sglang.pool_view import Unsupported

        layer = _layer(source)
        s = layer.sparse
        attn = types.SimpleNamespace(use_dsa=True, indexer=types.SimpleNamespace(
            index_topk=s.index_topk, n_heads=s.index_n_heads, head_dim=s.index_head_dim))
        lens = past(s.index_topk) if which == "past" else WITHIN

        def decide():
            try:
                CP.dsa_refusal(attn, lens["ctx"], lens["qlens"])
            except Unsupported as exc:
                return str(exc)
            return None

        def check(why):
            if which == "past":
                assert why is not None and f"index_topk={s.index_topk}" in why, why
            else:
                assert why is None, why
            assert CP._sparse_of(attn).index_topk == s.index_topk  # its MLAPrefill is sparse too
        return Call(decide, check)
    return build


HOOKS = (("vllm_context_hook", _vllm_hook), ("sglang_chunked_prefix_hook", _sglang_hook))


# -- index cache geometry against the latent plan ---------------------------------------------------

def _bad_index_cache(layer, nb, what):
    s = layer.sparse
    fmt = get_index_format(s.index_cache_dtype)
    D = s.index_head_dim
    other = "bfloat16" if s.index_cache_dtype != "bfloat16" else "float32"
    return {
        "page_size": lambda: fmt.empty(nb, BLOCK // 2, D, D),
        "width": lambda: torch.empty(nb, BLOCK, fmt.cache_shape(1, BLOCK, D, D)[2] + 3, dtype=fmt.storage_dtype),
        "dtype": lambda: get_index_format(other).empty(nb, BLOCK, D, D),
        "blocks": lambda: fmt.empty(nb - 1, BLOCK, D, D),
        "not_a_tensor": lambda: [[0.0]],
    }[what]()


def _geometry(source, what, entry):
    def build(g):
        layer, q, kv_c, k_pe, cache, meta, ix = _setup(source, "past")
        bad = _bad_index_cache(layer, cache.shape[0], what)
        if entry == PREPARE:
            return Call(lambda: layer.prepare(cache, index_cache=bad, warm=False))
        if entry == CHECK:
            return Call(lambda: layer.check_index_cache(bad, cache))
        ix.cache = bad
        return Call(lambda: layer(q, kv_c, k_pe, cache, meta, index=ix))
    return build


GEOMETRY = ("page_size", "width", "dtype", "blocks", "not_a_tensor")

for _source in available_sources():
    _tag = _source.replace(":", "_").replace("-", "_").replace(".", "")
    for _entry, _name, _make, _expect, _args in CONTEXT_ENTRIES:
        add(_entry, f"sparse_routing_{_tag}_{_name}", _make(_source), _expect, _args)
    for _hook, _make in HOOKS:
        for _which in ("past", "within"):
            add(CONTEXT, f"sparse_routing_{_tag}_{_hook}_{_which}_index_topk", _make(_source, _which), "accept",
                note="the hook's decision: left to the engine naming index_topk past it, served within")
    for _what in GEOMETRY:
        for _entry in (PREPARE, CHECK, FORWARD):
            add(_entry, f"sparse_routing_{_tag}_index_cache_{_what}", _geometry(_source, _what, _entry), "reject",
                ("index_cache", "index.cache"), timeout=QUICK if not _source.startswith("builtin") else 60.0)


# -- TransformersMLA over transformers' own DSA modules --------------------------------------------

def _transformers_case(family, with_cache):
    def build(g):
        from mla_ext.integrations.transformers_deepseek import TransformersMLA
        from helpers.sparse_cache import paged_layout
        from helpers.sparse import tiny_model

        model = tiny_model(family, topk=8)
        layer = TransformersMLA(model.layers[0].self_attn, CacheConfig("auto", block_size=BLOCK),
                                index_cache_dtype="float32")
        ctx, new = [12, 0], [2, 3]
        table, nb, slots = paged_layout(ctx, BLOCK, seed=1)
        kv = torch.zeros(layer.prefill.spec.cache_shape(nb), dtype=layer.prefill.spec.storage_dtype)
        index_cache = layer.index_cache_spec.format.empty(nb, BLOCK, 16).zero_()
        gen = torch.Generator().manual_seed(5)
        hidden = [torch.randn(c + q, 64, generator=gen) for c, q in zip(ctx, new)]
        for h, c, s in zip(hidden, ctx, slots):
            if c:
                layer.write_cache(h[:c], torch.arange(c), kv, s, index_cache=index_cache)
        from mla_ext.prefill.layer import PrefillMetadata

        meta = PrefillMetadata(table, ctx, new, block_size=BLOCK)
        x = torch.cat([h[c:] for h, c in zip(hidden, ctx)])
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, new)])

        def run():
            out = layer(x, pos, kv, meta, index_cache=index_cache if with_cache else None)
            assert layer.last_selection is not None and layer.last_selection.shape == (sum(new), 8)
            return out

        def check(out):
            assert torch.isfinite(out).all()
        return Call(run, check if with_cache else None)
    return build


def _transformers_families() -> tuple[str, ...]:
    """The DSA families whose modeling files import here (imported now, in the parent: every forked
    case then finds them loaded instead of importing them itself, seconds each)."""
    import importlib

    try:
        for f in ("deepseek_v32", "glm_moe_dsa"):
            importlib.import_module(f"transformers.models.{f}.modeling_{f}")
    except ImportError:  # transformers is a test dependency; without it these cases cannot be built
        return ()
    return ("deepseek_v32", "glm_moe_dsa")


for _family in _transformers_families():
    add(FORWARD, f"sparse_routing_transformers_{_family}_past_index_topk_runs_sparse",
        _transformers_case(_family, True), "accept")
    add(FORWARD, f"sparse_routing_transformers_{_family}_past_index_topk_without_index_cache",
        _transformers_case(_family, False), "reject", ("index_cache",))
