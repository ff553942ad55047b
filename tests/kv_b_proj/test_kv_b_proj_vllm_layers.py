"""vLLM 0.33's post-load kv_b_proj layers, recognised as they are.

What vLLM 0.33 leaves on a layer after process_weights_after_loading (read in
its source, model_executor/layers/quantization/):
- Marlin FP8 (GPUs without native FP8): `weight` int32 [K_pad/16, 4*N_pad],
  `weight_scale` / `weight_scale_inv` permuted + bias-folded in `orig_dtype`,
  N and K zero-padded to Marlin's tiles (N=200 -> 256), the TRUE sizes in
  `output_size_per_partition` / `input_size_per_partition`, NO `workspace`
  attribute; its Fp8LinearMethod says `use_marlin = True`.
- ModelOpt NVFP4: `weight_scale_2` deleted, `weight_global_scale` (0-d fp32,
  the same multiplier) stored; the weight zero-padded to multiples of 32 and
  the block scales swizzled (128x4) for CUTLASS / FlashInfer.
- Block FP8: scales possibly transposed / padded: the layout must be stated.
- MLA attention: `W_UK_T` [N, P, L] and `W_UV` [N, L, V] (kv_b_proj dequantized
  to the activation dtype and split per head).
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.from_module import weight_format_from_module
from mla_ext.kv_b_proj.marlin import marlin_fp8_dequantize, marlin_fp8_repack
from test_kv_b_proj_marlin import _case, vllm_padded_encode

BF16 = torch.bfloat16


class Vllm033Layer(nn.Module):
    """A vLLM 0.33 linear layer as from_module sees it: parameters, the stated
    sizes and `orig_dtype`, and a `quant_method` (vLLM's Fp8LinearMethod or
    ModelOpt method; here only the attributes that matter)."""

    def __init__(self, n, k, quant_method=None, **attrs):
        super().__init__()
        self.output_size_per_partition, self.input_size_per_partition = n, k
        self.quant_method = quant_method if quant_method is not None else types.SimpleNamespace()
        for name, value in attrs.items():
            if isinstance(value, torch.Tensor):
                self.register_parameter(name, nn.Parameter(value, requires_grad=False))
            else:
                setattr(self, name, value)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- Marlin FP8 -------------------------------------------------------------------

@pytest.mark.parametrize("n,k,group_size", [(200, 512, -1), (200, 512, 128), (256, 512, -1), (200, 400, -1)])
@pytest.mark.parametrize("scale_name", ["weight_scale", "weight_scale_inv"])
@pytest.mark.parametrize("said", [True, None], ids=["use_marlin", "no_statement"])
def test_marlin_fp8_layer_without_workspace_is_recognised(n, k, group_size, scale_name, said):
    w, s, _ = _case(n, k, group_size, seed=n + k + group_size)
    qweight, scales = vllm_padded_encode(w, s, group_size, BF16)
    method = types.SimpleNamespace() if said is None else types.SimpleNamespace(use_marlin=said)
    layer = Vllm033Layer(n, k, quant_method=method, weight=qweight,
                         orig_dtype=BF16, **{scale_name: scales},
                         **({} if group_size == -1 else {"weight_block_size": [128, group_size]}))
    assert not hasattr(layer, "workspace")
    got = weight_format_from_module(layer)
    assert isinstance(got, W.MarlinFp8Weight) and (got.N, got.K) == (n, k)
    want = marlin_fp8_dequantize(marlin_fp8_repack(w, s, BF16, group_size=group_size))
    assert torch.equal(got.dequantize_fp32(), want.float())
    assert got.packed.qweight.data_ptr() == qweight.data_ptr()  # no copy
    # from_vllm_layer (the explicit constructor) reads the same.
    assert torch.equal(W.MarlinFp8Weight.from_vllm_layer(layer).dequantize_fp32(), want.float())


def test_marlin_is_read_from_the_kernel_class_too():
    class MarlinFP8ScaledMMLinearKernel:  # vLLM's kernel class name
        pass

    w, s, _ = _case(256, 512, -1, seed=3)
    qweight, scales = vllm_padded_encode(w, s, -1, BF16)
    layer = Vllm033Layer(256, 512, quant_method=types.SimpleNamespace(fp8_linear=MarlinFP8ScaledMMLinearKernel()),
                         weight=qweight, weight_scale=scales, orig_dtype=BF16)
    assert isinstance(weight_format_from_module(layer), W.MarlinFp8Weight)


def test_int32_weight_of_a_non_marlin_method_is_still_refused():
    w, s, _ = _case(256, 512, -1, seed=4)
    qweight, scales = vllm_padded_encode(w, s, -1, BF16)
    layer = Vllm033Layer(256, 512, quant_method=types.SimpleNamespace(use_marlin=False), weight=qweight,
                         weight_scale=scales, orig_dtype=BF16)
    with pytest.raises(ValueError, match=r"module.weight: int32 is a packed layout and the object does not say"):
        weight_format_from_module(layer)


# -- NVFP4 ------------------------------------------------------------------------

def _pad32(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


@pytest.mark.parametrize("n,k", [(200, 512), (256, 512), (200, 336)])
def test_nvfp4_postload_layer_with_global_scale_and_padding(n, k):
    src = W.Nvfp4Weight.from_dense(_randn(n, k, seed=n + k), BF16)
    np_, kp = -(-n // 32) * 32, -(-k // 32) * 32  # vLLM's pad_nvfp4_weight_for_cutlass
    weight = _pad32(src.weight, np_, kp // 2)
    layer = Vllm033Layer(n, k, weight=weight, weight_scale=W.swizzle_nvfp4_scales(src.weight_scale),
                         weight_global_scale=src.weight_scale_2.reshape(()), orig_dtype=BF16)
    assert not hasattr(layer, "weight_scale_2")
    with pytest.raises(ValueError, match=r"scale_layout: module is a serving-engine layer"):
        weight_format_from_module(layer)  # the layout is stated, never guessed
    got = weight_format_from_module(layer, scale_layout="swizzled")
    assert isinstance(got, W.Nvfp4Weight) and (got.N, got.K) == (n, k)
    assert torch.equal(got.dequantize_fp32(), src.dequantize_fp32())


def test_nvfp4_global_scale_marks_a_postload_layer_even_without_quant_method():
    """Only vLLM's post-load layer has `weight_global_scale`: its scales may be swizzled,
    so a bare object holding it must state the layout too (never read as linear)."""
    src = W.Nvfp4Weight.from_dense(_randn(256, 512, seed=4), BF16)
    bare = {"weight": src.weight, "weight_scale": W.swizzle_nvfp4_scales(src.weight_scale),
            "weight_global_scale": src.weight_scale_2.reshape(()), "orig_dtype": BF16}
    with pytest.raises(ValueError, match=r"scale_layout: module is a serving-engine layer .*weight_global_scale"):
        weight_format_from_module(bare)
    got = weight_format_from_module(bare, scale_layout="swizzled")
    assert torch.equal(got.dequantize_fp32(), src.dequantize_fp32())


def test_nvfp4_both_global_scales_is_refused():
    src = W.Nvfp4Weight.from_dense(_randn(64, 128, seed=1), BF16)
    ckpt = {"weight": src.weight, "weight_scale": src.weight_scale, "weight_scale_2": src.weight_scale_2,
            "weight_global_scale": src.weight_scale_2.reshape(()), "params_dtype": BF16}
    with pytest.raises(ValueError, match=r"module: expected one of `weight_scale_2` .* or `weight_global_scale`"):
        weight_format_from_module(ckpt)


# -- block FP8 --------------------------------------------------------------------

def test_block_fp8_postload_layer_with_padded_weight_states_its_layout():
    n, k = 300, 512
    src = W.Fp8BlockWeight.from_dense(_randn(n, k, seed=9), BF16)
    wpad = torch.zeros(384, k, dtype=torch.float8_e4m3fn)
    wpad[:n] = src.weight
    layer = Vllm033Layer(n, k, weight=wpad, weight_scale_inv=src.weight_scale_inv.t().contiguous(),
                         orig_dtype=BF16, weight_block_size=[128, 128])
    with pytest.raises(ValueError, match=r"scale_layout: module is a serving-engine layer .* block-FP8"):
        weight_format_from_module(layer)
    got = weight_format_from_module(layer, scale_layout="transposed")
    assert (got.N, got.K) == (n, k) and torch.equal(got.dequantize_fp32(), src.dequantize_fp32())


# -- W_UK / W_UV --------------------------------------------------------------------

def _vllm_w_uk_uv(w: torch.Tensor, L: int, N: int, P: int, V: int):
    """What vLLM's MLAAttention.process_weights_after_loading keeps, from its
    split_kv_b_proj: weight.T viewed [L, N, P+V] and split; then stored as
    W_UV.transpose(0, 1) [N, L, V] and W_UK.permute(1, 2, 0) [N, P, L]."""
    w_uk, w_uv = w.t().view(L, N, P + V).split([P, V], dim=-1)
    return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_weight_from_vllm_w_uk_w_uv(dtype):
    L, N, P, V = 64, 3, 16, 8
    w = _randn(N * (P + V), L, seed=2).to(dtype)
    w_uk_t, w_uv = _vllm_w_uk_uv(w, L, N, P, V)
    got = W.DenseWeight.from_vllm_mla(w_uk_t, w_uv)
    assert got.weight.dtype == dtype and torch.equal(got.weight, w)
    attn = types.SimpleNamespace(W_UK_T=w_uk_t, W_UV=w_uv)  # vLLM's MLAAttention after loading
    assert torch.equal(weight_format_from_module(attn).weight, w)


@pytest.mark.parametrize("bad, match", [
    (lambda uk, uv: (uk[0], uv), r"W_UK_T: expected a 3-D tensor \(\[N, P, L\]\)"),
    (lambda uk, uv: (uk, uv[:, :-1]), r"W_UV: expected shape \[N=3, L=64, V\]"),
    (lambda uk, uv: (uk, uv.half()), r"W_UV: expected dtype torch.bfloat16"),
    (lambda uk, uv: (uk.int(), uv), r"W_UK_T: expected one of"),
])
def test_from_vllm_mla_names_the_bad_argument(bad, match):
    w = _randn(3 * 24, 64, seed=3).to(BF16)
    uk, uv = _vllm_w_uk_uv(w, 64, 3, 16, 8)
    with pytest.raises(ValueError, match=match):
        W.DenseWeight.from_vllm_mla(*bad(uk, uv))
