"""Fuzz cases of the host side: the MLA layer (MLAPrefill, PrefillMetadata,
ContextParallel), chunk planning, model configs, the per-layer cache policy,
the pool planner, the format registry (and the raw format_info /
ds_mla_layout / build_info ops), and the CLI's argument handling.

Each case either checks an accepted call against what SPEC says (the one-shot
oracle for the layer, chunk invariants of §8, page sizes of §4, scales of
§10) or expects a prompt ValueError naming the argument; inputs whose size
comes from a number (a context length, a layer count, a budget) must be
refused in O(1), so those cases have a short timeout.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import math
import os

import numpy as np
import torch

from fuzz_harness import QUICK, Call, add, case_dir, report_rows_case
from helpers.numeric import assert_close_rel
from mla_ext import cli
from mla_ext.config import formats, models, planner, policy
from mla_ext.kv_b_proj import weights as W
from mla_ext.prefill import chunking
from mla_ext.prefill import layer as L
from mla_ext.prefill.reference import mla_prefill_reference
from helpers.prefill import BLOCK, TINY, Batch, make_weight

BF16 = torch.bfloat16
META = torch.device("meta")
GIB = 1 << 30

LAYER = "mla_ext.prefill.layer"
PREFILL = f"{LAYER}:MLAPrefill"
META_E = "mla_ext.prefill.metadata:PrefillMetadata"
CHUNK = "mla_ext.prefill.chunking"
MOD = "mla_ext.config.models"
POL = "mla_ext.config.policy"
PLAN = "mla_ext.config.planner"
FMT = "mla_ext.config.formats"
CLI = "mla_ext.cli"

V3_JSON = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "num_attention_heads": 16, "num_hidden_layers": 4, "max_position_embeddings": 4096}


def simple(entry: str, name: str, fn, expect: str = "reject", args=(), check=None, **kw) -> None:
    """A case whose call needs no guarded tensors."""
    def build(g):
        return Call(fn, check)
    add(entry, name, build, expect, args, **kw)


def that(pred, explain=repr):
    """A check: pred(result) must hold; `explain(result)` says what was got otherwise."""
    def check(got):
        assert pred(got), str(explain(got))[:300]
    return check


def equals(want):
    def check(got):
        assert got == want, f"got {got!r}, expected {want!r}"
    return check


# ---------------------------------------------------------------------------
# MLAPrefill / PrefillMetadata
# ---------------------------------------------------------------------------

def _weight(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    return make_weight("dense", w)


def make_layer(fmt: str = "fp8", **kw) -> L.MLAPrefill:
    kw.setdefault("layer", 1)
    kw.setdefault("workspace_rows_override", 32)
    kw.setdefault("max_num_seqs", 8)
    return L.MLAPrefill(TINY, policy.CacheConfig(fmt, block_size=BLOCK), _weight(), **kw)


def prefill_setup(g, fmt: str = "fp8", *, ctx=(40, 0, 9), qlens=(2, 1, 3), seed: int = 3, layer_kw=None) -> dict:
    """A valid forward call: guarded inputs, the layer, and the oracle's output."""
    batch = Batch(ctx_lens=list(ctx), q_lens=list(qlens), seed=seed)
    layer = make_layer(fmt, **(layer_kw or {}))
    k_scale = torch.tensor([0.02])
    cache = batch.fill_cache(layer, k_scale if layer.spec.is_quantized else None)
    kv_c, k_pe = batch.cached_rows(layer, cache, k_scale if layer.spec.is_quantized else None)
    want = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
                                 layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                 layer.softmax_scale)
    table = g.put(batch.block_table, "block_table")
    return dict(layer=layer, batch=batch, want=want, q=g.put(batch.q, "q"),
                kv_c_normed=g.put(batch.kv_c_new, "kv_c_normed"), k_pe=g.put(batch.k_pe_new, "k_pe"),
                kv_cache=g.put(cache, "kv_cache"),
                metadata=L.PrefillMetadata(table, batch.ctx_lens, batch.q_lens, block_size=BLOCK),
                kw=dict(k_scale=g.put(k_scale, "k_scale")))


def prefill_call(a: dict, check: bool = True) -> Call:
    def fn():
        return a["layer"](a["q"], a["kv_c_normed"], a["k_pe"], a["kv_cache"], a["metadata"], **a["kw"])

    def verify(out):
        want = a["want"]
        assert_close_rel(out, want.to(out.dtype) if out.shape == want.shape else want, "out",
                         tol=1e-2)
    return Call(fn, verify if check else None)


def P(name, expect="accept", args=(), mutate=None, *, fmt="fp8", setup=None, timeout=60.0, reference=True):
    def build(g):
        a = prefill_setup(g, fmt, **(setup or {}))
        if mutate is not None:
            mutate(g, a)
        return prefill_call(a, check=reference and expect != "reject")
    add(PREFILL, name, build, expect, args, timeout=timeout, also=(f"{PREFILL}.forward",))


# Every registered format a bf16 model with DeepSeek's latent dims can use (the named
# native formats bfloat16/float16 are "auto" here or refused: a native cache holds the model dtype).
LAYER_FORMATS = tuple(f.name for f in formats.FORMATS
                      if f.supports_dims(TINY.L, TINY.R) and (f.is_quantized or f.storage == "model"))
for _fmt in LAYER_FORMATS:
    P(f"valid_{_fmt}", fmt=_fmt)
for _fmt in LAYER_FORMATS:  # context attention in latent space, straight from the paged cache
    P(f"valid_absorbed_{_fmt}", fmt=_fmt, setup=dict(layer_kw=dict(context_attention="absorbed")))
P("valid_up_project", setup=dict(layer_kw=dict(context_attention="up_project")))
P("valid_skipped_layer", fmt="fp8_ds_mla", setup=dict(layer_kw=dict(layer=None, prefix="model.layers.0.attn")))
P("one_chunk_per_request", setup=dict(ctx=(70, 5, 33), qlens=(1, 2, 1)))
P("workspace_given", mutate=lambda g, a: a["kw"].update(
    workspace=g.put(torch.zeros(48, TINY.L + TINY.R, dtype=BF16), "workspace", writable=True, pad=8)))
P("no_context_at_all", setup=dict(ctx=(0, 0), qlens=(3, 1)))
P("no_new_tokens", setup=dict(ctx=(40, 9), qlens=(0, 0)))


def _meta(a, g=None, **kw):
    b = a["batch"]
    args = dict(block_table=a["metadata"].block_table, context_lens=b.ctx_lens, query_lens=b.q_lens,
                block_size=BLOCK)
    args.update(kw)
    return L.PrefillMetadata(args.pop("block_table"), args.pop("context_lens"), args.pop("query_lens"),
                             block_size=args.pop("block_size"), **args)


def _narrow_table(g, a):
    # ctx 40 needs 3 blocks of 16; the table keeps 2 columns (the campaign: silently wrong).
    a["metadata"] = _meta(a, block_table=g.put(a["metadata"].block_table[:, :2].contiguous(), "bt2"))


P("table_narrower_than_context", "reject", ("context_lens", "block_table"), _narrow_table)


def _huge_context(g, a):
    # The campaign's hang: a huge context length against a 3-block table.
    table = g.put(a["metadata"].block_table[:1, :3].contiguous(), "bt3")
    a.update(q=a["q"][:2], kv_c_normed=a["kv_c_normed"][:2], k_pe=a["k_pe"][:2],
             metadata=L.PrefillMetadata(table, [10**12], [2], block_size=BLOCK))


P("huge_context_vs_3_block_table", "reject", ("context_lens", "block_table"), _huge_context, timeout=QUICK)
P("int32_max_context", "reject", ("context_lens", "block_table"),
  lambda g, a: a.update(metadata=_meta(a, context_lens=[2**31 - 1, 0, 9])), timeout=QUICK)


def _bad_id(g, a):
    bt = a["metadata"].block_table.clone()
    bt[0, 1] = 10**6
    a["metadata"] = _meta(a, block_table=g.put(bt, "bt_bad"))


