"""A kv_b_proj whose params_dtype differs from the model dtype: fp8_block
declared fp16, fp8 per-channel declared fp32, NVFP4 declared fp16 in a bf16 model,
beside the formats that always worked that way (dense, Marlin, int4). MLAPrefill
reconciles at construction (the activations are cast to the linear's params
dtype, explain() says so): every forward then matches the reference."""
from __future__ import annotations

import math

import pytest
import torch

from mla_ext.kv_b_proj import weights as W
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.reference import mla_prefill_reference
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, Batch

F16, F32 = torch.float16, torch.float32
MAKERS = {
    "fp8_block": lambda w, dt: W.Fp8BlockWeight.from_dense(w, dt),
    "fp8_channel": lambda w, dt: W.Fp8Weight.from_dense(w, per_channel=True, params_dtype=dt),
    "nvfp4": lambda w, dt: W.Nvfp4Weight.from_dense(w, dt),
    "dense": lambda w, dt: W.DenseWeight.from_dense(w, dt),
    "marlin_fp8": lambda w, dt: W.MarlinFp8Weight.from_dense(w, dt),
    "int4_group": lambda w, dt: W.Int4GroupWeight.from_dense(w, params_dtype=dt),
}


@pytest.mark.parametrize("wkind, params_dtype, fp8_prefill", [
    ("fp8_block", F16, False), ("fp8_channel", F32, False), ("nvfp4", F16, False),
    ("fp8_block", F16, True), ("nvfp4", F16, True), ("dense", F16, False), ("marlin_fp8", F16, False),
    ("int4_group", F32, False),
])
def test_params_dtype_other_than_the_model_dtype(wkind, params_dtype, fp8_prefill):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    layer = MLAPrefill(TINY, CacheConfig(kv_cache_dtype="auto", block_size=BLOCK), MAKERS[wkind](w, params_dtype),
                       layer=1, use_fp8_prefill=fp8_prefill, workspace_rows_override=32, max_num_seqs=8)
    assert layer.kv_b_proj.params_dtype == params_dtype
    if not (fp8_prefill and wkind.startswith("fp8")):
        assert layer.activation_dtype == params_dtype
    assert f"params_dtype {params_dtype} differs from the model dtype torch.bfloat16" in layer.explain()
    batch = Batch(ctx_lens=[40, 0, 9], q_lens=[2, 3, 1], seed=2)
    cache = batch.fill_cache(layer, None)
    out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache,
                PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, block_size=BLOCK))
    assert out.dtype == torch.bfloat16
    kv_c, k_pe = batch.cached_rows(layer, cache)
    ref = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
                                layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                layer.softmax_scale)
    assert rel_fro(out, ref) <= (5e-2 if fp8_prefill and wkind.startswith("fp8") else 1e-2)
