"""The W8A8 block-FP8 tolerance (SPEC §9): scaled_mm_block and
triton_fp8_block quantize a 16/32-bit activation per 1x128 group to e4m3, as
DeepSeek and vLLM do. Against a reference that applies the same quantization to
the same weights the result is tight (SPEC §9: <= 1e-3 for the GEMM; a whole MLA
layer within the model dtype's bound); against unquantized activations it is
reported and only loosely bounded. `explain()` says when activations are
quantized, and that the absorbed context path does not quantize them.

Under TRITON_INTERPRET the kernel's fp32 -> bf16 store truncates (round toward
zero, toolchain-notes), so its bf16 output is compared with a reference rounded
the same way; on a GPU (the cuda test) it rounds to nearest."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.linear import DISPATCH, KvBProj
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.reference import mla_prefill_reference
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, Batch

SAME_QUANT_GEMM = 1e-3  # SPEC §9, W8A8 GEMM against the same activation quantization
UNQUANTIZED_LOOSE = 6e-2  # reported; measured 2.6e-2 (GEMM), 2.9e-2 (layer) on random data
LAYER_SAME_QUANT = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # SPEC §9 per model dtype


def qdq(x: torch.Tensor) -> torch.Tensor:
    """x with the W8A8 backends' activation quantization applied (1x128 groups, e4m3), fp32."""
    if x.shape[0] == 0:
        return x.float()
    q, s = ref.per_token_group_quant_fp8_ref(x.float())
    g = s.repeat_interleave(ref.FP8_BLOCK, 1)[:, : x.shape[1]]
    return ref.decode_e4m3(q) * g