P("block_id_out_of_range", "reject", ("block_table",), _bad_id)
P("block_id_out_of_range_validate_off", "either", ("block_table",),
  lambda g, a: (_bad_id(g, a), a["kw"].update(validate=False)), reference=False)
P("absorbed_block_id_out_of_range", "reject", ("block_table",), _bad_id,
  setup=dict(layer_kw=dict(context_attention="absorbed")))
P("absorbed_block_id_out_of_range_validate_off", "either", ("block_table",),
  lambda g, a: (_bad_id(g, a), a["kw"].update(validate=False)), reference=False,
  setup=dict(layer_kw=dict(context_attention="absorbed")))
P("absorbed_table_narrower_than_context", "reject", ("context_lens", "block_table"), _narrow_table,
  setup=dict(layer_kw=dict(context_attention="absorbed")))
P("absorbed_k_scale_nan", "reject", ("k_scale",), lambda g, a: a["kw"]["k_scale"].fill_(float("nan")),
  setup=dict(layer_kw=dict(context_attention="absorbed")))
P("metadata_for_another_block_size", "reject", ("metadata", "block_size"),
  lambda g, a: a.update(metadata=_meta(a, block_size=64)))
P("q_wrong_heads", "reject", ("q",), lambda g, a: a.update(q=a["q"][:, :1]))
P("q_fp32", "reject", ("q",), lambda g, a: a.update(q=a["q"].float()))
P("q_on_meta", "reject", ("q", "kv_c_normed", "k_pe", "kv_cache"), lambda g, a: a.update(q=a["q"].to(META)))
P("kv_c_normed_fp16", "reject", ("kv_c_normed",), lambda g, a: a.update(kv_c_normed=a["kv_c_normed"].half()))
P("k_pe_wrong_width", "reject", ("k_pe",), lambda g, a: a.update(k_pe=a["k_pe"][:, :32]))
P("kv_cache_wrong_entry", "reject", ("kv_cache",), lambda g, a: a.update(kv_cache=a["kv_cache"][..., :500]))
P("kv_cache_bf16_for_fp8_layer", "reject", ("kv_cache",), lambda g, a: a.update(
    kv_cache=g.put(torch.zeros(a["kv_cache"].shape, dtype=BF16), "cache_bf16")))
P("kv_cache_not_a_tensor", "reject", ("kv_cache",), lambda g, a: a.update(kv_cache=None))
P("metadata_dict", "reject", ("metadata",), lambda g, a: a.update(metadata={"block_table": None}))
P("block_table_on_meta", "reject", ("block_table",),
  lambda g, a: a.update(metadata=_meta(a, block_table=a["metadata"].block_table.to(META))))
P("k_scale_missing", "reject", ("k_scale",), lambda g, a: a["kw"].update(k_scale=None))
for _label, _v in (("nan", float("nan")), ("zero", 0.0), ("negative", -1.0)):
    P(f"k_scale_{_label}", "reject", ("k_scale",), lambda g, a, v=_v: a["kw"]["k_scale"].fill_(v))
P("k_scale_float", "reject", ("k_scale",), lambda g, a: a["kw"].update(k_scale=0.02))
P("workspace_too_small", "reject", ("workspace",), lambda g, a: a["kw"].update(
    workspace=g.put(torch.zeros(8, TINY.L + TINY.R, dtype=BF16), "ws", writable=True)))


def _workspace_over_q(g, a):
    # q lives inside the workspace the context rows are gathered into.
    ws = g.put(torch.zeros(64, TINY.L + TINY.R, dtype=BF16), "workspace_and_q", writable=True)
    q = ws.view(-1)[:a["q"].numel()].view(a["q"].shape)
    q.copy_(a["q"])
    a["q"] = q
    a["kw"]["workspace"] = ws


P("workspace_overlaps_q", "either", ("workspace", "q"), _workspace_over_q)
P("validate_str", "reject", ("validate",), lambda g, a: a["kw"].update(validate="no"))
P("clock_garbage", "reject", ("clock",), lambda g, a: a["kw"].update(clock=42))


def ctor(name, make, expect="reject", args=(), **kw):
    def build(g):
        def check(layer):
            assert isinstance(layer, L.MLAPrefill), type(layer)
        return Call(make, check)
    add(PREFILL, name, build, expect, args, **kw)


ctor("ctor_valid_prefix", lambda: make_layer(layer=None, prefix="model.layers.3.self_attn"), "accept")
ctor("ctor_model_name_str", lambda: L.MLAPrefill("deepseek-v3", policy.CacheConfig(), _weight(), layer=0),
     args=("model",))
ctor("ctor_cache_config_dict", lambda: L.MLAPrefill(TINY, {"kv_cache_dtype": "fp8"}, _weight(), layer=0),
     args=("cache_config",))
ctor("ctor_kv_b_proj_wrong_shape", lambda: L.MLAPrefill(TINY, policy.CacheConfig(),
                                                         W.DenseWeight(torch.zeros(8, 512)), layer=0),
     args=("kv_b_proj",))
ctor("ctor_kv_b_proj_none", lambda: L.MLAPrefill(TINY, policy.CacheConfig(), None, layer=0), args=("kv_b_proj",))
ctor("ctor_use_fp8_prefill_no", lambda: make_layer(use_fp8_prefill="no"), args=("use_fp8_prefill",))
ctor("ctor_layer_bool", lambda: make_layer(layer=True), args=("layer",))
ctor("ctor_layer_out_of_range", lambda: make_layer(layer=4), args=("layer",))
ctor("ctor_prefix_two_ints", lambda: make_layer(layer=None, prefix="model.layers.1.experts.7"), args=("prefix",))
ctor("ctor_no_layer", lambda: make_layer(layer=None), args=("layer", "prefix"))
for _label, _v in (("nan", float("nan")), ("zero", 0.0), ("str", "0.1"), ("bool", True)):
    ctor(f"ctor_softmax_scale_{_label}", lambda v=_v: make_layer(softmax_scale=v), args=("softmax_scale",))
ctor("ctor_max_num_seqs_zero", lambda: make_layer(max_num_seqs=0), args=("max_num_seqs",))
ctor("ctor_workspace_override_negative", lambda: make_layer(workspace_rows_override=-1),
     args=("override", "workspace"))
ctor("ctor_workspace_override_huge", lambda: make_layer(workspace_rows_override=2**40),
     args=("override", "workspace"), timeout=QUICK)
ctor("ctor_context_parallel_str", lambda: make_layer(context_parallel="2"), args=("context_parallel",))
ctor("ctor_validate_str", lambda: make_layer(validate="yes"), args=("validate",))
for _label, _v in (("unknown", "latent"), ("bool", True), ("none", None), ("upper", "ABSORBED")):
    ctor(f"ctor_context_attention_{_label}", lambda v=_v: make_layer(context_attention=v), args=("context_attention",))


def method(name, call, expect="reject", args=(), check=None, fmt="fp8"):
    def build(g):
        layer = make_layer(fmt)
        return Call(lambda: call(layer, g), check)
    add(PREFILL, name, build, expect, args)


def _write(layer, g, **kw):
    kv_c = g.put(torch.randn(3, TINY.L).to(BF16), "kv_c")
    k_pe = g.put(torch.randn(3, TINY.R).to(BF16), "k_pe")
    cache = g.put(torch.zeros(4, BLOCK, TINY.L + TINY.R, dtype=torch.uint8), "kv_cache", writable=True)
    slots = g.put(torch.tensor([0, 5, 17]), "slot_mapping")
    args = dict(kv_cache=cache, slot_mapping=slots, k_scale=g.put(torch.tensor([0.1]), "k_scale"))
    args.update(kw)
    return layer.write_cache(kv_c, k_pe, args["kv_cache"], args["slot_mapping"], args["k_scale"])


method("write_cache_valid", _write, "accept")
method("write_cache_without_k_scale", lambda l, g: _write(l, g, k_scale=None), args=("k_scale",))
method("write_cache_wrong_cache", lambda l, g: _write(l, g, kv_cache=torch.zeros(4, 8, 576, dtype=torch.uint8)),
       args=("kv_cache",))
