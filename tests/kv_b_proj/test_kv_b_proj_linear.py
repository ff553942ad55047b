"""KvBProj: every format x {bf16, fp16} x M x odd N against the dequantized
fp32 reference, through the automatic choice and every forced backend that can
run here (Triton interpreter, Marlin packed-layout CPU reference, CPU _scaled_mm).

Tolerances (SPEC §9): bf16 relative Frobenius <= 1e-2, fp16 <= 5e-3; weight-only
GEMMs additionally mean|out - ref| / mean|ref| < 0.04. W8A8 paths are compared
with a reference that quantizes the activation the same way.
"""
import pytest
import torch

from mla_ext.kv_b_proj import DISPATCH, KvBProj
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.compat import cpu_rowwise_scaled_mm_reasons, triton_interpreter_reasons
from mla_ext.dispatch import NoBackendError, is_triton_backend
from mla_ext.kv_b_proj.linear import KvBProjInputs, backend_report
from helpers.numeric import rel_fro, rel_mean_abs

N_ODD, K = 131, 256
MS = [1, 7, 64, 300]
DTYPES = [torch.bfloat16, torch.float16]
FROB = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _fmt(name, w, dt):
    return W.quantize(name, w, dt)


FORMATS = sorted(W.RECIPES)
# The forced (non-default on CPU) backend for each format, where one exists.
KERNEL = {"fp8_block": "triton_fp8_block", "nvfp4": "triton_w4a16", "marlin_fp8": "marlin_w8a16",
          "marlin_fp8_g128": "marlin_w8a16"}
W8A8 = {"triton_fp8_block"}


def _weights(n=N_ODD, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _x(m, dt, k=K, seed=1, row_stride=None):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(m, row_stride or k, generator=g).to(dt)
    return full[:, :k]


def _check(out, expect, dt, weight_only=False):
    assert out.dtype == dt
    out = out.float()
    assert torch.isfinite(out).all(), "NaN/inf in output (unwritten or broken)"
    frob = rel_fro(out, expect)
    assert frob <= FROB[dt], f"relative Frobenius {frob:.2e} > {FROB[dt]}"
    if weight_only:
        mean_rel = rel_mean_abs(out, expect)
        assert mean_rel < 0.04, mean_rel


def _expect(layer, x, backend):
    wd = layer.weight_format.dequantize_fp32().to(x.device)
    if backend in W8A8:
        q, s = ref.per_token_group_quant_fp8_ref(x)
        return ref.linear_ref(ref.dequant_activation(q, s), wd)
    return ref.linear_ref(x, wd)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", MS)
def test_auto_dispatch_matches_reference(name, dt, m):
    layer = KvBProj(_fmt(name, _weights(), dt))
    x = _x(m, dt)
    assert layer.backend_for(m) == "dequant_dense"  # the only automatic CPU choice
    _check(layer(x), _expect(layer, x, "dequant_dense"), dt)


@pytest.mark.parametrize("name", sorted(KERNEL))
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", MS)
def test_forced_kernel_matches_reference_with_poisoned_out(name, dt, m):
    backend = KERNEL[name]
    layer = KvBProj(_fmt(name, _weights(), dt))
    x = _x(m, dt, row_stride=K + 64)  # the workspace[:, :L] view: row stride E, not L
    assert x.stride(0) == K + 64
    out = torch.full((m, N_ODD), float("nan"), dtype=dt)
    with DISPATCH.force(backend):
        y = layer(x, out=out)
    assert y.data_ptr() == out.data_ptr()
    _check(y, _expect(layer, x, backend), dt, weight_only=backend not in W8A8)
    if backend in W8A8:  # and against the unquantized activation, loosely
        e = ref.linear_ref(x, layer.weight_format.dequantize_fp32())
        assert rel_mean_abs(y, e) < 0.04


# CPU torch._scaled_mm takes row-wise scales from torch 2.14 on, not in 2.11 (probed).
CPU_ROWWISE = cpu_rowwise_scaled_mm_reasons()


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m", MS)
def test_scaled_mm_fp8_matches_rowwise_quantized_reference(per_channel, m):
    if CPU_ROWWISE:
        pytest.skip(CPU_ROWWISE[0])
    n = 144  # cuBLAS fp8 needs N % 16 == 0, so this backend refuses odd N
    layer = KvBProj(W.Fp8Weight.from_dense(_weights(n), per_channel=per_channel, params_dtype=torch.bfloat16))
    x = _x(m, torch.bfloat16, row_stride=K + 64)
    xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-10) / 448.0
    xq = ref.decode_e4m3(ref.quantize_e4m3(x.float() / xs)) * xs
    with DISPATCH.force("scaled_mm_fp8"):
        y = layer(x)
    _check(y, ref.linear_ref(xq, layer.weight_format.dequantize_fp32()), torch.bfloat16)


