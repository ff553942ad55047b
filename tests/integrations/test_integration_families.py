"""Every MLA family transformers ships, through `TransformersMLA`, against the
family's own attention module: tiny random-weight layers built from
transformers' own config and attention classes (mla_ext/integrations/
transformers_random.py), prefill with context (three requests: one without
context, contexts longer than the 32-row workspace, so chunked) against the
module's own forward over whole sequences (its masks, sinks, sparse index mask,
gates excluded: the compared quantity is the attention's output).

Bounds (relative Frobenius), as tests/integrations/test_integration_transformers.py:
- fp32: within 1e-5 of transformers and of the float64 module;
- bf16 (SPEC §9): within 2e-2 of transformers' bf16 forward and as close to the
  float64 module as transformers' own bf16 path (1.5x its error + 1e-3).
Each family runs fp32 and bf16 with the native cache, and bf16 with one quantized
cache format and kv_b_proj format (rotated over the families, so every cache
format and several weight formats meet several families; the module then attends
to what the cache holds and computes with the dequantized weight).

Families with layer kinds of their own run those layers too: dots3_note's
sliding layer (other L, P, R and heads), mistral_large4's no-rope layer and its
KV-sharing layers, hy_v4's sinks. Sparse (DSA) layers run within index_topk and
are refused past it; a sliding layer past its window.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test dependency")

from mla_ext.attention.api import ATTENTION  # noqa: E402
from mla_ext.config.families import FAMILIES  # noqa: E402
from mla_ext.integrations import transformers_deepseek as tx  # noqa: E402
from mla_ext.integrations.transformers_random import random_family_attention, tiny_config  # noqa: E402
from mla_ext.kv_b_proj.weights import quantize  # noqa: E402
from mla_ext.config.policy import CacheConfig  # noqa: E402

BLOCK = 16
HIDDEN = 64
CTX, NEW = (40, 0, 19), (3, 4, 2)
SPARSE = sorted(f for f, fam in FAMILIES.items() if fam.sparse)
RUNS_SPARSE = ("deepseek_v32", "glm_moe_dsa")  # families whose indexer mla_ext computes

# family -> the layers it runs (layer 1 unless the family has layer kinds of its own).
LAYERS = {f: (1,) for f in FAMILIES}
LAYERS["dots3_note"] = (1, 2)  # indexed; sliding with its own dims
LAYERS["mistral_large4"] = (1, 2, 3)  # no rope; reads layer 0's KV; no rope reading layer 1's

# Quantized cache formats and kv_b_proj recipes the families are checked with.
QUANT_FORMATS = ["fp8", "fp8_ds_mla", "fp8_e5m2", "nvfp4_ds_mla"]
RECIPES = ["fp8_block", "dense", "fp8_per_channel", "nvfp4", "int4_group"]


def build(family, layer_idx, dtype, kv_cache_dtype="auto", recipe="dense", seed=0,
          layer_kwargs=None, **dims):
    """(layer, source layer or None) for one layer of a tiny `family` model."""
    cfg = tiny_config(family, **dims)
    per_tensor = kv_cache_dtype in ("fp8", "fp8_e5m2")
    cache = CacheConfig(kv_cache_dtype, block_size=BLOCK, calculate_kv_scales=per_tensor)

    def one(idx, s):
        module = random_family_attention(family, layer_idx=idx, dtype=dtype, config=cfg, seed=s)
        weight = None
        if recipe != "dense":  # both sides compute with the same (dequantized) weight
            weight = quantize(recipe, module.kv_b_proj.weight.detach().float(), dtype)
            with torch.no_grad():
                module.kv_b_proj.weight.copy_(weight.dequantize(dtype))
        return tx.TransformersMLA(module, cache, kv_b_proj=weight, workspace_rows_override=32,
                                  max_num_seqs=len(CTX), **(layer_kwargs or {}))

    layer = one(layer_idx, seed)
    source = one(layer.kv_source, seed + 7) if layer.kv_source is not None else None
    return layer, source


def run(layer, source, dtype, seed=0, ctx=CTX, new=NEW):
    gen = torch.Generator().manual_seed(100 + seed)
    xs = [torch.randn(c + q, HIDDEN, generator=gen).to(dtype) for c, q in zip(ctx, new)]
    with ATTENTION.force("torch"):  # fp32: transformers' fp32 forward is the exact side
        return tx.prefill_beside_transformers(layer, xs, ctx, seed=seed, source=source,
                                              exact=dtype != torch.float32)


def check(result, dtype) -> dict:
    e = result.errors()
    if os.environ.get("MLA_EXT_PRINT_ERRORS"):
        print(f"\n{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}: "
              + " ".join(f"{k} {v:.2e}" for k, v in e.items()))
    assert torch.isfinite(result.out).all() and result.out.dtype == dtype
    if dtype == torch.float32:
        assert max(e.values()) <= 1e-5, e
    else:
        assert e["vs_transformers"] <= 2e-2, e
        assert e["vs_fp64"] <= min(2e-2, 1.5 * e["transformers_vs_fp64"] + 1e-3), e
    return e


CASES = [(f, i) for f in sorted(FAMILIES) for i in LAYERS[f]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family,layer_idx", CASES, ids=[f"{f}-L{i}" for f, i in CASES])
def test_family_matches_its_transformers_module(family, layer_idx, dtype):
    layer, source = build(family, layer_idx, dtype)
    module = layer.module
    assert layer.family.model_type == family
    assert layer.prefill.softmax_scale == pytest.approx(module.scaling, rel=1e-12)
    m = layer.model
    assert (m.L, m.R, m.P, m.V, m.num_heads) == (
        module.kv_lora_rank, module.qk_rope_head_dim, module.qk_nope_head_dim,
        module.v_head_dim, module.num_heads)
    assert (layer.prefill.sinks is not None) == FAMILIES[family].sinks
    run_ = run(layer, source, dtype)
    plan = run_.metadata.plan(layer.prefill.workspace_rows, layer.prefill.chunk_alignment)
    assert plan.num_chunks >= 2  # 59 context rows through a 32-row workspace
    check(run_, dtype)


def _cache_cases():
    """Every quantized cache format for every family (with a rotated kv_b_proj recipe)."""
    out = []
    for i, family in enumerate(sorted(FAMILIES)):
        for j, fmt in enumerate(QUANT_FORMATS):
            if fmt == "nvfp4_ds_mla" and family == "glm5_next":
                continue  # no rope part: refused with the reason (test_nvfp4_ds_mla_refuses_...)
            out.append((family, fmt, RECIPES[(i + j) % len(RECIPES)]))
    return out


def _recipe_cases():
    """Every kv_b_proj format for every family (with a rotated quantized cache)."""
    out = []
    for i, family in enumerate(sorted(FAMILIES)):
        for j, recipe in enumerate(RECIPES):
            fmt = QUANT_FORMATS[(i + j) % len(QUANT_FORMATS)]
            if fmt == "nvfp4_ds_mla" and family == "glm5_next":
                fmt = "fp8_ds_mla"
            out.append((family, fmt, recipe))
    return out


@pytest.mark.parametrize("family,fmt,recipe", sorted(set(_cache_cases() + _recipe_cases())),
                         ids=lambda v: str(v))
def test_family_with_every_cache_and_kv_b_proj_format(family, fmt, recipe):
    """bf16 with each quantized cache format and each kv_b_proj format the family can
    use (two axes: every format meets every family, not the full cross product)."""
    _quantized(family, fmt, recipe)


def _quantized(family, fmt, recipe):
    R = 0 if family == "glm5_next" else 64
    dims = dict(kv_lora_rank=512, qk_rope_head_dim=R, index_head_dim=64)
    if family == "longcat_flash":
        dims["head_dim"] = R
    # mistral_large4: its KV-sharing layer with rope (nvfp4_ds_mla needs R=64).
    layer, source = build(family, 2 if family == "mistral_large4" else 1,
                          torch.bfloat16, fmt, recipe, seed=3, **dims)
    assert layer.prefill.kv_cache_dtype == fmt
    check(run(layer, source, torch.bfloat16, seed=2), torch.bfloat16)


def test_o_proj_is_refused_where_a_gate_comes_first():
    layer, _ = build("bailing_hybrid", 1, torch.float32)
    with pytest.raises(ValueError, match="bailing_hybrid: o_proj alone would skip the module's output gate"):
        layer.o_proj(torch.zeros(3, 2, 32))
    plain, _ = build("youtu", 1, torch.float32)
    assert plain.o_proj(torch.zeros(3, 2, 32)).shape == (3, HIDDEN)


def test_sinks_change_the_result():
    """hy_v4's sinks are folded in (not ignored): zeroing them in mla_ext alone moves
    the result far from the module's."""
    layer, _ = build("hy_v4", 1, torch.float32)
    layer.prefill.sinks = None
    e = run(layer, None, torch.float32).errors()
    assert e["vs_transformers"] > 1e-2, e