method("compute_kv_scale_valid", lambda l, g: l.compute_kv_scale(torch.ones(2, TINY.L, dtype=BF16),
                                                                  torch.ones(2, TINY.R, dtype=BF16)), "accept")
method("explain_valid", lambda l, g: l.explain(), "accept", check=that(lambda t: "layer 1" in t, lambda t: t))
method("explain_device_garbage", lambda l, g: l.explain("tpu9"), args=("device",))
method("explain_context_str", lambda l, g: l.explain_context("meta"), args=("metadata",))  # a string, not metadata
method("explain_context_none", lambda l, g: l.explain_context(None), args=("metadata",))


def meta_case(name, make, expect="reject", args=(), check=None, **kw):
    def build(g):
        return Call(lambda: make(g), check)
    add(META_E, name, build, expect, args, **kw)


def _bt(g, rows=2, cols=3):
    return g.put(torch.arange(rows * cols, dtype=torch.int32).view(rows, cols), "block_table")


meta_case("valid_numpy_lengths", lambda g: L.PrefillMetadata(_bt(g), np.array([5, 0]), np.array([1, 2])),
          "accept")
meta_case("valid_tensor_lengths", lambda g: L.PrefillMetadata(_bt(g), torch.tensor([5, 0]), [1, 2]), "accept")
meta_case("block_table_int64", lambda g: L.PrefillMetadata(_bt(g).long(), [5, 0], [1, 2]), args=("block_table",))
meta_case("block_table_1d", lambda g: L.PrefillMetadata(_bt(g)[0], [5], [1]), args=("block_table",))
meta_case("block_table_fewer_rows", lambda g: L.PrefillMetadata(_bt(g, rows=1), [5, 0], [1, 2]),
          args=("block_table",))
meta_case("block_table_list", lambda g: L.PrefillMetadata([[0, 1]], [5], [1]), args=("block_table",))
for _label, _v in (("float", [5.5, 0]), ("negative", [-1, 0]), ("bool", [True, 0]), ("str", "50"),
                   ("dict", {0: 5, 1: 0}), ("none", None), ("float_tensor", torch.tensor([5.0, 0.0])),
                   ("nested", [[5], [0]])):
    meta_case(f"context_lens_{_label}", lambda g, v=_v: L.PrefillMetadata(_bt(g), v, [1, 2]),
              args=("context_lens",))
meta_case("query_lens_count", lambda g: L.PrefillMetadata(_bt(g), [5, 0], [1]), args=("query_lens",))
meta_case("k_scale_list", lambda g: L.PrefillMetadata(_bt(g), [5, 0], [1, 2], [0.5]), args=("k_scale",))
meta_case("k_scale_fp16", lambda g: L.PrefillMetadata(_bt(g), [5, 0], [1, 2], torch.tensor([0.5]).half()),
          args=("k_scale",))
for _label, _v in (("zero", 0), ("bool", True), ("str", "16"), ("float", 16.0)):
    meta_case(f"block_size_{_label}", lambda g, v=_v: L.PrefillMetadata(_bt(g), [5, 0], [1, 2], block_size=v),
              args=("block_size",))


def _assign(g, field, value):
    m = L.PrefillMetadata(_bt(g), [5, 0], [1, 2], block_size=16)
    m.plan(32, 16)
    setattr(m, field, value)
    return m


meta_case("reassign_context_lens", lambda g: _assign(g, "context_lens", (40, 0)), args=("context_lens",))
meta_case("reassign_block_table", lambda g: _assign(g, "block_table", _bt(g)), args=("block_table",))
meta_case("delete_query_lens", lambda g: delattr(L.PrefillMetadata(_bt(g), [5], [1]), "query_lens"),
          args=("query_lens",))
meta_case("plan_rows_zero", lambda g: L.PrefillMetadata(_bt(g), [5, 0], [1, 2]).plan(0, 16),
          args=("workspace_rows",))
meta_case("plan_valid", lambda g: L.PrefillMetadata(_bt(g), [50, 0], [1, 2]).plan(32, 16), "accept",
          check=that(lambda p: sum(c.total_rows for c in p.chunks) == 50, lambda p: p))

CP = "mla_ext.prefill.metadata:ContextParallel"
simple(CP, "valid", lambda: L.ContextParallel(None, 2, 1, 4), "accept")
simple(CP, "cp_size_zero", lambda: L.ContextParallel(None, 0, 0), args=("cp_size",))
simple(CP, "rank_past_size", lambda: L.ContextParallel(None, 2, 2), args=("rank",))
simple(CP, "interleave_str", lambda: L.ContextParallel(None, 2, 0, "1"), args=("interleave",))
simple(CP, "rank_bool", lambda: L.ContextParallel(None, 2, True), args=("rank",))


# ---------------------------------------------------------------------------
# Chunk planning (SPEC §8)
# ---------------------------------------------------------------------------

def check_plan(ctx, qlens, W_, A):
    """The SPEC §8 invariants of a plan."""
    def check(plan):
        seen = {r: [] for r in range(len(ctx))}
        for c in plan.chunks:
            assert c.total_rows <= W_, f"chunk {c.index} has {c.total_rows} rows > W={W_}"
            for i, r in enumerate(c.req_ids):
                if c.chunk_lens[i]:
                    seen[r].append((c.seq_starts[i], c.chunk_lens[i]))
                    if i > 0:
                        assert c.seq_starts[i] == 0, f"request {r} continues inside chunk {c.index}"
                    assert c.seq_starts[i] % A == 0, f"split point {c.seq_starts[i]} not a multiple of {A}"
            assert c.cu_seqlens_q[-1] == sum(qlens[c.req_start:c.req_end]), "query rows of the chunk"
        for r, n in enumerate(ctx):
            spans = sorted(seen[r])
            at = 0
            for s, k in spans:
                assert s == at, f"request {r}: rows {at}..{s - 1} gathered {'twice' if s < at else 'never'}"
                at += k
            assert at == n, f"request {r}: {at} of {n} context rows gathered"
    return check


def plan(name, ctx, qlens, W_=64, A=16, expect="accept", args=(), timeout=60.0, check=None):
    fn = lambda: chunking.plan_context_chunks(ctx, qlens, W_, A)  # noqa: E731
    if check is None and expect != "reject":
        check = check_plan(list(ctx), list(qlens), W_, A)
    simple(f"{CHUNK}:plan_context_chunks", name, fn, expect, args, check=check, timeout=timeout)


plan("valid_mixed", [70, 0, 5, 1, 33, 0], [3, 2, 1, 2, 4, 1])
plan("valid_exact_fit", [64, 64, 0], [1, 1, 1])
plan("valid_all_empty", [0, 0], [1, 2])
plan("valid_no_requests", [], [])
plan("one_long_beside_31_short", [60000] + [100] * 31, [1] * 32, W_=65536, A=64,
     check=that(lambda p: p.num_chunks <= 2, lambda p: p.num_chunks))
plan("campaign_hang_1e12_tokens", [10**12], [1], 65536, 64, "reject", ("context_lens",), timeout=QUICK)
plan("too_many_chunks", [2**31 - 1] * 3, [1] * 3, 64, 64, "reject", ("workspace_rows", "context_lens"),
     timeout=QUICK)