def test_scaled_mm_states_whether_cpu_torch_takes_rowwise_scales():
    """Where CPU _scaled_mm is per-tensor only, scaled_mm_fp8 says so (forced: the
    error names it) and the automatic choice still serves the call."""
    layer = KvBProj(W.Fp8Weight.from_dense(_weights(144), per_channel=True, params_dtype=torch.bfloat16))
    x = _x(16, torch.bfloat16)
    with DISPATCH.force("scaled_mm_fp8"):
        text = layer.explain(16)
        if CPU_ROWWISE:
            assert CPU_ROWWISE[0] in text
            with pytest.raises(NoBackendError) as err:
                layer(x)
            assert CPU_ROWWISE[0] in str(err.value)
        else:
            assert "[*] scaled_mm_fp8" in text
    if not torch.cuda.is_available():  # the machine report says it too
        report = {name: why for _, name, why in backend_report()}
        assert set(CPU_ROWWISE) <= set(report["scaled_mm_fp8"])
    assert layer.backend_for(16) == "dequant_dense"
    _check(layer(x), _expect(layer, x, "dequant_dense"), torch.bfloat16)


def test_scaled_mm_refuses_odd_n_and_fp16():
    odd = KvBProj(W.Fp8Weight.from_dense(_weights(), params_dtype=torch.bfloat16))
    half = KvBProj(W.Fp8Weight.from_dense(_weights(144), params_dtype=torch.float16))
    assert "multiples of 16" in odd.explain(16)
    assert "bf16 only" in half.explain(16)


@pytest.mark.parametrize("name", ["fp8_block", "fp8_per_channel"])
@pytest.mark.parametrize("backend", ["dequant_dense", "triton_fp8_block"])
def test_fp8_input_under_fp8_prefill(name, backend):
    if backend == "triton_fp8_block" and name != "fp8_block":
        pytest.skip("triton_fp8_block serves block weights only")
    layer = KvBProj(_fmt(name, _weights(), torch.bfloat16))
    x = _x(64, torch.bfloat16)
    x_scale = torch.tensor([0.02])
    xq = ref.quantize_e4m3(x.float() / 0.02)
    with DISPATCH.force(backend):
        y = layer(xq, x_scale=x_scale)
    expect = ref.linear_ref(ref.decode_e4m3(xq) * 0.02, layer.weight_format.dequantize_fp32())
    _check(y, expect, torch.bfloat16)


def test_dense_weight_cache_is_built_once_and_reused():
    layer = KvBProj(W.Fp8BlockWeight.from_dense(_weights(), torch.bfloat16))
    a = layer.dense_weight(torch.bfloat16, torch.device("cpu"))
    b = layer.dense_weight(torch.bfloat16, torch.device("cpu"))
    assert a is b
    dense = KvBProj(W.DenseWeight.from_dense(_weights(), torch.bfloat16))
    assert dense.dense_weight(torch.bfloat16, torch.device("cpu")) is dense.weight_format.weight


def test_zero_rows():
    layer = KvBProj(W.Nvfp4Weight.from_dense(_weights(), torch.bfloat16))
    y = layer(torch.empty(0, K, dtype=torch.bfloat16))
    assert y.shape == (0, N_ODD)


