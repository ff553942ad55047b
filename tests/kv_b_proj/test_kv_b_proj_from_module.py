"""kv_b_proj formats read from modules and checkpoint-style objects.

Round trip for every format: module -> format -> dequantized weight equals
what the module's tensors mean (decoded independently here). Unrecognisable
modules are ValueErrors that list the tensors found. SPEC §5's activation
dtype must be the same for the module and for KvBProj(module).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mla_ext.kv_b_proj import KvBProj, kv_b_proj_input_dtype, weight_format_from_module
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from helpers.numeric import rel_mean_abs

N, K = 192, 256
BF16, FP16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * 0.05
    assert bool((t != 0).all())
    return t


class Layer(nn.Module):
    """A checkpoint-style layer: the given tensors as parameters, the rest as attributes."""

    def __init__(self, **attrs):
        super().__init__()
        for name, value in attrs.items():
            if isinstance(value, torch.Tensor):
                self.register_parameter(name, nn.Parameter(value, requires_grad=False))
            else:
                setattr(self, name, value)


def _fp8_layer(per_channel: bool, **extra):
    f = W.Fp8Weight.from_dense(_randn(N, K), per_channel=per_channel, params_dtype=BF16)
    scale = f.weight_scale.view(N, 1) if per_channel else f.weight_scale.reshape(())
    return Layer(weight=f.weight, weight_scale=scale, orig_dtype=BF16, **extra), f


def _gptq_pack_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """[G, N] zero points (0..15) -> int32 [G, N/8], 8 along N per word, lowest bits first."""
    g, n = zeros.shape
    z = zeros.to(torch.int64).view(g, n // 8, 8) << torch.arange(0, 32, 4).view(1, 1, 8)
    words = z.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_layer(group=64, **extra):
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int64)
    zeros = torch.randint(1, 16, (K // group, N), generator=g)
    scales = (torch.rand(K // group, N, generator=g) * 0.01 + 0.001).to(FP16)
    words = (q.view(K // 8, 8, N) << torch.arange(0, 32, 4).view(1, 8, 1)).sum(1)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    want = ((q.float() - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)).t()
    return qweight, scales, zeros, want


def test_nn_linear_is_dense_and_bias_is_rejected():
    lin = nn.Linear(K, N, bias=False).to(BF16)
    with torch.no_grad():
        lin.weight.copy_(_randn(N, K))
    f = weight_format_from_module(lin)
    assert isinstance(f, W.DenseWeight) and (f.N, f.K, f.params_dtype) == (N, K, BF16)
    assert torch.equal(f.dequantize(BF16), lin.weight.detach())
    # An explicit params_dtype converts a dense weight.
    assert weight_format_from_module(lin, FP16).weight.dtype == FP16
    with pytest.raises(ValueError, match=r"module.bias: expected None \(kv_b_proj has no bias\)"):
        weight_format_from_module(nn.Linear(K, N, bias=True))


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_per_tensor_and_per_channel(per_channel):
    layer, src = _fp8_layer(per_channel, input_scale=torch.tensor(0.5))  # static input scale: ignored
    f = weight_format_from_module(layer)
    assert isinstance(f, W.Fp8Weight) and f.scheme == ("per_channel" if per_channel else "per_tensor")
    assert f.params_dtype == BF16
    assert torch.equal(f.dequantize_fp32(), ref.dequant_fp8(src.weight, src.weight_scale))


def test_fp8_weight_stored_transposed_is_turned_back_from_the_stated_sizes():
    layer, src = _fp8_layer(True)
    vllm_like = Layer(weight=src.weight.t(), weight_scale=layer.weight_scale.detach(), orig_dtype=BF16,
                      output_size_per_partition=N, input_size_per_partition=K)
    f = weight_format_from_module(vllm_like)
    assert (f.N, f.K) == (N, K)
    assert torch.equal(f.dequantize_fp32(), src.dequantize_fp32())
    wrong = Layer(weight=src.weight, weight_scale=layer.weight_scale.detach(), orig_dtype=BF16,
                  output_size_per_partition=N + 1, input_size_per_partition=K)
    with pytest.raises(ValueError, match=r"module.weight: expected shape \[193, 256\] .* got \[192, 256\]"):
        weight_format_from_module(wrong)


@pytest.mark.parametrize("style", ["deepseek", "weight_scale_2d", "weight_block_size"])
def test_block_fp8(style):
    src = W.Fp8BlockWeight.from_dense(_randn(N, K), BF16)
    if style == "deepseek":
        layer = Layer(weight=src.weight, weight_scale_inv=src.weight_scale_inv, params_dtype=BF16)
    elif style == "weight_scale_2d":  # compressed-tensors names it weight_scale
        layer = Layer(weight=src.weight, weight_scale=src.weight_scale_inv, params_dtype=BF16)
    else:
        layer = Layer(weight=src.weight, weight_scale=src.weight_scale_inv, params_dtype=BF16,
                      weight_block_size=[128, 128])
    f = weight_format_from_module(layer)
    assert isinstance(f, W.Fp8BlockWeight) and f.params_dtype == BF16
    assert torch.equal(f.dequantize_fp32(), ref.dequant_fp8_block(src.weight, src.weight_scale_inv))


def test_nvfp4_modelopt_names():
    src = W.Nvfp4Weight.from_dense(_randn(N, K), BF16)
    layer = Layer(weight=src.weight, weight_scale=src.weight_scale, weight_scale_2=src.weight_scale_2.reshape(()),
                  input_scale=torch.tensor(0.25), params_dtype=BF16)
    f = weight_format_from_module(layer)
    assert isinstance(f, W.Nvfp4Weight) and f.params_dtype == BF16
    assert torch.equal(f.dequantize_fp32(), ref.dequant_nvfp4(src.weight, src.weight_scale, src.weight_scale_2))


@pytest.mark.parametrize("zeros_style", ["packed_v1", "packed_v2", "unpacked"])
def test_gptq_int4(zeros_style):
    qweight, scales, zeros, want = _gptq_layer()
    extra = {}
    if zeros_style == "packed_v1":  # GPTQ v1 checkpoints store zero - 1
        extra["qzeros"] = _gptq_pack_zeros(zeros - 1)
    elif zeros_style == "packed_v2":
        extra.update(qzeros=_gptq_pack_zeros(zeros), checkpoint_format="gptq_v2")
    else:
        extra["zeros"] = zeros.to(torch.int32)
    g_idx = (torch.arange(K) // 64).to(torch.int32)
    layer = Layer(qweight=qweight, scales=scales, g_idx=g_idx, params_dtype=FP16, group_size=64, **extra)
    f = weight_format_from_module(layer)
    assert isinstance(f, W.Int4GroupWeight) and (f.N, f.K, f.group_size, f.params_dtype) == (N, K, 64, FP16)
    assert torch.equal(f.dequantize_fp32(), want)


def test_gptq_without_zeros_or_group_size_is_symmetric_and_derives_the_group():
    qweight, scales, _, _ = _gptq_layer(group=128)
    f = weight_format_from_module(Layer(qweight=qweight, scales=scales, params_dtype=FP16))
    assert f.group_size == 128 and f.zeros is None
    assert torch.equal(f.dequantize_fp32(), ref.dequant_int4_grouped(qweight, scales, None, 128))


def test_mapping_and_plain_objects_and_formats():
    src = W.Fp8BlockWeight.from_dense(_randn(N, K), BF16)
    f = weight_format_from_module({"weight": src.weight, "weight_scale_inv": src.weight_scale_inv}, BF16)
    assert torch.equal(f.dequantize_fp32(), src.dequantize_fp32())

    class Plain:
        pass

    obj = Plain()
    obj.weight, obj.weight_scale_inv, obj.params_dtype = src.weight, src.weight_scale_inv, BF16
    assert torch.equal(weight_format_from_module(obj).dequantize_fp32(), src.dequantize_fp32())
    assert weight_format_from_module(src) is src
    assert weight_format_from_module(KvBProj(src)) is src


def test_unknown_module_lists_its_tensors():
    layer = Layer(foo=torch.ones(3, 4), bar=torch.ones(2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"cannot recognise .* found: foo torch.float32 \[3, 4\], "
                                         r"bar torch.int8 \[2\]"):
        weight_format_from_module(layer)
    with pytest.raises(ValueError, match=r"found: none"):
        weight_format_from_module(nn.Module())


@pytest.mark.parametrize("make, match", [
    (lambda: Layer(weight=_fp8_layer(False)[1].weight, orig_dtype=BF16),
     r"needs `weight_scale` .* found: weight torch.float8_e4m3fn \[192, 256\]"),
    (lambda: Layer(weight=_fp8_layer(False)[1].weight, weight_scale=torch.ones(1), weight_scale_inv=torch.ones(2, 2),
                   orig_dtype=BF16), "not both"),
    (lambda: Layer(weight=_fp8_layer(False)[1].weight, weight_scale=torch.ones(1)),
     r"params_dtype: module stores torch.float8_e4m3fn weights, .* pass params_dtype="),
    (lambda: Layer(weight=_randn(N, K), weight_scale=torch.ones(1)), r"read as dense, which has no scales"),
    (lambda: Layer(weight=torch.ones(N, K // 2, dtype=torch.uint8), params_dtype=BF16),
     r"NVFP4 and needs `weight_scale` .* found: weight torch.uint8 \[192, 128\]"),
    (lambda: Layer(weight=torch.ones(K // 16, 4 * N, dtype=torch.int32), params_dtype=BF16),
     r"int32 is a packed layout .*Marlin"),
    (lambda: Layer(weight=torch.ones(N, K, dtype=torch.float64)), r"unsupported dtype torch.float64"),
    (lambda: Layer(qweight=torch.ones(K, N // 8, dtype=torch.int32), scales=torch.ones(4, N), params_dtype=FP16),
     r"GPTQ layout .* AWQ-style packing along N is not supported"),
    (lambda: Layer(qweight=_gptq_layer()[0], scales=_gptq_layer()[1], params_dtype=FP16, weight_bits=8),
     r"expected 4-bit weights"),
    (lambda: Layer(qweight=_gptq_layer()[0], scales=_gptq_layer()[1], params_dtype=FP16,
                   g_idx=torch.arange(K).flip(0) // 64), r"g_idx: expected the trivial order"),
    (lambda: Layer(qweight=_gptq_layer()[0], scales=_gptq_layer()[1], qzeros=torch.ones(4, 5, dtype=torch.int32),
                   params_dtype=FP16), r"qzeros: expected int32 \[K/group, N/8\] = \[4, 24\]"),
], ids=["fp8_no_scale", "fp8_two_scales", "fp8_no_params_dtype", "dense_with_scale", "uint8_no_scales",
        "int32_marlin", "float64", "awq_layout", "int8_bits", "act_order", "bad_qzeros"])
def test_unsupported_modules_are_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        weight_format_from_module(make())


def test_not_a_module():
    with pytest.raises(ValueError, match=r"module: expected a kv_b_proj WeightFormat .* got Tensor"):
        weight_format_from_module(torch.zeros(3))
    with pytest.raises(ValueError, match="params_dtype: expected one of"):
        weight_format_from_module(nn.Linear(K, N, bias=False), torch.int8)
    # KvBProj names its own argument.
    with pytest.raises(ValueError, match=r"weight_format: expected a kv_b_proj WeightFormat"):
        KvBProj(torch.zeros(3))


def _modules():
    lin = nn.Linear(K, N, bias=False).to(BF16)
    with torch.no_grad():
        lin.weight.copy_(_randn(N, K))
    blk = W.Fp8BlockWeight.from_dense(_randn(N, K), BF16)
    nv = W.Nvfp4Weight.from_dense(_randn(N, K), BF16)
    qweight, scales, zeros, _ = _gptq_layer()
    return {
        "dense": lin,
        "fp8": _fp8_layer(True)[0],
        "fp8_block": Layer(weight=blk.weight, weight_scale_inv=blk.weight_scale_inv, params_dtype=BF16),
        "nvfp4": Layer(weight=nv.weight, weight_scale=nv.weight_scale, weight_scale_2=nv.weight_scale_2,
                       params_dtype=BF16),
        "int4": Layer(qweight=qweight, scales=scales, qzeros=_gptq_pack_zeros(zeros - 1), params_dtype=FP16),
    }


# SPEC §5: (FP8 prefill off, FP8 prefill on) for each module kind.
SPEC5 = {
    "dense": (BF16, BF16),
    "fp8": (None, E4M3),
    "fp8_block": (None, E4M3),
    "nvfp4": (None, BF16),
    "int4": (FP16, FP16),
}


@pytest.mark.parametrize("kind", sorted(SPEC5))
def test_kv_b_proj_from_a_module_forward_and_input_dtype(kind):
    module = _modules()[kind]
    layer = KvBProj(module)
    fmt = weight_format_from_module(module)
    for fp8_prefill, want in zip((False, True), SPEC5[kind]):
        assert kv_b_proj_input_dtype(module, fp8_prefill) == want
        assert kv_b_proj_input_dtype(layer, fp8_prefill) == want
    x = _randn(5, K, seed=3).to(layer.params_dtype)
    torch.testing.assert_close(layer(x), KvBProj(fmt)(x), rtol=0, atol=0)


def test_mla_prefill_accepts_a_module():
    from mla_ext.config.models import MLAModelConfig
    from mla_ext.config.policy import CacheConfig
    from mla_ext.prefill.layer import MLAPrefill

    m = MLAModelConfig("t", L=512, R=64, P=32, V=16, num_heads=2, num_layers=2, max_model_len=256)
    src = W.Fp8BlockWeight.from_dense(_randn(96, 512), BF16)
    module = Layer(weight=src.weight, weight_scale_inv=src.weight_scale_inv, params_dtype=BF16)
    layer = MLAPrefill(m, CacheConfig("fp8_ds_mla", (), 16), module, layer=1, workspace_rows_override=32)
    assert isinstance(layer.kv_b_proj.weight_format, W.Fp8BlockWeight)
    assert torch.equal(layer.kv_b_proj.weight_format.dequantize_fp32(), src.dequantize_fp32())


# -- vLLM Marlin fp8 layers after process_weights_after_loading ----------------


def _vllm_marlin_layer(group_size=-1, act=BF16, scale_name="weight_scale", **extra):
    """A layer as vLLM leaves it after repacking for Marlin: int32 `weight` [K/16, 4N],
    permuted bias-folded scales in the model dtype, a `workspace`, its sizes and dtype.
    Returns (layer, the fp32 weight the packed tensors mean)."""
    from test_kv_b_proj_marlin import _ref_weight, vllm_marlin_encode

    if group_size == 128:
        blk = W.Fp8BlockWeight.from_dense(_randn(N, K, seed=11), act)
        w, s = blk.weight, blk.weight_scale_inv.repeat_interleave(128, 0)[:N].t().contiguous()
        extra.setdefault("weight_block_size", [128, 128])
    else:
        f = W.Fp8Weight.from_dense(_randn(N, K, seed=11), per_channel=True, params_dtype=act)
        w, s = f.weight, f.weight_scale
    qweight, scales = vllm_marlin_encode(w, s, group_size, act)
    # vLLM's LinearBase sets params_dtype, its fp8 method orig_dtype (both the model dtype).
    attrs = dict(weight=qweight, workspace=torch.zeros(8, dtype=torch.int32), orig_dtype=act, params_dtype=act,
                 output_size_per_partition=N, input_size_per_partition=K)
    attrs[scale_name] = scales
    attrs.update(extra)
    return Layer(**attrs), _ref_weight(w, s, group_size, act)


@pytest.mark.parametrize("group_size, scale_name", [(-1, "weight_scale"), (128, "weight_scale_inv"),
                                                    (128, "weight_scale")])
@pytest.mark.parametrize("act", [BF16, FP16])
def test_vllm_marlin_layer_is_read_without_a_copy(group_size, scale_name, act):
    layer, want = _vllm_marlin_layer(group_size, act, scale_name)
    f = weight_format_from_module(layer)
    assert isinstance(f, W.MarlinFp8Weight) and (f.N, f.K, f.params_dtype) == (N, K, act)
    assert f.packed.group_size == group_size
    assert f.weight.data_ptr() == layer.weight.data_ptr()
    assert f.packed.scales.data_ptr() == getattr(layer, scale_name).data_ptr()
    from mla_ext.kv_b_proj.marlin import marlin_fp8_dequantize

    assert torch.equal(marlin_fp8_dequantize(f.packed, torch.float32), want)
    # The explicit constructor reads the same layer the same way.
    g = W.MarlinFp8Weight.from_vllm_layer(layer)
    assert g.weight.data_ptr() == f.weight.data_ptr() and g.packed.group_size == group_size
    # SPEC §5: int32 (Marlin-packed) -> the params dtype, FP8 prefill on or off.
    for fp8_prefill in (False, True):
        assert kv_b_proj_input_dtype(layer, fp8_prefill) == act
        assert kv_b_proj_input_dtype(KvBProj(layer), fp8_prefill) == act
    x = _randn(5, K, seed=3).to(act)
    y = KvBProj(layer)(x).float()
    dense = x.float() @ want.t()
    assert rel_mean_abs(y, dense) < 0.04


def test_vllm_marlin_layer_sizes_from_the_shape_and_a_mapping():
    layer, want = _vllm_marlin_layer()
    d = {"weight": layer.weight, "weight_scale": layer.weight_scale, "marlin_workspace": layer.workspace,
         "orig_dtype": BF16}  # no stated sizes: the Marlin shape [K/16, 4N] gives them
    f = weight_format_from_module(d)
    assert isinstance(f, W.MarlinFp8Weight) and (f.N, f.K) == (N, K)
    assert f.weight.data_ptr() == layer.weight.data_ptr()


def test_vllm_marlin_layer_without_workspace_is_recognised_by_its_tensors():
    """vLLM 0.33 sets no `workspace`: an int32 weight with one 16-bit Marlin scale tensor
    of the matching width is read as Marlin fp8; the explicit constructor reads the same."""
    layer, want = _vllm_marlin_layer()
    del layer.workspace
    f = weight_format_from_module(layer)
    assert isinstance(f, W.MarlinFp8Weight) and f.weight.data_ptr() == layer.weight.data_ptr()
    g = W.MarlinFp8Weight.from_vllm_layer(layer)
    assert g.weight.data_ptr() == layer.weight.data_ptr()
    # fp32 scales (not Marlin's folded 16-bit ones) or a scale of another width: not Marlin.
    for bad in (layer.weight_scale.float(), layer.weight_scale[..., :64].contiguous()):
        odd, _ = _vllm_marlin_layer(weight_scale=bad)
        del odd.workspace
        with pytest.raises(ValueError, match=r"int32 is a packed layout .*Marlin.*from_vllm_layer"):
            weight_format_from_module(odd)


@pytest.mark.parametrize("make, match", [
    (lambda: _vllm_marlin_layer(weight_scale_inv=torch.ones(1, N, dtype=BF16))[0], r"exactly one of `weight_scale`"),
    (lambda: _vllm_marlin_layer(output_size_per_partition=128)[0],
     r"qweight: expected shape \[K_pad/16, 4\*N_pad\] with N_pad in \[128\] .*do the stated sizes belong"),
    (lambda: _vllm_marlin_layer(orig_dtype=None, params_dtype=None)[0],
     r"params_dtype: module stores Marlin-packed int32 weights"),
    (lambda: _vllm_marlin_layer(orig_dtype=torch.float32, params_dtype=torch.float32)[0],
     r"params_dtype: expected torch.bfloat16 or "),
    (lambda: _vllm_marlin_layer(orig_dtype=FP16, params_dtype=FP16)[0], r"scales: expected torch.float16"),
    (lambda: _vllm_marlin_layer(weight_block_size=[128, 64])[0], r"group_size: expected -1 .* or 128"),
    (lambda: _vllm_marlin_layer(weight_block_size="128")[0], r"weight_block_size: expected None or"),
], ids=["two_scales", "sizes_mismatch", "no_dtype", "fp32_dtype", "dtype_mismatch", "group_64", "bad_block"])
def test_vllm_marlin_layer_errors(make, match):
    with pytest.raises(ValueError, match=match):
        weight_format_from_module(make())