plan("huge_query_rows", [1], [2**31], 64, 16, "reject", ("query_lens",), timeout=QUICK)
plan("w_not_multiple_of_a", [5], [1], 60, 16, "reject", ("workspace_rows",))
plan("w_zero", [5], [1], 0, 16, "reject", ("workspace_rows",))
plan("w_huge", [5], [1], 2**40, 16, "reject", ("workspace_rows",), timeout=QUICK)
plan("alignment_zero", [5], [1], 64, 0, "reject", ("alignment",))
plan("w_float", [5], [1], 64.0, 16, "reject", ("workspace_rows",))
plan("w_bool", [5], [1], True, 1, "reject", ("workspace_rows",))
plan("lens_count_differs", [5, 1], [1], expect="reject", args=("query_lens",))
plan("ctx_negative", [-5], [1], expect="reject", args=("context_lens",))
plan("ctx_float", [5.5], [1], expect="reject", args=("context_lens",))
plan("ctx_str", "123", [1, 1, 1], expect="reject", args=("context_lens",))
plan("ctx_bytes", b"\x05", [1], expect="reject", args=("context_lens",))
plan("ctx_none", None, [1], expect="reject", args=("context_lens",))
plan("ctx_numpy_float", np.array([5.0]), [1], expect="reject", args=("context_lens",))
plan("ctx_tensor_2d", torch.tensor([[5]]), [1], expect="reject", args=("context_lens",))
plan("ctx_numpy_ints", np.array([40, 3]), np.array([1, 1]))
plan("ctx_generator", (n for n in [40, 3]), [1, 1], check=lambda p: None)
plan("qlens_negative", [5], [-1], expect="reject", args=("query_lens",))

simple(f"{CHUNK}:lengths", "valid", lambda: chunking.lengths((3, np.int64(4)), "x"), "accept", check=equals([3, 4]))
simple(f"{CHUNK}:lengths", "float", lambda: chunking.lengths([1.0], "ctx"), args=("ctx",))
simple(f"{CHUNK}:lengths", "meta_tensor", lambda: chunking.lengths(torch.tensor([1]).to(META), "ctx"),
       args=("ctx",))
simple(f"{CHUNK}:workspace_alignment", "valid_cp", lambda: chunking.workspace_alignment(64, 4, 3), "accept",
       check=equals(192))
simple(f"{CHUNK}:workspace_alignment", "block_zero", lambda: chunking.workspace_alignment(0), args=("block_size",))
simple(f"{CHUNK}:workspace_alignment", "cp_str", lambda: chunking.workspace_alignment(16, "2"), args=("cp_size",))
simple(f"{CHUNK}:workspace_rows", "spec_default", lambda: chunking.workspace_rows(163840, 256, 64), "accept",
       check=equals(65536))
simple(f"{CHUNK}:workspace_rows", "rounded_to_block", lambda: chunking.workspace_rows(10, 1, 48), "accept",
       check=equals(192))
simple(f"{CHUNK}:workspace_rows", "override_rounded", lambda: chunking.workspace_rows(10, 1, 16, override=33),
       "accept", check=equals(48))
simple(f"{CHUNK}:workspace_rows", "override_huge", lambda: chunking.workspace_rows(10, 1, 16, override=2**40),
       args=("override",), timeout=QUICK)
simple(f"{CHUNK}:workspace_rows", "max_model_len_zero", lambda: chunking.workspace_rows(0, 1, 16),
       args=("max_model_len",))
simple(f"{CHUNK}:workspace_rows", "max_num_seqs_float", lambda: chunking.workspace_rows(10, 1.0, 16),
       args=("max_num_seqs",))
simple(f"{CHUNK}:host_to_device", "valid", lambda: chunking.host_to_device([1, 2], "cpu"), "accept",
       check=that(lambda t: t.dtype == torch.int32 and t.tolist() == [1, 2], lambda t: t))
simple(f"{CHUNK}:host_to_device", "overflow_int32", lambda: chunking.host_to_device([2**40], "cpu"),
       args=("values",))
simple(f"{CHUNK}:host_to_device", "device_garbage", lambda: chunking.host_to_device([1], "tpu9"), args=("device",))
simple(f"{CHUNK}:plan_from_config", "valid", lambda: chunking.plan_from_config(
    [100, 3], [1, 1], max_model_len=8, max_num_seqs=1, block_size=16), "accept",
    check=check_plan([100, 3], [1, 1], 64, 16))
simple(f"{CHUNK}:plan_from_config", "block_size_zero", lambda: chunking.plan_from_config(
    [100], [1], max_model_len=8, max_num_seqs=1, block_size=0), args=("block_size",))


# ---------------------------------------------------------------------------
# Model configs
# ---------------------------------------------------------------------------

def _file(name: str, content) -> str:
    path = os.path.join(case_dir(), name)
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(path, mode) as f:
        f.write(content)
    return path


def load(name, content, expect="reject", args=("config",), check=None, timeout=QUICK, via="load"):
    def build(g):
        path = _file("config.json", content)
        fn = {"load": lambda: models.load_hf_config(path), "get": lambda: models.get_model_config(path),
              "cli": lambda: run_cli(["plan", "--memory", "1GiB", "--model", path])}[via]
        return Call(fn, check)
    entry = {"load": f"{MOD}:load_hf_config", "get": f"{MOD}:get_model_config", "cli": f"{CLI}:main"}[via]
    add(entry, name, build, expect, args, timeout=timeout)


def _json(**over):
    raw = dict(V3_JSON, **over)
    return json.dumps({k: v for k, v in raw.items() if v is not ...})


load("valid", _json(), "accept", check=that(lambda m: (m.L, m.R, m.num_layers) == (512, 64, 4), lambda m: m))
load("binary_file", bytes(range(256)) * 8)
load("invalid_utf8", b'{"kv_lora_rank": "\xff\xfe"}')
load("deeply_nested", "[" * 200000 + "]" * 200000)
load("top_level_list", "[1, 2, 3]")
load("empty_file", "")
load("huge_int", '{"kv_lora_rank": ' + "9" * 5000 + "}")
load("missing_keys", json.dumps({"kv_lora_rank": 512}), args=("qk_rope_head_dim",))
load("string_dims", _json(kv_lora_rank="512"), args=("kv_lora_rank",))
load("float_dims", _json(qk_rope_head_dim=64.0), args=("qk_rope_head_dim",))
load("bool_dims", _json(num_attention_heads=True), args=("num_attention_heads",))
load("zero_heads", _json(num_attention_heads=0), args=("num_attention_heads", "num_heads"))
load("negative_rope", _json(qk_rope_head_dim=-64), args=("qk_rope_head_dim", "R"))
load("num_layers_1e9", _json(num_hidden_layers=10**9), args=("num_hidden_layers", "num_layers"))
load("num_layers_1e9_get", _json(num_hidden_layers=10**9), args=("num_hidden_layers", "num_layers"), via="get")
load("num_layers_1e9_cli", _json(num_hidden_layers=10**9), args=("num_hidden_layers", "num_layers"), via="cli")
load("torch_dtype_int8", _json(torch_dtype="int8"), args=("torch_dtype",))
load("torch_dtype_list", _json(torch_dtype=["bfloat16"]), args=("torch_dtype",))
load("yarn_factor_str", _json(rope_scaling={"type": "yarn", "factor": "40", "mscale_all_dim": 1.0}),
     args=("factor", "rope_scaling"))
load("yarn_mscale_nan", '{"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, '
     '"num_attention_heads": 16, "num_hidden_layers": 4, "max_position_embeddings": 4096, '
     '"rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": NaN}}',
     args=("mscale_all_dim", "rope_scaling", "softmax_scale"))
load("yarn_factor_huge", _json(rope_scaling={"type": "yarn", "factor": 1e308, "mscale_all_dim": 1e308}),
     args=("factor", "mscale_all_dim", "rope_scaling", "softmax_scale"))
load("rope_scaling_list", _json(rope_scaling=[1, 2]), args=("rope_scaling",))
load("layer_types_wrong_length", _json(layer_types=["full_attention"]), args=("layer_types",))
load("sliding_window_pattern_zero", _json(sliding_window=4096, sliding_window_pattern=0),
     args=("sliding_window_pattern",))
load("max_window_layers_huge", _json(sliding_window=4096, max_window_layers=10**18), "accept",
     check=that(lambda m: not m.sliding_window_layers, lambda m: m))
load("text_config", json.dumps({"model_type": "kimi_vl", "text_config": V3_JSON}), "accept")


def _path_case(name, path_fn, expect="reject", args=("config", "model")):
    def build(g):
        path = path_fn()
        return Call(lambda: models.load_hf_config(path))
    add(f"{MOD}:load_hf_config", name, build, expect, args, timeout=QUICK)