def test_bad_inputs_raise_value_error():
    layer = KvBProj(W.Nvfp4Weight.from_dense(_weights(), torch.bfloat16))
    with pytest.raises(ValueError, match="K=256"):
        layer(torch.zeros(4, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x dtype must be"):
        layer(torch.zeros(4, K, dtype=torch.float16))
    with pytest.raises(ValueError, match="kv_b_proj_input_dtype"):
        layer(torch.zeros(4, K).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="out must be"):
        layer(torch.zeros(4, K, dtype=torch.bfloat16), out=torch.zeros(4, N_ODD))
    with pytest.raises(ValueError, match="weight_format"):
        KvBProj(torch.zeros(3))


def test_forcing_a_backend_that_cannot_serve_is_an_error():
    layer = KvBProj(W.DenseWeight.from_dense(_weights(), torch.bfloat16))
    with DISPATCH.force("triton_w4a16"), pytest.raises(ValueError, match="not nvfp4"):
        layer(_x(4, torch.bfloat16))


def _choose(layer, m, cap):
    inp = KvBProjInputs(layer, m, torch.device("cuda"), cap, layer.params_dtype)
    return DISPATCH.choose(inp).name


@pytest.mark.parametrize("cap,m,name,expect", [
    ((8, 6), 16, "nvfp4", "triton_w4a16"),
    ((8, 6), 8192, "nvfp4", "dequant_dense"),
    ((8, 6), 16, "fp8_block", "dequant_dense"),      # no native fp8 on sm_86
    ((9, 0), 16, "fp8_block", "triton_fp8_block"),
    ((9, 0), 8192, "fp8_block", "triton_fp8_block"),
    ((9, 0), 8192, "fp8_per_channel", "dequant_dense"),        # odd N: cuBLAS fp8 refuses
    ((9, 0), 8192, "int4_group", "dequant_dense"),
    ((9, 0), 8192, "dense", "dequant_dense"),
])
def test_dispatch_choice_by_capability_and_m(cap, m, name, expect):
    _skip_if_triton_cannot_run(expect)
    layer = KvBProj(_fmt(name, _weights(), torch.bfloat16))
    assert _choose(layer, m, cap) == expect


def test_dispatch_choice_marlin_by_m():
    layer = KvBProj(_fmt("marlin_fp8", _weights(n=256), torch.bfloat16))
    assert _choose(layer, 16, (8, 6)) == "marlin_w8a16"
    assert _choose(layer, 8192, (8, 6)) == "dequant_dense"
    assert _choose(layer, 16, (7, 0)) == "dequant_dense"


def _skip_if_triton_cannot_run(backend):
    """Under TRITON_INTERPRET=1 an interpreter this numpy breaks (and no shim fixes) is a
    reason of every Triton backend (mla_ext.compat), so the dispatcher rightly avoids them."""
    why = triton_interpreter_reasons()
    if is_triton_backend(backend) and why:
        pytest.skip(why[0])


def test_explain_names_every_backend_and_the_choice():
    _skip_if_triton_cannot_run("triton_w4a16")
    layer = KvBProj(W.Nvfp4Weight.from_dense(_weights(), torch.bfloat16))
    text = layer.explain(16)
    assert "uses 'dequant_dense'" in text and "nvfp4" in text and "M=16" in text
    for b in DISPATCH.backends:
        assert b.name in text
    with DISPATCH.force("triton_w4a16"):
        assert "uses 'triton_w4a16'" in layer.explain(16)
        assert "uses 'triton_w4a16'" in layer.explain(8192)  # forcing overrides M limits
    assert "W4A16_MAX_M" in layer.explain(8192)


def test_backend_report_lists_every_backend():
    rows = backend_report()
    assert [r[1] for r in rows] == [b.name for b in DISPATCH.backends]
    assert all(r[0] == "kv_b_proj" and isinstance(r[2], list) for r in rows)
    assert rows[-1] == ("kv_b_proj", "dequant_dense", [])


# -- GPU ----------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("name", FORMATS + ["fp8_per_channel_aligned"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", MS + [4096])
def test_cuda_auto_dispatch_matches_reference(name, dt, m):
    n = 144 if name == "fp8_per_channel_aligned" else N_ODD
    fmt = _fmt(name.replace("_aligned", ""), _weights(n), dt).to("cuda")
    layer = KvBProj(fmt)
    x = _x(m, dt, row_stride=K + 64).cuda()
    backend = layer.backend_for(m)
    out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    y = layer(x, out=out)
    if backend == "scaled_mm_fp8":
        xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-10) / 448.0
        xr = (ref.decode_e4m3(ref.quantize_e4m3(x.float() / xs)) * xs)
        expect = ref.linear_ref(xr.cpu(), fmt.dequantize_fp32().cpu())
    else:
        expect = _expect(layer, x.cpu(), backend)
    _check(y.cpu(), expect, dt, weight_only=backend in ("marlin_w8a16", "triton_w4a16"))


def test_bad_scalar_and_non_tensor_inputs_raise_value_error():
    """x that is not a tensor, a non-finite x_scale (checked where reading it is free:
    on the CPU), and an M that is not a row count are errors, not NaN outputs or
    a dispatch decision for M=True."""
    layer = KvBProj(W.Fp8BlockWeight.from_dense(_weights(), torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected a torch.Tensor"):
        layer(None)
    xq = torch.ones(4, K).to(torch.float8_e4m3fn)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="x_scale: expected a finite value > 0"):
            layer(xq, torch.tensor([bad]))
    for m in (True, -1, 2.5):
        with pytest.raises(ValueError, match="M: expected an int >= 0"):
            layer.explain(m)
        with pytest.raises(ValueError, match="M: expected an int >= 0"):
            layer.backend_for(m)
