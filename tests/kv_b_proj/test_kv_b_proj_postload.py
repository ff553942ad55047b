"""kv_b_proj weights as vLLM's process_weights_after_loading leaves them.

NVFP4: vLLM swizzles the e4m3 block scales for its CUTLASS GEMM. This file
builds that layout with its own encoder, written from the layout facts (rows
padded to 128, scale columns to 4, then [M/128, K/4, 32, 4, 4]: scale (r, c)
at ((r // 128) * (Kp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
+ c % 4), checks it against a published anchor (cuBLAS's block-scale offset
helper: for an NVFP4 operand of 128 x 128, scale (5, 2) sits at 82 and (5, 5)
at 593), and proves the round trip swizzled -> Nvfp4Weight is exact, at
DeepSeek sizes (where the swizzled tensor has the checkpoint's shape) and at
padded ones. Block FP8: transposed and padded weight_scale_inv, stated
explicitly. Nothing is inferred from a shape: the default layout is the
checkpoint's, and a serving-engine layer must say which.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn

from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.from_module import weight_format_from_module

BF16 = torch.bfloat16


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * 0.05
    assert bool((t != 0).all())
    return t


def swizzle_index(r: int, c: int, kp: int) -> int:
    """Flat position of scale (row r, scale column c) in the 128x4 layout (kp = padded columns)."""
    return ((r // 128) * (kp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def independent_swizzle(scales: torch.Tensor, pad_value: int = 0) -> torch.Tensor:
    """[N, K/16] e4m3 -> [Mp, Kp] e4m3 in the swizzled order, one element at a time."""
    n, kb = scales.shape
    mp, kp = -(-n // 128) * 128, -(-kb // 4) * 4
    src = scales.view(torch.uint8).numpy()
    flat = np.full(mp * kp, pad_value, dtype=np.uint8)
    for r in range(mp):
        for c in range(kp):
            flat[swizzle_index(r, c, kp)] = src[r, c] if (r < n and c < kb) else pad_value
    return torch.from_numpy(flat).view(torch.float8_e4m3fn).reshape(mp, kp)


class VllmLikeLayer(nn.Module):
    """What a vLLM linear layer looks like to from_module: parameters plus the
    `quant_method` every vLLM linear layer carries."""

    def __init__(self, **attrs):
        super().__init__()
        self.quant_method = object()
        for name, value in attrs.items():
            if isinstance(value, torch.Tensor):
                self.register_parameter(name, nn.Parameter(value, requires_grad=False))
            else:
                setattr(self, name, value)


# -- the swizzle itself ---------------------------------------------------------------

def test_swizzle_index_matches_the_published_anchor():
    # NVFP4 A of M=128 x K=128: 8 scale columns, Kp = 8.
    assert swizzle_index(5, 2, 8) == 82 and swizzle_index(5, 5, 8) == 593
    # The library's swizzle puts a marked scale at the same places.
    for (r, c), want in (((5, 2), 82), ((5, 5), 593)):
        s = torch.zeros(128, 8, dtype=torch.uint8)
        s[r, c] = 0x38
        flat = W.swizzle_nvfp4_scales(s.view(torch.float8_e4m3fn)).view(torch.uint8).reshape(-1)
        assert flat.nonzero().flatten().tolist() == [want]


def test_swizzle_is_a_permutation_of_the_padded_tile():
    kp = 8
    idx = sorted(swizzle_index(r, c, kp) for r in range(256) for c in range(kp))
    assert idx == list(range(256 * kp))


@pytest.mark.parametrize("n,k", [(256, 512), (4096, 512), (200, 512), (128, 48), (72, 96)],
                         ids=["deepseek_tp", "deepseek_tp8", "pad_rows", "pad_cols", "pad_both"])
def test_library_swizzle_equals_the_independent_encoder(n, k):
    nv = W.Nvfp4Weight.from_dense(_randn(n, k, seed=n + k), BF16)
    got = W.swizzle_nvfp4_scales(nv.weight_scale)
    assert tuple(got.shape) == W.nvfp4_swizzled_scale_shape(n, k)
    assert torch.equal(got.view(torch.uint8), independent_swizzle(nv.weight_scale).view(torch.uint8))
    assert torch.equal(W.unswizzle_nvfp4_scales(got, n, k).view(torch.uint8), nv.weight_scale.view(torch.uint8))


@pytest.mark.parametrize("n,k", [(256, 512), (200, 512), (128, 48), (72, 96)],
                         ids=["deepseek", "pad_rows", "pad_cols", "pad_both"])
@pytest.mark.parametrize("form", ["2d", "flat", "uint8"])
def test_swizzled_round_trip_is_exact(n, k, form):
    src = W.Nvfp4Weight.from_dense(_randn(n, k, seed=3), BF16)
    sw = independent_swizzle(src.weight_scale, pad_value=0x7F)  # padding = e4m3 NaN: must never be read
    if form == "flat":
        sw = sw.reshape(-1)
    elif form == "uint8":
        sw = sw.view(torch.uint8)
    got = W.Nvfp4Weight(src.weight, sw, src.weight_scale_2, BF16, scale_layout="swizzled")
    assert got.loaded_scale_layout == "swizzled" and "swizzled" in got.describe()
    assert tuple(got.weight_scale.shape) == (n, k // 16) and got.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(got.weight_scale.view(torch.uint8), src.weight_scale.view(torch.uint8))
    assert torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    # The stored object is linear: slicing and sharding work as for a checkpoint.
    assert torch.equal(got.slice_rows(0, 64).dequantize_fp32(), src.dequantize_fp32()[:64])


def test_swizzled_scales_read_as_linear_are_wrong_which_is_why_the_default_is_stated():
    """At DeepSeek kv_b_proj sizes the swizzled tensor has the checkpoint's shape, so the
    linear default accepts it, and most of the weight comes out wrong."""
    n, k = 512, 512
    src = W.Nvfp4Weight.from_dense(_randn(n, k, seed=4) * torch.linspace(0.1, 3.0, n)[:, None], BF16)
    sw = independent_swizzle(src.weight_scale)
    assert sw.shape == src.weight_scale.shape  # indistinguishable by shape
    wrong = W.Nvfp4Weight(src.weight, sw, src.weight_scale_2, BF16)  # default: linear
    frac = float((wrong.dequantize_fp32() != src.dequantize_fp32()).float().mean())
    assert frac > 0.5, frac
    assert inspect.signature(W.Nvfp4Weight).parameters["scale_layout"].default == "linear"
    assert "DEFAULT" in W.Nvfp4Weight.__doc__ and "linear" in W.Nvfp4Weight.__doc__


def test_nvfp4_from_vllm_postload():
    n, k = 200, 512
    src = W.Nvfp4Weight.from_dense(_randn(n, k, seed=5), BF16)
    sw = W.swizzle_nvfp4_scales(src.weight_scale)
    got = W.Nvfp4Weight.from_vllm_postload(src.weight, sw, src.weight_scale_2.reshape(()), BF16)
    assert torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    # A padded weight (rows to 256, K bytes to 272): the logical N, K are read.
    wpad = torch.full((256, 272), 0x77, dtype=torch.uint8)
    wpad[:n, : k // 2] = src.weight
    got = W.Nvfp4Weight.from_vllm_postload(wpad, sw, src.weight_scale_2, BF16, N=n, K=k)
    assert (got.N, got.K) == (n, k) and torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    # A backend that kept the checkpoint layout says so.
    got = W.Nvfp4Weight.from_vllm_postload(src.weight, src.weight_scale, src.weight_scale_2, BF16,
                                           scale_layout="linear")
    assert torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    with pytest.raises(ValueError, match=r"scale_layout: expected one of \('linear', 'swizzled'\), got 'marlin'"):
        W.Nvfp4Weight.from_vllm_postload(src.weight, sw, src.weight_scale_2, BF16, scale_layout="marlin")
    with pytest.raises(ValueError, match=r"weight_scale: swizzled block scales .* \[Mp, Kp\] = \[256, 32\]"):
        W.Nvfp4Weight(src.weight, src.weight_scale, src.weight_scale_2, BF16, scale_layout="swizzled")
    with pytest.raises(ValueError, match=r"N, K: the weight holds"):
        W.Nvfp4Weight.from_vllm_postload(src.weight, sw, src.weight_scale_2, BF16, N=300)


# -- from_module: the layout is stated, never guessed ---------------------------------

def test_from_module_nvfp4_layouts():
    n, k = 256, 512
    src = W.Nvfp4Weight.from_dense(_randn(n, k, seed=6), BF16)
    sw = W.swizzle_nvfp4_scales(src.weight_scale)
    layer = VllmLikeLayer(weight=src.weight, weight_scale=sw, weight_scale_2=src.weight_scale_2,
                          params_dtype=BF16)
    with pytest.raises(ValueError, match=r"scale_layout: module is a serving-engine layer .*quant_method.*"
                                         r"\('linear', 'swizzled'\)"):
        weight_format_from_module(layer)
    got = weight_format_from_module(layer, scale_layout="swizzled")
    assert torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    layer.weight_scale_layout = "swizzled"  # the object says it
    assert torch.equal(weight_format_from_module(layer).dequantize_fp32(), src.dequantize_fp32())
    with pytest.raises(ValueError, match=r"scale_layout: 'linear' contradicts module.weight_scale_layout = "
                                         r"'swizzled'"):
        weight_format_from_module(layer, scale_layout="linear")
    # A checkpoint-style object (no serving-engine marker): its tensors are the checkpoint's.
    ckpt = {"weight": src.weight, "weight_scale": src.weight_scale, "weight_scale_2": src.weight_scale_2,
            "params_dtype": BF16}
    assert weight_format_from_module(ckpt).loaded_scale_layout == "linear"
    assert torch.equal(weight_format_from_module(ckpt).dequantize_fp32(), src.dequantize_fp32())
    with pytest.raises(ValueError, match=r"scale_layout: expected one of \('linear', 'swizzled'\) for NVFP4"):
        weight_format_from_module(ckpt, scale_layout="transposed")
    with pytest.raises(ValueError, match=r"scale_layout: only NVFP4 \(uint8\) and block-FP8 weights"):
        weight_format_from_module(nn.Linear(k, n, bias=False), scale_layout="linear")


# -- block FP8 ---------------------------------------------------------------------------

def _block(n=384, k=512, seed=7):
    return W.Fp8BlockWeight.from_dense(_randn(n, k, seed=seed) * torch.linspace(0.2, 5.0, n)[:, None], BF16)


@pytest.mark.parametrize("layout", ["transposed", "linear_padded", "transposed_padded"])
def test_block_fp8_scale_layouts_round_trip(layout):
    src = _block()
    s = src.weight_scale_inv  # [3, 4]
    garbage = float("nan")  # padding must never be read
    if layout == "transposed":
        given = s.t()  # a strided view of the checkpoint's
    elif layout == "linear_padded":
        given = torch.full((3, 8), garbage)
        given[:, :4] = s
    else:  # cuBLASLt blockwise scale_b: [round_up(K/128, 4), N/128] with strides [1, L4]
        base = torch.full((3, 8), garbage)
        base[:, :4] = s
        given = base.t()
        assert given.stride() == (1, 8)
    got = W.Fp8BlockWeight(src.weight, given, BF16, scale_layout=layout)
    assert got.loaded_scale_layout == layout and got.weight_scale_inv.is_contiguous()
    assert torch.equal(got.weight_scale_inv, s)
    assert torch.equal(got.dequantize_fp32(), ref.dequant_fp8_block(src.weight, s))


def test_block_fp8_transposed_square_scales_are_not_detectable_by_shape():
    src = _block(256, 256, seed=8)  # gn == gk == 2
    t = src.weight_scale_inv.t().contiguous()
    assert t.shape == src.weight_scale_inv.shape and not torch.equal(t, src.weight_scale_inv)
    assert not torch.equal(W.Fp8BlockWeight(src.weight, t, BF16).dequantize_fp32(), src.dequantize_fp32())
    fixed = W.Fp8BlockWeight(src.weight, t, BF16, scale_layout="transposed")
    assert torch.equal(fixed.dequantize_fp32(), src.dequantize_fp32())
    assert inspect.signature(W.Fp8BlockWeight).parameters["scale_layout"].default == "linear"


def test_block_fp8_from_vllm_postload():
    src = _block(300, 512, seed=9)  # gn = 3 (N not a multiple of 128)
    # Weight padded to N = 384 and stored [K, N]; scales transposed.
    wpad = torch.zeros(384, 512, dtype=torch.float8_e4m3fn)
    wpad[:300] = src.weight
    got = W.Fp8BlockWeight.from_vllm_postload(wpad.t(), src.weight_scale_inv.t(), BF16, scale_layout="transposed",
                                              weight_transposed=True, N=300)
    assert (got.N, got.K) == (300, 512) and torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    with pytest.raises(TypeError):  # the layout is required
        W.Fp8BlockWeight.from_vllm_postload(src.weight, src.weight_scale_inv, BF16)
    with pytest.raises(ValueError, match=r"weight_scale_inv: scale_layout 'transposed' needs shape \(4, 3\)"):
        W.Fp8BlockWeight.from_vllm_postload(src.weight, src.weight_scale_inv, BF16, scale_layout="transposed")
    with pytest.raises(ValueError, match=r"scale_layout: expected one of \('linear', 'transposed'"):
        W.Fp8BlockWeight(src.weight, src.weight_scale_inv, BF16, scale_layout="swizzled")
    # Marlin packing of the loaded weight sees the linear scales.
    m = W.MarlinFp8Weight.from_fp8(got)
    assert torch.allclose(m.dequantize_fp32(), got.dequantize_fp32(), rtol=2**-7, atol=0)


def test_from_module_block_fp8_layouts():
    src = _block(256, 512, seed=10)
    layer = VllmLikeLayer(weight=src.weight, weight_scale_inv=src.weight_scale_inv.t().contiguous(),
                          orig_dtype=BF16, weight_block_size=[128, 128])
    with pytest.raises(ValueError, match=r"scale_layout: module is a serving-engine layer .* block-FP8"):
        weight_format_from_module(layer)
    got = weight_format_from_module(layer, scale_layout="transposed")
    assert isinstance(got, W.Fp8BlockWeight) and torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    layer.weight_scale_layout = "transposed"
    assert torch.equal(weight_format_from_module(layer).dequantize_fp32(), src.dequantize_fp32())
    # A non-linear layout marks an fp8 weight with a plain `weight_scale` as block-scaled.
    ckpt = {"weight": src.weight, "weight_scale": src.weight_scale_inv.t(), "params_dtype": BF16}
    got = weight_format_from_module(ckpt, scale_layout="transposed")
    assert isinstance(got, W.Fp8BlockWeight) and torch.equal(got.dequantize_fp32(), src.dequantize_fp32())
    # Per-channel fp8 of a serving layer has no layout to state.
    f = W.Fp8Weight.from_dense(_randn(256, 512, seed=11), per_channel=True, params_dtype=BF16)
    pc = VllmLikeLayer(weight=f.weight, weight_scale=f.weight_scale.view(-1, 1), orig_dtype=BF16)
    assert isinstance(weight_format_from_module(pc), W.Fp8Weight)