_path_case("directory", lambda: case_dir())
_path_case("missing_file", lambda: os.path.join(case_dir(), "nope.json"))
_path_case("path_none", lambda: None, args=("path",))
_path_case("path_int", lambda: 3, args=("path",))


def cfg_dict(name, raw, expect="reject", args=(), check=None, timeout=QUICK):
    simple(f"{MOD}:config_from_dict", name, lambda: models.config_from_dict(raw, name="cfg"), expect, args,
           check=check, timeout=timeout)


cfg_dict("valid_v3_scale", dict(V3_JSON, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0}), "accept",
         check=that(lambda m: abs(m.softmax_scale - 0.13523) < 5e-6,
                    lambda m: f"softmax scale {m.softmax_scale}, SPEC §10 says 0.13523"))
cfg_dict("num_layers_1e9", dict(V3_JSON, num_hidden_layers=10**9), args=("num_hidden_layers",))
cfg_dict("raw_is_a_list", [1, 2], args=("raw", "config"))
cfg_dict("raw_none", None, args=("raw", "config"))
cfg_dict("text_config_not_dict", dict(text_config=[1]), args=("kv_lora_rank", "text_config"))
cfg_dict("per_layer_config_list", dict(V3_JSON, per_layer_config=[1]), args=("per_layer_config",))
cfg_dict("per_layer_config_str_dim", dict(V3_JSON, per_layer_config={"1": {"kv_lora_rank": "1024"}}),
         args=("per_layer_config", "kv_lora_rank"))
cfg_dict("per_layer_config_entry_int", dict(V3_JSON, per_layer_config={"1": 5}), args=("per_layer_config",))
cfg_dict("no_rope_layers_str", dict(V3_JSON, no_rope_layers="1110"), args=("no_rope_layers",))
cfg_dict("no_rope_layers_short", dict(V3_JSON, no_rope_layers=[1]), args=("no_rope_layers",))
cfg_dict("kv_source_layers_short", dict(V3_JSON, kv_source_layers=[0]), args=("kv_source_layers",))
cfg_dict("kv_source_layers_chain", dict(V3_JSON, kv_source_layers=[0, 0, 1, 3]), args=("kv_source_layers",))
cfg_dict("rope_per_layer_type", dict(V3_JSON, layer_types=["sliding_attention", "full_attention"] * 2,
                                     rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 40,
                                                                         "mscale_all_dim": 1.0},
                                                      "sliding_attention": {"rope_type": "default"}}),
         "accept", check=that(lambda m: abs(m.softmax_scale - 0.13523) < 5e-6 and
                              abs(m.for_layer(0).softmax_scale - 192 ** -0.5) < 1e-9, lambda m: m.describe()))
cfg_dict("num_layers_spelling", {k: v for k, v in dict(V3_JSON, num_layers=4).items()
                                 if k != "num_hidden_layers"}, "accept",
         check=that(lambda m: m.num_layers == 4, lambda m: m.num_layers))

GET = f"{MOD}:get_model_config"
simple(GET, "builtin_v2_lite_scale", lambda: models.get_model_config("DeepSeek_V2_Lite"), "accept",
       check=that(lambda m: abs(m.softmax_scale - 0.11472) < 5e-6, lambda m: m.softmax_scale))
simple(GET, "none", lambda: models.get_model_config(None), args=("model",))
simple(GET, "int", lambda: models.get_model_config(3), args=("model",))
simple(GET, "unknown_name", lambda: models.get_model_config("gpt-5"), args=("model",))
simple(GET, "bytes", lambda: models.get_model_config(b"deepseek-v3"), args=("model",))
simple(GET, "nul_in_name", lambda: models.get_model_config("deep\x00seek"), args=("model",))
simple(GET, "very_long_name", lambda: models.get_model_config("x" * 100000), args=("model",), timeout=QUICK)
simple(f"{MOD}:known_model_names", "list", models.known_model_names, "accept",
       check=that(lambda n: "deepseek-v3" in n, lambda n: n))
SW = f"{MOD}:sliding_window_layers_from_dict"
simple(SW, "pattern", lambda: models.sliding_window_layers_from_dict({"sliding_window": 8,
                                                                     "sliding_window_pattern": 2}, 4, "m"),
       "accept", check=equals(frozenset({0, 2})))
simple(SW, "num_layers_1e9", lambda: models.sliding_window_layers_from_dict({"sliding_window": 8}, 10**9, "m"),
       args=("num_hidden_layers", "num_layers"), timeout=QUICK)
simple(SW, "layer_types_str", lambda: models.sliding_window_layers_from_dict({"layer_types": "sliding"}, 7, "m"),
       args=("layer_types",))

MC = f"{MOD}:MLAModelConfig"


def mcfg(**kw):
    base = dict(name="m", L=512, R=64, P=128, V=128, num_heads=16, num_layers=4)
    base.update(kw)
    return models.MLAModelConfig(**base)


simple(MC, "valid", lambda: mcfg(), "accept")
for _arg, _label, _v in (("L", "zero", 0), ("R", "negative", -1), ("P", "float", 1.5), ("num_heads", "bool", True),
                         ("num_layers", "1e9", 10**9), ("max_model_len", "str", "4096"), ("tp_size", "zero", 0)):
    simple(MC, f"{_arg}_{_label}", lambda a=_arg, v=_v: mcfg(**{a: v}), args=(_arg,), timeout=QUICK)
simple(MC, "model_dtype_int8", lambda: mcfg(model_dtype=torch.int8), args=("model_dtype",))
simple(MC, "softmax_scale_nan", lambda: mcfg(softmax_scale=float("nan")), args=("softmax_scale",))
simple(MC, "sliding_window_out_of_range", lambda: mcfg(sliding_window_layers={99}), args=("sliding_window_layers",))
simple(MC, "tp_rank_past_size", lambda: mcfg(tp_size=2, tp_rank=2), args=("tp_rank",))
simple(MC, "shard_not_dividing", lambda: mcfg().shard(3, 0), args=("tp_size",))
simple(MC, "shard_twice", lambda: mcfg().shard(2, 0).shard(2, 0), args=("shard", "tp_size"))
simple(MC, "layer_dims_not_a_dict", lambda: mcfg(layer_dims=5), args=("layer_dims",))
simple(MC, "layer_dims_not_layerdims", lambda: mcfg(layer_dims={1: (512, 64, 128, 128, 16)}),
       args=("layer_dims",))
simple(MC, "layer_dims_zero_heads", lambda: mcfg(layer_dims={1: models.LayerDims(512, 64, 128, 128, 0)}),
       args=("layer_dims", "num_heads"))
simple(MC, "layer_dims_out_of_range", lambda: mcfg(layer_dims={9: models.LayerDims(512, 64, 128, 128, 8)}),
       args=("layer_dims",))
simple(MC, "non_mla_all_layers", lambda: mcfg(non_mla_layers={0, 1, 2, 3}), args=("non_mla_layers",))
simple(MC, "non_mla_str", lambda: mcfg(non_mla_layers="0"), args=("non_mla_layers",))
simple(MC, "non_mla_out_of_range", lambda: mcfg(non_mla_layers={7}), args=("non_mla_layers",))
simple(MC, "kv_source_itself", lambda: mcfg(kv_source_layers={2: 2}), args=("kv_source_layers",))
simple(MC, "kv_source_chain", lambda: mcfg(kv_source_layers={2: 1, 1: 0}), args=("kv_source_layers",))
simple(MC, "layer_dims_shard", lambda: mcfg(layer_dims={1: models.LayerDims(512, 0, 192, 128, 8)}).shard(8, 0),
       "accept", check=that(lambda m: m.for_layer(1).num_heads == 1 and m.for_layer(1).R == 0,
                            lambda m: m.for_layer(1)))
simple(MC, "shard_valid", lambda: mcfg().shard(8, 7), "accept",
       check=that(lambda m: (m.num_heads, m.total_heads) == (2, 16), lambda m: m))


# ---------------------------------------------------------------------------
# Policy (SPEC §3)
# ---------------------------------------------------------------------------

