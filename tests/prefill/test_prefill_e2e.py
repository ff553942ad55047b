"""End to end: a scaled-down DeepSeek-shaped stack of MLA layers with mixed
per-layer cache formats and mixed kv_b_proj formats. The chunked, paged
result of every layer must equal one-shot dense attention over the whole
context (mla_ext/prefill/reference.py) within SPEC §9.

The oracle sees exactly what the cache holds (the context rows read back
through the float32 cache reference, so fp8 rounding is the cache's, not an
error) and the dequantized kv_b_proj weight (so weight quantisation is the
checkpoint's, not an error). What remains is the pipeline itself: paging,
chunking, splits, dequant, up-projection, attention and LSE merging.
"""
from __future__ import annotations

import math

import pytest
import torch

from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.reference import mla_prefill_reference
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, Batch, make_weight

# One layer per row: (cache config, layer index, kv_b_proj format). Covers
# fp8_ds_mla, skipped native layers (by index and under two global formats),
# fp8 per-tensor, and Marlin FP8 / block FP8 / NVFP4 / dense weights.
DS = CacheConfig(kv_cache_dtype="fp8_ds_mla", skip_layers=(0, "3"), block_size=BLOCK)
FP8 = CacheConfig(kv_cache_dtype="fp8", skip_layers=(3,), block_size=BLOCK)
STACK = [
    (DS, 0, "dense"),        # skipped -> native bf16 cache
    (DS, 1, "fp8_block"),    # fp8_ds_mla
    (FP8, 2, "marlin_fp8"),  # fp8 per-tensor
    (DS, 3, "nvfp4"),        # skipped -> native bf16 cache
    (DS, 2, "marlin_fp8"),   # fp8_ds_mla again, Marlin weights
]


@pytest.mark.parametrize("workspace_rows", [32, 256])
def test_stack_matches_one_shot_dense(workspace_rows):
    gen = torch.Generator().manual_seed(1234 + workspace_rows)
    # A long request beside short ones, one without context, one single token.
    batch = Batch(ctx_lens=[70, 0, 5, 1, 33], q_lens=[3, 2, 1, 2, 4], seed=workspace_rows)
    k_scale = torch.tensor([0.02], dtype=torch.float32)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, k_scale)
    seen_formats = set()
    for cfg, index, wkind in STACK:
        w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
        layer = MLAPrefill(TINY, cfg, make_weight(wkind, w), prefix=f"model.layers.{index}.self_attn",
                           workspace_rows_override=workspace_rows, max_num_seqs=8)
        seen_formats.add(layer.kv_cache_dtype)
        cache = batch.fill_cache(layer, k_scale)
        out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
        assert out.shape == (sum(batch.q_lens), TINY.num_heads, TINY.V)
        assert not torch.isnan(out).any()

        kv_c, k_pe = batch.cached_rows(layer, cache, k_scale if layer.spec.is_quantized else None)
        ref = mla_prefill_reference(
            batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
            layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V, layer.softmax_scale,
        )
        err = rel_fro(out, ref)
        assert err <= 1e-2, (layer.explain(), err)
        # The context really matters: dropping it is far outside the tolerance.
        no_ctx = mla_prefill_reference(
            batch.q, batch.kv_c_new, batch.k_pe_new, [t[:0] for t in kv_c], [t[:0] for t in k_pe],
            batch.q_lens, layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
            layer.softmax_scale,
        )
        assert rel_fro(out, no_ctx) > 0.1
    assert seen_formats == {"auto", "fp8_ds_mla", "fp8"}


def test_skipped_layer_routes_native_everywhere():
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L)
    layer = MLAPrefill(TINY, DS, make_weight("marlin_fp8", w), prefix="model.layers.3.self_attn.attn")
    assert layer.spec.skipped and layer.kv_cache_dtype == "auto"
    assert layer.spec.storage_dtype == torch.bfloat16 and layer.workspace_dtype == torch.bfloat16
    assert layer.compute_kv_scale(torch.ones(2, TINY.L), torch.ones(2, TINY.R)) is None
    # Marlin stores int32; the activation must still be the model dtype.
    assert layer.kv_b_proj.weight.dtype == torch.int32
    assert layer.activation_dtype == torch.bfloat16
    text = layer.explain()
    assert "skipped" in text and "auto" in text