@pytest.mark.parametrize("family", SPARSE)
def test_sparse_layers_run_sparse_or_are_refused_past_index_topk(family):
    """DSA families whose indexer mla_ext computes (DeepSeek-V3.2, GLM-5) run sparse past
    index_topk (their parity with transformers is tests/sparse/test_sparse_layer.py): given no indexer
    inputs there, the layer refuses naming index_topk. The other sparse families are refused
    past index_topk before anything runs."""
    layer, source = build(family, 1, torch.float32, index_topk=24)
    if family in RUNS_SPARSE:
        assert layer.max_keys is None and layer.sparse.index_topk == 24
        assert "sparse past index_topk=24" in layer.explain()
        with pytest.raises(ValueError, match=r"index: layer 1 is sparse \(index_topk=24\)"):
            run(layer, source, torch.float32)  # the side-by-side harness passes no index cache
    else:
        assert layer.max_keys == 24
        assert "up to 24 keys per query (index_topk=24" in layer.explain()
        with pytest.raises(ValueError, match=rf"{family} layer 1: request 0 has 40 context \+ 3 new "
                                             rf"tokens = 43 keys.*index_topk=24"):
            run(layer, source, torch.float32)
    # Within index_topk it runs (and matches).
    check(run(layer, source, torch.float32, ctx=(20, 0), new=(4, 3)), torch.float32)