CC = f"{POL}:CacheConfig"
SKIP = "kv_cache_dtype_skip_layers"
simple(CC, "valid", lambda: policy.CacheConfig("fp8_ds_mla", (0, "1", "sliding_window", np.int64(3)), 64),
       "accept", check=that(lambda c: c.skip_layers == (0, 1, "sliding_window", 3), lambda c: c.skip_layers))
simple(CC, "unknown_dtype", lambda: policy.CacheConfig("fp9"), args=("kv_cache_dtype",))
simple(CC, "dtype_none", lambda: policy.CacheConfig(None), args=("kv_cache_dtype",))
simple(CC, "skip_layers_str", lambda: policy.CacheConfig("fp8", "0,1"), args=(SKIP,))
simple(CC, "skip_layers_int", lambda: policy.CacheConfig("fp8", 3), args=(SKIP,))
for _label, _e in (("bool", True), ("float_str", "1.5"), ("space", " 12"), ("arabic_digits", "١٢"),
                   ("negative", -1), ("float", 2.0), ("none", None), ("huge_digits", "9" * 5000),
                   ("sliding_typo", "sliding-window")):
    simple(CC, f"skip_entry_{_label}", lambda e=_e: policy.CacheConfig("fp8", (e,)), args=(SKIP,), timeout=QUICK)
for _label, _b in (("zero", 0), ("bool", True), ("str", "16"), ("float", 16.0)):
    simple(CC, f"block_size_{_label}", lambda b=_b: policy.CacheConfig("fp8", (), b), args=("block_size",))
for _label, _v in (("str_no", "no"), ("int", 1), ("none", None)):
    simple(CC, f"calculate_kv_scales_{_label}", lambda v=_v: policy.CacheConfig("fp8", (), 16, v),
           args=("calculate_kv_scales",))
simple(f"{POL}:check_bool", "no", lambda: policy.check_bool("no", "flag"), args=("flag",))
simple(f"{POL}:check_bool", "numpy_true", lambda: policy.check_bool(np.bool_(True), "flag"), "accept",
       check=equals(True))
simple(f"{POL}:parse_skip_entry", "word", lambda: policy.parse_skip_entry("sliding_window"), "accept",
       check=equals("sliding_window"))
simple(f"{POL}:parse_skip_entry", "list", lambda: policy.parse_skip_entry([1]), args=(SKIP,))
LIP = f"{POL}:layer_index_from_prefix"
simple(LIP, "valid", lambda: policy.layer_index_from_prefix("model.layers.12.self_attn.attn"), "accept",
       check=equals(12))
simple(LIP, "expert_index_too", lambda: policy.layer_index_from_prefix("model.layers.1.mlp.experts.7"),
       args=("prefix",))
simple(LIP, "no_index", lambda: policy.layer_index_from_prefix("model.attn"), args=("prefix",))
simple(LIP, "none", lambda: policy.layer_index_from_prefix(None), args=("prefix",))
simple(LIP, "huge_index", lambda: policy.layer_index_from_prefix("layers." + "9" * 5000), "either", ("prefix",),
       timeout=QUICK)

RL = f"{POL}:resolve_layer"
V3 = models.get_model_config("deepseek-v3")


def page(fmt, want):
    simple(RL, f"page_bytes_{fmt}", lambda: policy.resolve_layer(policy.CacheConfig(fmt, block_size=64), V3, 5),
           "accept", check=that(lambda s: s.page_bytes() == want,
                                lambda s: f"{fmt}: page {s.page_bytes()}, SPEC §4 says {want}"))


page("auto", 73728)
page("fp8", 36864)
page("fp8_ds_mla", 41984)
simple(RL, "skipped_layer_is_native", lambda: policy.resolve_layer(
    policy.CacheConfig("fp8_ds_mla", (60,), 64, True), V3, prefix="model.layers.60.self_attn"), "accept",
    check=that(lambda s: (s.kv_cache_dtype, s.calculate_kv_scales, s.page_bytes()) == ("auto", False, 73728),
               lambda s: s))
simple(RL, "layer_out_of_range", lambda: policy.resolve_layer(policy.CacheConfig(), V3, 61), args=("layer",))
simple(RL, "layer_negative", lambda: policy.resolve_layer(policy.CacheConfig(), V3, -1), args=("layer",))
simple(RL, "layer_bool", lambda: policy.resolve_layer(policy.CacheConfig(), V3, True), args=("layer",))
simple(RL, "layer_and_prefix_disagree", lambda: policy.resolve_layer(policy.CacheConfig(), V3, 3,
                                                                     "model.layers.4.attn"), args=("layer", "prefix"))
simple(RL, "neither", lambda: policy.resolve_layer(policy.CacheConfig(), V3), args=("layer", "prefix"))
simple(RL, "skip_index_out_of_range", lambda: policy.resolve_layer(policy.CacheConfig("fp8", (61,)), V3, 0),
       args=(SKIP,))
simple(RL, "ds_mla_on_other_dims", lambda: policy.resolve_layer(policy.CacheConfig("fp8_ds_mla"), mcfg(L=256), 0),
       args=("kv_cache_dtype", "L="))
simple(RL, "cache_config_dict", lambda: policy.resolve_layer({"kv_cache_dtype": "fp8"}, V3, 0),
       args=("cache_config",))
simple(RL, "model_config_str", lambda: policy.resolve_layer(policy.CacheConfig(), "deepseek-v3", 0),
       args=("model_config",))
simple(f"{POL}:resolve_model", "valid", lambda: policy.resolve_model(policy.CacheConfig("fp8", (0,)), V3), "accept",
       check=that(lambda specs: len(specs) == 61 and specs[0].kv_cache_dtype == "auto", lambda specs: specs))
simple(f"{POL}:resolve_model", "model_none", lambda: policy.resolve_model(policy.CacheConfig(), None),
       args=("model_config",))
simple(f"{POL}:check_configs", "swapped", lambda: policy.check_configs(V3, policy.CacheConfig()),
       args=("cache_config",))


def _spec(**over):
    s = policy.resolve_layer(policy.CacheConfig("fp8"), V3, 0)
    fields = {f: getattr(s, f) for f in s.__dataclass_fields__}
    fields.update(over)
    return policy.LayerCacheSpec(**fields)


LCS = f"{POL}:LayerCacheSpec"
simple(LCS, "quant_mode_disagrees", lambda: _spec(quant_mode=formats.QuantMode.NONE), args=("quant_mode",))
simple(LCS, "skipped_but_quantized", lambda: _spec(skipped=True, skip_reason="x"), args=("skipped", "skip"))
simple(LCS, "page_alignment_zero", lambda: _spec().page_bytes(0), args=("alignment",))
simple(LCS, "page_alignment_valid", lambda: _spec().page_bytes(4096), "accept", check=equals(12288))


# ---------------------------------------------------------------------------
# Planner (SPEC §4)
# ---------------------------------------------------------------------------

PM = f"{PLAN}:plan_model"
DS = policy.CacheConfig("fp8_ds_mla", (0, 1, 60), 64)


