"""SPEC §5 activation-dtype table: one test per row and FP8-prefill setting,
on duck-typed upstream-style layers and on this package's formats."""
import pytest
import torch

from mla_ext.kv_b_proj import KvBProj, kv_b_proj_input_dtype
from mla_ext.kv_b_proj import weights as W

FP8 = torch.float8_e4m3fn


class UpstreamLinear(torch.nn.Module):
    """An upstream-style layer: stored `.weight` plus `params_dtype`."""

    def __init__(self, weight_dtype, params_dtype, shape=(8, 16)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape).to(weight_dtype), requires_grad=False)
        self.params_dtype = params_dtype


class UpstreamGptq(torch.nn.Module):
    """GPTQ/AWQ-style layer: qweight/scales, no `.weight`."""

    def __init__(self, params_dtype):
        super().__init__()
        self.qweight = torch.nn.Parameter(torch.zeros(2, 8, dtype=torch.int32), requires_grad=False)
        self.scales = torch.nn.Parameter(torch.ones(1, 8, dtype=params_dtype), requires_grad=False)
        self.params_dtype = params_dtype


@pytest.fixture
def w():
    torch.manual_seed(0)
    return torch.randn(40, 128) * 0.1


# -- row: int32 (Marlin-packed) ---------------------------------------------

@pytest.mark.parametrize("params", [torch.bfloat16, torch.float16])
def test_int32_marlin_fp8_prefill_off_gives_params_dtype(params):
    assert kv_b_proj_input_dtype(UpstreamLinear(torch.int32, params), False) == params


@pytest.mark.parametrize("params", [torch.bfloat16, torch.float16])
def test_int32_marlin_fp8_prefill_on_gives_params_dtype(params):
    assert kv_b_proj_input_dtype(UpstreamLinear(torch.int32, params), True) == params


def test_regression_marlin_int32_never_gives_int32():
    """Upstream #38658: the activation was cast to the int32 storage dtype."""
    for fp8_prefill in (False, True):
        for params in (torch.bfloat16, torch.float16):
            dt = kv_b_proj_input_dtype(UpstreamLinear(torch.int32, params), fp8_prefill)
            assert dt != torch.int32 and dt.is_floating_point


def test_int32_without_params_dtype_is_a_clear_error():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int32), requires_grad=False)
    with pytest.raises(ValueError, match="params_dtype"):
        kv_b_proj_input_dtype(layer, False)


def test_int32_with_non_float_params_dtype_is_an_error():
    with pytest.raises(ValueError, match="model dtype"):
        kv_b_proj_input_dtype(UpstreamLinear(torch.int32, torch.int32), False)


def test_other_packed_integer_storage_follows_int32_row():
    assert kv_b_proj_input_dtype(UpstreamLinear(torch.int8, torch.bfloat16), True) == torch.bfloat16


# -- row: uint8 (NVFP4) -----------------------------------------------------

def test_uint8_nvfp4_fp8_prefill_off_is_no_cast():
    assert kv_b_proj_input_dtype(UpstreamLinear(torch.uint8, torch.bfloat16), False) is None


@pytest.mark.parametrize("params", [torch.bfloat16, torch.float16])
def test_uint8_nvfp4_fp8_prefill_on_gives_model_dtype_never_fp8(params):
    dt = kv_b_proj_input_dtype(UpstreamLinear(torch.uint8, params), True)
    assert dt == params
    assert dt != FP8


# -- row: fp8 ---------------------------------------------------------------

def test_fp8_fp8_prefill_off_is_no_cast():
    assert kv_b_proj_input_dtype(UpstreamLinear(FP8, torch.bfloat16), False) is None


def test_fp8_fp8_prefill_on_gives_fp8():
    assert kv_b_proj_input_dtype(UpstreamLinear(FP8, torch.bfloat16), True) == FP8


# -- row: bf16/fp16/fp32 ----------------------------------------------------

@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8_prefill", [False, True])
def test_float_weight_gives_that_dtype(dt, fp8_prefill):
    # params_dtype deliberately different: the table says "that dtype".
    other = torch.float16 if dt != torch.float16 else torch.bfloat16
    assert kv_b_proj_input_dtype(UpstreamLinear(dt, other), fp8_prefill) == dt


# -- row: no `.weight` ------------------------------------------------------

@pytest.mark.parametrize("fp8_prefill", [False, True])
def test_no_weight_gives_params_dtype(fp8_prefill):
    assert kv_b_proj_input_dtype(UpstreamGptq(torch.float16), fp8_prefill) == torch.float16


def test_no_weight_and_no_params_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="no `.weight`"):
        kv_b_proj_input_dtype(torch.nn.Module(), False)


def test_compute_dtype_attribute_is_preferred_over_params_dtype():
    layer = UpstreamLinear(torch.int32, torch.float16)
    layer.compute_dtype = torch.bfloat16
    assert kv_b_proj_input_dtype(layer, False) == torch.bfloat16


def test_unsupported_storage_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported stored weight dtype"):
        kv_b_proj_input_dtype(UpstreamLinear(torch.bool, torch.bfloat16), False)


# -- the same rows on this package's formats and on KvBProj -----------------

def _ours(w):
    dt = torch.bfloat16
    return {
        "dense": (W.DenseWeight.from_dense(w, dt), dt, dt),
        "fp8": (W.Fp8Weight.from_dense(w, params_dtype=dt), None, FP8),
        "fp8_block": (W.Fp8BlockWeight.from_dense(w, dt), None, FP8),
        "nvfp4": (W.Nvfp4Weight.from_dense(w, dt), None, dt),
        "int4_group": (W.Int4GroupWeight.from_dense(w, 64, dt), dt, dt),
    }


@pytest.mark.parametrize("name", ["dense", "fp8", "fp8_block", "nvfp4", "int4_group"])
def test_our_formats_and_layer_follow_the_table(w, name):
    fmt, off, on = _ours(w)[name]
    for obj in (fmt, KvBProj(fmt)):
        assert kv_b_proj_input_dtype(obj, False) == off
        assert kv_b_proj_input_dtype(obj, True) == on


def test_int4_group_format_and_layer_have_no_weight(w):
    fmt = W.Int4GroupWeight.from_dense(w, 64, torch.float16)
    assert not hasattr(fmt, "weight")
    assert not hasattr(KvBProj(fmt), "weight")


def test_marlin_format_stores_int32_and_gives_params_dtype(w):
    for dt in (torch.bfloat16, torch.float16):
        fmt = W.MarlinFp8Weight.from_dense(w.to(dt), dt)
        assert fmt.weight.dtype == torch.int32
        for obj in (fmt, KvBProj(fmt)):
            assert kv_b_proj_input_dtype(obj, False) == dt
            assert kv_b_proj_input_dtype(obj, True) == dt