def test_quantized_layer_explains_its_plan():
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L)
    layer = MLAPrefill(TINY, DS, make_weight("fp8_block", w), layer=1)
    text = layer.explain()
    assert "fp8_ds_mla" in text and "656 B/token" in text and "page 10496 B" in text


def test_wrong_cache_for_layer_raises():
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L)
    layer = MLAPrefill(TINY, DS, make_weight("dense", w), layer=1)  # fp8_ds_mla layer
    native = torch.zeros(4, BLOCK, TINY.L + TINY.R, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache: layer 1"):
        layer.check_cache(native)


def test_bad_kv_b_proj_shape_raises():
    w = torch.randn(10, TINY.L)
    with pytest.raises(ValueError, match="kv_b_proj: expected"):
        MLAPrefill(TINY, DS, make_weight("dense", w), layer=1)


def test_metadata_lengths_are_ints():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context_lens\[0\]: expected an int >= 0"):
        PrefillMetadata(bt, (16.5, 3), (1, 1))
    with pytest.raises(ValueError, match=r"query_lens\[1\]: expected an int >= 0"):
        PrefillMetadata(bt, (16, 3), (1, True))


def test_per_tensor_fp8_layers_use_their_own_k_scale():
    """Per-tensor K scales belong to a layer (calculate_kv_scales computes one per
    layer); one PrefillMetadata serves every layer, so forward takes the layer's
    scale. With the batch-wide metadata scale the second layer would dequantize
    its cache 8x too small."""
    gen = torch.Generator().manual_seed(7)
    batch = Batch(ctx_lens=[40, 9], q_lens=[2, 3], seed=7)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens,
                           torch.tensor([0.02], dtype=torch.float32))
    for index, scale in ((1, 0.02), (2, 0.16)):
        k_scale = torch.tensor([scale], dtype=torch.float32)
        w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
        layer = MLAPrefill(TINY, FP8, make_weight("dense", w), layer=index, workspace_rows_override=32)
        cache = batch.fill_cache(layer, k_scale)
        out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, k_scale=k_scale)
        kv_c, k_pe = batch.cached_rows(layer, cache, k_scale)
        ref = mla_prefill_reference(
            batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
            layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V, layer.softmax_scale,
        )
        assert rel_fro(out, ref) <= 1e-2


def test_shared_workspace_gives_the_same_result_and_is_checked():
    batch = Batch(ctx_lens=[40, 3], q_lens=[2, 3], seed=5)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L) / 32
    layer = MLAPrefill(TINY, DS, make_weight("dense", w), layer=1, workspace_rows_override=32)
    k_scale = torch.tensor([1.0])
    cache = batch.fill_cache(layer, k_scale)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens)
    args = (batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    # A wider buffer (row stride 600) shared by layers, poisoned.
    shared = torch.full((64, 600), float("nan"), dtype=torch.bfloat16)[:, : TINY.L + TINY.R]
    assert torch.equal(layer(*args, workspace=shared), layer(*args))
    with pytest.raises(ValueError, match="workspace: layer 1 expects"):
        layer(*args, workspace=torch.empty(16, TINY.L + TINY.R, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="workspace: layer 1 expects"):
        layer(*args, workspace=torch.empty(64, TINY.L + TINY.R, dtype=torch.float32))


def test_forward_rejects_wrong_dtype_and_device_naming_the_argument():
    batch = Batch(ctx_lens=[8], q_lens=[2], seed=3)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L) / 32
    layer = MLAPrefill(TINY, DS, make_weight("dense", w), layer=1)
    cache = batch.fill_cache(layer, None)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens)
    with pytest.raises(ValueError, match="q: expected the model dtype torch.bfloat16"):
        layer(batch.q.float(), batch.kv_c_new, batch.k_pe_new, cache, meta)
    with pytest.raises(ValueError, match="k_pe: expected the model dtype"):
        layer(batch.q, batch.kv_c_new, batch.k_pe_new.half(), cache, meta)
    with pytest.raises(ValueError, match="kv_cache: expected device"):
        layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache.to("meta"), meta)