def _pool_bytes(pages, num_blocks):
    """Bytes of one shared buffer holding every layer, each region on planner.REGION_ALIGN."""
    end = 0
    for page in pages:
        end = -(-end // planner.REGION_ALIGN) * planner.REGION_ALIGN + num_blocks * page
    return end


def check_pool(budget):
    def check(p):
        assert p.bytes_used <= budget, f"over-commits: {p.bytes_used} > {budget}"
        assert p.num_blocks >= 1
        for lp in p.layers:
            assert lp.page_bytes >= lp.shape[1] * lp.bytes_per_token
            assert lp.bytes == p.num_blocks * lp.page_bytes
        ends = sorted((lp.offset, lp.offset + lp.bytes) for lp in p.layers)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "layer regions overlap"
        if not p.block_id_limited:
            assert _pool_bytes([lp.page_bytes for lp in p.layers], p.num_blocks + 1) > budget, \
                "one more block would still fit (not the most blocks)"
    return check


simple(PM, "v3_mixed_60gib", lambda: planner.plan_model(DS, V3, 60 * GIB), "accept", check=check_pool(60 * GIB))
simple(PM, "v3_aligned", lambda: planner.plan_model(DS, V3, 10**9 + 7, 4096), "accept", check=check_pool(10**9 + 7))
simple(PM, "huge_budget_capped", lambda: planner.plan_model(policy.CacheConfig(), mcfg(num_layers=1, L=1, R=0),
                                                            2**62), "accept", timeout=QUICK,
       check=that(lambda p: p.num_blocks == planner.MAX_NUM_BLOCKS and p.block_id_limited, lambda p: p.num_blocks))
for _label, _m in (("zero", 0), ("negative", -1), ("bool", True), ("str", "60GiB"), ("float", 1.5e9),
                   ("huge", 2**70), ("numpy_int", np.int64(10**9)), ("none", None)):
    simple(PM, f"memory_{_label}", lambda m=_m: planner.plan_model(DS, V3, m),
           "either" if _label == "numpy_int" else "reject", ("memory_bytes",), timeout=QUICK,
           check=check_pool(10**9) if _label == "numpy_int" else None)
simple(PM, "memory_below_one_block", lambda: planner.plan_model(DS, V3, 1000), args=("memory_bytes",))
for _label, _a in (("zero", 0), ("negative", -64), ("bool", True), ("odd_for_bf16", 5), ("str", "4096")):
    simple(PM, f"alignment_{_label}", lambda a=_a: planner.plan_model(policy.CacheConfig(), V3, GIB, a),
           args=("alignment",))
simple(PM, "model_1e9_layers", lambda: planner.plan_model(DS, models.config_from_dict(
    dict(V3_JSON, num_hidden_layers=10**9), "huge"), GIB), args=("num_hidden_layers", "num_layers"),
    timeout=QUICK)
simple(PM, "configs_swapped", lambda: planner.plan_model(V3, DS, GIB), args=("cache_config",))

PP = f"{PLAN}:plan_pool"
@functools.cache
def _specs():
    return policy.resolve_model(DS, V3)


simple(PP, "valid", lambda: planner.plan_pool(_specs(), 60 * GIB), "accept", check=check_pool(60 * GIB))
simple(PP, "empty", lambda: planner.plan_pool([], GIB), args=("layer_specs",))
simple(PP, "str", lambda: planner.plan_pool("abc", GIB), args=("layer_specs",))
simple(PP, "not_specs", lambda: planner.plan_pool([1, 2], GIB), args=("layer_specs",))
simple(PP, "duplicates", lambda: planner.plan_pool([_specs()[0], _specs()[0]], GIB), args=("layer_specs",))
simple(PP, "mixed_block_sizes", lambda: planner.plan_pool(
    [_specs()[2], policy.resolve_layer(policy.CacheConfig("fp8", block_size=16), V3, 3)], GIB), args=("layer_specs",))
simple(PP, "generator", lambda: planner.plan_pool((s for s in _specs()[:3]), GIB), "accept", check=check_pool(GIB))


def _alloc(shared):
    def build(g):
        p = planner.plan_model(policy.CacheConfig("fp8_ds_mla", (0,), 64), mcfg(num_layers=3), 10 << 20)

        def check(caches):
            assert len(caches) == 3 and all(tuple(c.shape) == lp.shape for c, lp in zip(caches, p.layers))
        return Call(lambda: p.allocate("cpu", shared=shared), check)
    return build


add(f"{PLAN}:PoolPlan", "allocate_shared", _alloc(True), "accept")
add(f"{PLAN}:PoolPlan", "allocate_shared_str", _alloc("yes"), "reject", ("shared",))
simple(f"{PLAN}:PoolPlan", "format_table_and_json", lambda: (planner.plan_model(DS, V3, GIB).format_table("t"),
                                                             planner.plan_model(DS, V3, GIB).to_dict()), "accept")
simple(f"{PLAN}:render_plan", "json", lambda: json.loads(planner.render_plan(V3, DS, GIB, as_json=True)), "accept",
       check=that(lambda d: d["bytes_used"] <= GIB, lambda d: d))
simple(f"{PLAN}:render_plan", "as_json_str", lambda: planner.render_plan(V3, DS, GIB, as_json="no"),
       args=("as_json",))
simple(f"{PLAN}:format_bytes", "gib", lambda: planner.format_bytes(3 * GIB // 2), "accept", check=equals("1.50 GiB"))
simple(f"{PLAN}:format_bytes", "str", lambda: planner.format_bytes("1GiB"), args=("n",))


# ---------------------------------------------------------------------------
# Formats (SPEC §2) and the raw format ops
# ---------------------------------------------------------------------------

GF = f"{FMT}:get_format"
for _f in formats.FORMATS:
    for _n in _f.names:
        simple(GF, f"name_{_n}", lambda n=_n: formats.get_format(n), "accept", check=equals(_f))
for _label, _v in (("upper", "FP8"), ("space", " fp8"), ("none", None), ("int", 3), ("bytes", b"fp8"),
                   ("empty", ""), ("nul", "fp8\x00")):
    simple(GF, f"bad_{_label}", lambda v=_v: formats.get_format(v), args=("kv_cache_dtype",))
simple(GF, "bad_custom_arg_name", lambda: formats.get_format("x", arg="layer_dtype"), args=("layer_dtype",))
CF = f"{FMT}:CacheFormat"
_fp8 = formats.get_format("fp8")
simple(CF, "storage_dtype_int8", lambda: _fp8.storage_dtype(torch.int8), args=("model_dtype",))
simple(CF, "entry_zero_L", lambda: _fp8.entry_elems(0, 64), args=("L",))
simple(CF, "ds_mla_other_dims", lambda: formats.get_format("fp8_ds_mla").bytes_per_token(256, 64), args=("L=",))
simple(CF, "bytes_per_token_v3", lambda: [formats.get_format(n).bytes_per_token(512, 64) for n in
                                          ("auto", "fp8", "fp8_ds_mla")], "accept", check=equals([1152, 576, 656]))
simple(CF, "dims_float", lambda: _fp8.entry_elems(512.0, 64), args=("L",))
simple(CF, "cache_shape_negative_blocks", lambda: _fp8.cache_shape(-1, 16, 512, 64), args=("num_blocks",))

FI = "torch.ops.mla_ext.format_info"


def finfo(name, fn, expect="reject", args=(), check=None):
    simple(FI, name, lambda: fn(torch.ops.mla_ext), expect, args, check=check, timeout=QUICK)


for _f in formats.FORMATS:
    for _dt in (BF16, torch.float32):
        def _want(f=_f, dt=_dt):
            ok = f.supports_dims(512, 64)
            return [f.id, f.bytes_per_token(512, 64, dt) if ok else -1, int(f.quant_mode), int(f.scale_kind),
                    f.storage_dtype(dt).itemsize, f.entry_elems(512, 64) if ok else -1]
        finfo(f"{_f.name}_{str(_dt)[6:]}", lambda o, f=_f, dt=_dt: o.format_info(f.name, 512, 64, dt.itemsize),
              "accept", check=that(lambda got, w=_want: list(got) == w(),
                                   lambda got, w=_want: f"format_info {list(got)} != formats.py {w()}"))
finfo("unknown_name", lambda o: o.format_info("fp9", 512, 64, 2), args=("kv_cache_dtype",))
finfo("elem_bytes_3", lambda o: o.format_info("auto", 512, 64, 3), args=("model_elem_bytes",))
finfo("L_2e32_plus_512_ds_mla", lambda o: o.format_info("fp8_ds_mla", 2**32 + 512, 64, 2), "either", ("L",),
      check=that(lambda got: got[1] == -1, lambda got: f"L = 2**32 + 512 taken for 512: {list(got)}"))
finfo("L_2e62", lambda o: o.format_info("auto", 2**62, 64, 2), args=("L",))
finfo("R_negative", lambda o: o.format_info("auto", 512, -64, 2), "either", ("R",),
      check=that(lambda got: got[1] == -1, lambda got: list(got)))
finfo("L_str", lambda o: o.format_info("auto", "512", 64, 2), args=("L",))
simple("torch.ops.mla_ext.ds_mla_layout", "matches_formats", lambda: torch.ops.mla_ext.ds_mla_layout(), "accept",
       check=equals([formats.DsMla.LATENT_DIM, formats.DsMla.ROPE_DIM, formats.DsMla.TILE_SIZE,
                     formats.DsMla.NUM_TILES, formats.DsMla.LATENT_OFFSET, formats.DsMla.SCALE_OFFSET,
                     formats.DsMla.ROPE_OFFSET, formats.DsMla.ENTRY_BYTES]))
simple("torch.ops.mla_ext.ds_mla_layout", "extra_argument", lambda: torch.ops.mla_ext.ds_mla_layout(1),
       args=("ds_mla_layout",))
simple("torch.ops.mla_ext.build_info", "fields", lambda: torch.ops.mla_ext.build_info(), "accept",
       check=that(lambda s: s.startswith("cuda=") and "|archs=" in s, lambda s: s))
simple("torch.ops.mla_ext.build_info", "extra_argument", lambda: torch.ops.mla_ext.build_info("x"),
       args=("build_info",))


# ---------------------------------------------------------------------------
# The CLI: bad arguments exit 2 with one line naming the argument, never a traceback
# ---------------------------------------------------------------------------

class CliRefused(ValueError):
    """main() exited 2 with a one-line error (the text is what it printed)."""


class CliTraceback(Exception):
    """main() let an exception escape, printed a traceback, or exited otherwise."""


def run_cli(argv: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    except BaseException as exc:  # noqa: BLE001 - a traceback for the user
        raise CliTraceback(f"{type(exc).__name__} escaped main(): {exc}") from None
    text = err.getvalue()
    if "Traceback" in text:
        raise CliTraceback("printed a traceback: " + " | ".join(text.strip().splitlines()[-3:]))
    if rc == 2:
        raise CliRefused(" ".join(text.split()))
    if rc not in (0, None):
        raise CliTraceback(f"exit code {rc}: {text.strip()}")
    return out.getvalue()


MAIN = f"{CLI}:main"


def cli_case(name, argv, expect="reject", args=(), check=None, timeout=QUICK * 2):
    simple(MAIN, name, lambda: run_cli(argv), expect, args, check=check, timeout=timeout)


cli_case("plan_valid", ["plan", "--memory", "60GiB", "--kv-cache-dtype", "fp8_ds_mla", "--skip-layers", "0", "1",
                        "60", "--block-size", "64"], "accept",
         check=that(lambda out: "41,984" in out, lambda out: out[:300]))
cli_case("plan_json", ["plan", "--memory", "1GiB", "--json"], "accept", check=lambda out: json.loads(out) and None)
cli_case("info", ["info"], "accept")
cli_case("no_command", [], args=("command",))
cli_case("unknown_command", ["frobnicate"], args=("frobnicate",))
cli_case("plan_without_memory", ["plan"], args=("--memory",))
for _label, _m in (("word", "lots"), ("negative", "-1GiB"), ("exponent", "1e3GiB"), ("digits", "9" * 60),
                   ("zero", "0"), ("unit_typo", "60GB/s"), ("too_big", "9000000000TiB"), ("fraction", "0.1")):
    cli_case(f"memory_{_label}", ["plan", "--memory", _m], args=("--memory",))
cli_case("model_missing_file", ["plan", "--memory", "1GiB", "--model", "/nonexistent/config.json"],
         args=("model", "config"))
cli_case("kv_cache_dtype_unknown", ["plan", "--memory", "1GiB", "--kv-cache-dtype", "fp9"],
         args=("kv_cache_dtype", "kv-cache-dtype"))
cli_case("skip_layer_float", ["plan", "--memory", "1GiB", "--skip-layers", "1.5"], args=(SKIP, "skip-layers"))
cli_case("skip_layer_out_of_range", ["plan", "--memory", "1GiB", "--skip-layers", "99"],
         args=(SKIP, "skip-layers"))
cli_case("block_size_zero", ["plan", "--memory", "1GiB", "--block-size", "0"], args=("block_size", "block-size"))
cli_case("block_size_word", ["plan", "--memory", "1GiB", "--block-size", "abc"], args=("block-size",))
cli_case("alignment_zero", ["plan", "--memory", "1GiB", "--alignment", "0"], args=("alignment",))
cli_case("info_unknown_flag", ["info", "--bogus"], args=("--bogus",))
cli_case("demo_bad_device", ["demo", "--device", "tpu"], args=("--device",))
cli_case("demo_unknown_flag", ["demo", "--bogus"], args=("--bogus",))
cli_case("demo_check_queries_word", ["demo", "--check-queries", "abc"], args=("--check-queries",))
cli_case("demo_check_queries_zero", ["demo", "--check-queries", "0"], args=("--check-queries",))
cli_case("demo_progress_typo", ["demo", "--progress", "maybe"], args=("--progress",))
# out-of-range numbers are usage errors naming the flag (before any output)
cli_case("demo_seed_1e23", ["demo", "--seed", str(10**23)], args=("--seed",))
cli_case("demo_seed_negative", ["demo", "--seed", "-1"], args=("--seed",))
cli_case("block_size_1e23", ["plan", "--memory", "1GiB", "--block-size", str(10**23)], args=("--block-size",))
cli_case("alignment_1e30", ["plan", "--memory", "1GiB", "--alignment", str(10**30)], args=("--alignment",))


class _FailingStdout(io.StringIO):
    """stdout of a full disk (ENOSPC) or a closed pipe (EPIPE)."""

    def __init__(self, err: int):
        super().__init__()
        self.err = err

    def write(self, text):
        raise OSError(self.err, os.strerror(self.err))


def cli_output_fails(argv: list[str], err: int) -> str:
    """main() with a stdout that fails: exit 1 and one line on stderr, no traceback."""
    out, text = _FailingStdout(err), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(text):
        rc = cli.main(argv)
    lines = text.getvalue().strip().splitlines()
    if rc != 1 or len(lines) != 1 or "cannot write the output" not in lines[0]:
        raise CliTraceback(f"exit code {rc}, stderr {lines}")
    return lines[0]


for _label, _err in (("full_disk", errno.ENOSPC), ("broken_pipe", errno.EPIPE)):
    simple(MAIN, f"plan_{_label}", lambda e=_err: cli_output_fails(["plan", "--memory", "1GiB"], e), "accept")

simple(f"{CLI}:parse_memory", "valid", lambda: cli.parse_memory("1.5GiB"), "accept", check=equals(3 * GIB // 2))
simple(f"{CLI}:parse_memory", "none", lambda: cli.parse_memory(None), args=("--memory", "text"))
simple(f"{CLI}:parse_memory", "negative", lambda: cli.parse_memory("-5"), args=("--memory",))
add(f"{CLI}:backend_reports", "rows", report_rows_case(cli.backend_reports), "accept")
simple(f"{CLI}:info_dict", "keys", cli.info_dict, "accept",
       check=that(lambda d: {"torch", "backends", "archs"} <= set(d), lambda d: d))
simple(f"{CLI}:format_info", "text", lambda: cli.format_info(cli.info_dict()), "accept")
simple(f"{CLI}:build_parser", "help_text", lambda: cli.build_parser().format_help(), "accept")


# ---------------------------------------------------------------------------
# kv_b_proj warm-up rows (KvBProj.prepare compiles every M bucket)
# ---------------------------------------------------------------------------

from mla_ext.kv_b_proj.linear import warm_rows  # noqa: E402

WARM = "mla_ext.kv_b_proj.linear:warm_rows"
simple(WARM, "valid", lambda: warm_rows(33), "accept", check=equals([1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33]))
simple(WARM, "zero", lambda: warm_rows(0), args=("max_rows",))
simple(WARM, "bool", lambda: warm_rows(True), args=("max_rows",))
simple(WARM, "float", lambda: warm_rows(4.0), args=("max_rows",))
