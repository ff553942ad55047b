"""MLAPrefill on a GPU: every backend chosen for CUDA tensors, no host
synchronisation on the forward path, and agreement with the one-shot oracle.

Skipped without a GPU (these are the checks a lent GPU machine runs through
benchmarks/gpu_check.sh).
"""
from __future__ import annotations

import math

import pytest
import torch

from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.prefill.synthetic import SyntheticBatch
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, make_weight

pytestmark = pytest.mark.cuda

CASES = [  # (kv_cache_dtype, layer index, weight format)
    ("fp8_ds_mla", 1, "fp8_block"),
    ("fp8_ds_mla", 1, "marlin_fp8"),
    ("fp8", 2, "nvfp4"),
    ("fp8_ds_mla", 0, "dense"),  # skipped layer: native bf16 cache
]


def _layer(fmt, index, wkind, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    cfg = CacheConfig(kv_cache_dtype=fmt, skip_layers=(0,), block_size=BLOCK)
    weight = make_weight(wkind, w.cuda())
    return MLAPrefill(TINY, cfg, weight, layer=index, workspace_rows_override=64, max_num_seqs=8)


@pytest.mark.parametrize("fmt,index,wkind", CASES)
def test_gpu_layer_matches_oracle_without_host_sync(fmt, index, wkind):
    batch = SyntheticBatch(TINY, [300, 0, 37, 1, 130], [5, 3, 1, 2, 7], BLOCK, device="cuda", seed=7)
    layer = _layer(fmt, index, wkind, seed=index)
    k_scale = torch.tensor([0.02], device="cuda")
    kv_c, k_pe = batch.layer_context(index)
    cache = batch.fill_cache(layer, kv_c, k_pe, k_scale)
    meta = batch.metadata(k_scale)
    args = (batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    layer(*args)  # warm-up: Triton compiles, dequantized weights get cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    ctx_kv_c, ctx_k_pe = batch.cached_rows(layer, cache, k_scale if layer.spec.is_quantized else None)
    ref = mla_prefill_reference(
        batch.q.cpu(), batch.kv_c_new.cpu(), batch.k_pe_new.cpu(), ctx_kv_c, ctx_k_pe, batch.q_lens,
        layer.kv_b_proj.weight_format.dequantize_fp32().cpu(), TINY.P, TINY.V, layer.softmax_scale,
    )
    assert not torch.isnan(out).any()
    assert rel_fro(out.cpu(), ref) <= 1e-2


@pytest.mark.parametrize("fmt,index,wkind", CASES)
def test_gpu_layer_cuda_graph_capture_and_replay(fmt, index, wkind):
    """The whole layer forward is capturable: after one eager warm-up (Triton
    compiles, weights dequantized once), a captured forward replays to the same
    output and picks up new inputs copied into the captured tensors."""
    batch = SyntheticBatch(TINY, [300, 0, 37, 1, 130], [5, 3, 1, 2, 7], BLOCK, device="cuda", seed=11)
    layer = _layer(fmt, index, wkind, seed=index + 5)
    k_scale = torch.tensor([0.02], device="cuda")
    kv_c, k_pe = batch.layer_context(index)
    cache = batch.fill_cache(layer, kv_c, k_pe, k_scale)
    meta = batch.metadata(k_scale)
    q, kv_new, pe_new = batch.q.clone(), batch.kv_c_new.clone(), batch.k_pe_new.clone()
    eager = layer(q, kv_new, pe_new, cache, meta)
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        layer(q, kv_new, pe_new, cache, meta)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(q, kv_new, pe_new, cache, meta)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not out.isnan().any() and rel_fro(out.cpu(), eager.cpu().float()) <= 1e-6

    q.copy_(torch.randn_like(q))  # new queries, same shapes: the replay follows them
    want = layer(q.clone(), kv_new, pe_new, cache, meta)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_fro(out.cpu(), want.cpu().float()) <= 1e-3