@pytest.mark.parametrize("wkind, act", [
    ("fp8_block", torch.float8_e4m3fn),  # fp8 weights take fp8 activations under FP8 prefill
    ("marlin_fp8", torch.bfloat16),      # int32-packed: the params dtype, never int32
    ("nvfp4", torch.bfloat16),           # W4A16: the model dtype, never fp8
    ("dense", torch.bfloat16),
])
def test_fp8_prefill_routes_activation_dtype_per_layer(wkind, act):
    batch = Batch(ctx_lens=[50, 7], q_lens=[3, 2], seed=11)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    layer = MLAPrefill(TINY, DS, make_weight(wkind, w), layer=1, use_fp8_prefill=True,
                       workspace_rows_override=32)
    assert layer.activation_dtype == act
    cache = batch.fill_cache(layer, None)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens)
    out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    kv_c, k_pe = batch.cached_rows(layer, cache)
    ref = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
                                layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                layer.softmax_scale)
    # fp8 activations add e4m3 rounding (3 mantissa bits) on top of bf16.
    assert rel_fro(out, ref) <= (5e-2 if act == torch.float8_e4m3fn else 1e-2)


def test_batch_metadata_is_shared_across_layers():
    """Chunk metadata is copied to the device once per batch, not once per layer."""
    batch = Batch(ctx_lens=[70, 5], q_lens=[2, 1], seed=4)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L) / 32
    layers = [MLAPrefill(TINY, DS, make_weight("dense", w), layer=i, workspace_rows_override=32)
              for i in (0, 1)]
    for layer in layers:
        layer(batch.q, batch.kv_c_new, batch.k_pe_new, batch.fill_cache(layer, None), meta)
    plan = meta.plan(32, BLOCK)
    assert plan.num_chunks >= 2
    firsts = [meta.chunk_tensors(c, "cpu") for c in plan.chunks]
    assert all(meta.chunk_tensors(c, "cpu") is t for c, t in zip(plan.chunks, firsts))
    assert len(meta._chunk_t) == plan.num_chunks


@pytest.mark.parametrize("backend", ["triton", "torch", "flex_attention"])
def test_attention_takes_split_keys_and_reuses_one_scratch(backend):
    """The layer hands varlen_attention the keys split (k_nope, k_pe): Triton (the
    default) and the torch backend never build [M, N, P+R]; a backend that
    needs them (flex_attention) assembles them in the layer's one scratch per
    device, sized once for workspace_rows and reused by every chunk and call."""
    from mla_ext.attention import ATTENTION
    from mla_ext.attention.api import AttentionInputs

    batch = Batch(ctx_lens=[70, 0, 5, 33], q_lens=[3, 2, 1, 4], seed=11)
    c = torch.zeros(2, dtype=torch.int32)
    why = ATTENTION.get(backend).not_supported_reasons(AttentionInputs(batch.q, batch.q, batch.q, c, c, 0, 0, 1.0, True))
    if why:
        pytest.skip(f"{backend}: " + "; ".join(why))
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=torch.Generator().manual_seed(2)) / 32
    layer = MLAPrefill(TINY, DS, make_weight("dense", w), layer=1, workspace_rows_override=32, max_num_seqs=8)
    k_scale = torch.tensor([1.0])
    cache = batch.fill_cache(layer, k_scale)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens)
    assert len(meta.plan(layer.workspace_rows, layer.chunk_alignment).chunks) >= 3
    args = (batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    with ATTENTION.force(backend):
        out = layer(*args)
        again = layer(*args)
    assert torch.equal(out, again)
    kv_c, k_pe = batch.cached_rows(layer, cache, k_scale)
    ref = mla_prefill_reference(
        batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
        layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V, layer.softmax_scale,
    )
    assert rel_fro(out, ref) <= 1e-2
    scratch = layer._attn_scratch[torch.device("cpu")]
    if backend == "flex_attention":
        assert scratch.allocations == 1  # new tokens + every chunk of both calls: one buffer
        assert scratch.nbytes() == 32 * TINY.num_heads * (TINY.P + TINY.R) * 2
    else:
        assert scratch.nbytes() == 0
    # Layers may share one scratch (forward's attention_scratch=), as they share a workspace.
    from mla_ext.attention import AttentionScratch

    shared = AttentionScratch(min_rows=32)
    with ATTENTION.force(backend):
        assert torch.equal(layer(*args, attention_scratch=shared), out)
    assert shared.allocations == (1 if backend == "flex_attention" else 0)
    with pytest.raises(ValueError, match="attention_scratch: expected an mla_ext.attention.AttentionScratch"):
        layer(*args, attention_scratch=torch.empty(4))