def test_sliding_layer_is_refused_past_its_window():
    layer, _ = build("dots3_note", 2, torch.float32)
    assert layer.max_keys == 64
    with pytest.raises(ValueError, match=r"dots3_note layer 2: .*sliding_window=64"):
        run(layer, None, torch.float32, ctx=(70,), new=(2,))


def test_kv_sharing_layer_writes_nothing():
    layer, source = build("mistral_large4", 2, torch.float32)
    assert layer.kv_source == 0 and source.prefill.layer_index == 0
    x, pos = torch.randn(3, HIDDEN), torch.arange(3)
    with pytest.raises(ValueError, match="reads layer 0's KV cache .* write through layer 0"):
        layer.write_cache(x, pos, torch.zeros(2, BLOCK, 80), torch.arange(3))
    with pytest.raises(ValueError, match="reads another layer's KV .*pass shared_kv"):
        layer.inputs(x, pos)


def test_nvfp4_ds_mla_refuses_a_family_without_rope():
    module = random_family_attention("glm5_next", kv_lora_rank=512)
    with pytest.raises(ValueError, match=r"nvfp4_ds_mla.*R=0 \(its 352-byte row"):
        tx.TransformersMLA(module, CacheConfig("nvfp4_ds_mla", block_size=BLOCK))


@pytest.mark.parametrize("family", ["hy_v4", "glm5_next", "mistral_large4"])
def test_absorbed_context_path(family):
    """The context in latent space (queries absorbed through W_UK): sinks (hy_v4),
    no rope part (glm5_next) and no-rope layers (mistral_large4 layer 1) too."""
    layer, source = build(family, 1, torch.float32, layer_kwargs={"context_attention": "absorbed"})
    assert layer.prefill.context_attention.mode == "absorbed"
    check(run(layer, source, torch.float32), torch.float32)


def test_tensor_parallel_rank_with_sinks():
    """Rank 1 of 2 of a 4-head hy_v4 layer: its heads' sinks and kv_b_proj rows."""
    cfg = tiny_config("hy_v4", num_attention_heads=4, num_key_value_heads=4)
    module = random_family_attention("hy_v4", config=cfg)
    layer = tx.TransformersMLA(module, CacheConfig("auto", block_size=BLOCK), tp_size=2, tp_rank=1,
                               workspace_rows_override=32, max_num_seqs=len(CTX))
    assert layer.heads == slice(2, 4)
    torch.testing.assert_close(layer.prefill.sinks, module.sinks.detach()[2:4])
    check(run(layer, None, torch.float32), torch.float32)