def _round_like_interpreter(y: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    if dt != torch.bfloat16:
        return y.to(dt).float()
    return (y.contiguous().view(torch.int32) & -65536).view(torch.float32)  # round toward zero


def _gemm_case(dt, m=37, k=512, n=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = KvBProj(W.Fp8BlockWeight.from_dense(torch.randn(n, k, generator=gen) * 0.05, dt))
    x = torch.randn(m, k, generator=gen).to(dt)
    wd = layer.weight_format.dequantize_fp32()
    return layer, x, ref.linear_ref(qdq(x), wd), ref.linear_ref(x.float(), wd)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_fp8_block_gemm_against_the_same_quantization(dt, record_property):
    layer, x, same, unquant = _gemm_case(dt)
    with DISPATCH.force("triton_fp8_block"):
        y = layer(x)
    err_same = rel_fro(y, _round_like_interpreter(same, dt))
    err_unquant = rel_fro(y, unquant)
    record_property("w8a8_vs_unquantized", err_unquant)
    print(f"triton_fp8_block {dt}: {err_same:.2e} vs same quantization, {err_unquant:.2e} vs unquantized")
    assert err_same <= SAME_QUANT_GEMM
    assert 5e-3 < err_unquant <= UNQUANTIZED_LOOSE  # the quantization is really there, and bounded


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_scaled_mm_block_gemm_against_the_same_quantization(dt, monkeypatch):
    from helpers.kv_b_proj import emulated_scaled_mm as _emulated_scaled_mm

    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm([]))
    from mla_ext.kv_b_proj.scaled_mm_block import scaled_mm_block_linear

    layer, x, same, unquant = _gemm_case(dt, m=36)
    y = scaled_mm_block_linear(x, layer.scaled_mm_block_weight("cpu"), dt)
    assert rel_fro(y, same.to(dt).float()) <= SAME_QUANT_GEMM
    assert 5e-3 < rel_fro(y, unquant) <= UNQUANTIZED_LOOSE


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["scaled_mm_block", "triton_fp8_block"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_w8a8_gemm_on_the_gpu(backend, dt):
    layer, x, same, unquant = _gemm_case(dt, m=4096)
    layer = layer.to("cuda")
    why = DISPATCH.get(backend).not_supported_reasons(layer._inputs(4096, "cuda", dt, x.cuda()))
    if why:
        pytest.skip("; ".join(why))
    with DISPATCH.force(backend):
        y = layer(x.cuda()).cpu()
    assert rel_fro(y, same.to(dt).float()) <= SAME_QUANT_GEMM
    assert rel_fro(y, unquant) <= UNQUANTIZED_LOOSE


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_mla_layer_with_w8a8_up_projection(dt, record_property):
    """A whole layer (new tokens and chunked context, up_project path) on the W8A8
    kernel: within the model dtype's SPEC §9 bound of the prefill reference fed the
    same quantized latents; the unquantized reference is reported."""
    model = dataclasses.replace(TINY, model_dtype=dt)
    w = torch.randn(model.num_heads * (model.P + model.V), model.L,
                    generator=torch.Generator().manual_seed(3)) / math.sqrt(model.L)
    layer = MLAPrefill(model, CacheConfig("auto", block_size=BLOCK), W.Fp8BlockWeight.from_dense(w, dt), layer=0,
                       workspace_rows_override=32, max_num_seqs=8, context_attention="up_project")
    b = Batch(ctx_lens=[40, 0, 21], q_lens=[3, 2, 4], seed=1)
    if dt != torch.bfloat16:
        b.q, b.kv_c_new, b.k_pe_new = b.q.to(dt), b.kv_c_new.to(dt), b.k_pe_new.to(dt)
        b.ctx_kv_c = [c.to(dt) for c in b.ctx_kv_c]
        b.ctx_k_pe = [c.to(dt) for c in b.ctx_k_pe]
    cache = b.fill_cache(layer, None)
    with DISPATCH.force("triton_fp8_block"):
        assert "quantized per 1x128 group to e4m3" in layer.explain()
        out = layer(b.q, b.kv_c_new, b.k_pe_new, cache, PrefillMetadata(b.block_table, b.ctx_lens, b.q_lens))
    kv_c, k_pe = b.cached_rows(layer, cache)
    wd = layer.kv_b_proj.weight_format.dequantize_fp32()
    args = (b.q_lens, wd, model.P, model.V, layer.softmax_scale)
    same = mla_prefill_reference(b.q, qdq(b.kv_c_new), b.k_pe_new, [qdq(c) for c in kv_c], k_pe, *args)
    unquant = mla_prefill_reference(b.q, b.kv_c_new, b.k_pe_new, kv_c, k_pe, *args)
    record_property("layer_w8a8_vs_unquantized", rel_fro(out, unquant))
    print(f"MLA layer {dt}, W8A8 up-projection: {rel_fro(out, same):.2e} vs the same quantization, "
          f"{rel_fro(out, unquant):.2e} vs unquantized")
    assert rel_fro(out, same) <= LAYER_SAME_QUANT[dt]
    assert rel_fro(out, unquant) <= UNQUANTIZED_LOOSE


def _layer(weight: str, mode: str = "auto", fp8_prefill: bool = False) -> MLAPrefill:
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L) / 32
    fmt = (W.Fp8BlockWeight.from_dense(w, torch.bfloat16) if weight == "fp8_block"
           else W.DenseWeight.from_dense(w, torch.bfloat16))
    return MLAPrefill(TINY, CacheConfig("auto", block_size=BLOCK), fmt, layer=0, context_attention=mode,
                      use_fp8_prefill=fp8_prefill)


def test_explain_states_the_activation_quantization():
    layer = _layer("fp8_block")
    with DISPATCH.force("triton_fp8_block"):
        text = layer.explain()
        assert "kv_b_proj activations: quantized per 1x128 group to e4m3" in text and "SPEC §9" in text
        assert "absorbed context chunks use the dequantized kv_b_proj weight with unquantized" in text
        assert "activations: quantized per 1x128 group" in layer.kv_b_proj.explain(64)
        # Every chunk up-projected: the paths cannot differ, no note.
        assert "absorbed context chunks" not in _layer("fp8_block", "up_project").explain()
    # The CPU default (dequantize + 16-bit GEMM) does not quantize.
    assert "kv_b_proj activations: not quantized" in layer.explain()
    assert "kv_b_proj activations: not quantized" in _layer("dense").explain()
    assert "absorbed context chunks" not in layer.explain()
    assert "arrive as float8_e4m3fn" in _layer("fp8_block", fp8_prefill=True).explain()
