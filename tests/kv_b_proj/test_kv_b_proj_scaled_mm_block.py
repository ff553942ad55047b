"""The scaled_mm_block kv_b_proj backend (block fp8 through torch._scaled_mm's
cuBLASLt blockwise scaling, sm_90): the 1 x 128 activation quantizer that writes
M-major scales (Triton, run here in the interpreter, against its torch reference),
the weight's cuBLASLt scale layout (prepared once, cached on the layer), the
GEMM's layout contract (against an emulated cuBLASLt that enforces it), the
capability probe and the dispatcher's reasons. The real GEMM runs in the
CUDA-marked tests (SPEC §9 tolerances against the dequantized reference)."""
import pytest

pytest.importorskip("triton")
import torch

from helpers.kv_b_proj import emulated_scaled_mm as _emulated_scaled_mm
from helpers.numeric import rel_fro, rel_mean_abs

from mla_ext.compat import interpreting, triton_interpreter_reasons
from mla_ext.dispatch import NoBackendError
from mla_ext.kv_b_proj import DISPATCH, KvBProj
from mla_ext.kv_b_proj import linear as L
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import scaled_mm_block as S
from mla_ext.kv_b_proj import triton_group_quant as gq
from mla_ext.kv_b_proj import weights as W

FROB = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
DTYPES = [torch.bfloat16, torch.float16]


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _x(m, k, dt, seed=1, row_stride=None):
    return (_rand(m, row_stride or k, seed=seed) * 2).to(dt)[:, :k]


def _block_layer(n=256, k=512, dt=torch.bfloat16, seed=0):
    return KvBProj(W.Fp8BlockWeight.from_dense(_rand(n, k, seed=seed, scale=0.05), dt))


def _w8a8_expect(x, layer):
    """x quantized the same way (1 x 128 groups), times the dequantized weight, fp32."""
    q, s = ref.per_token_group_quant_fp8_ref(x.float())
    return ref.linear_ref(ref.dequant_activation(q, s), layer.weight_format.dequantize_fp32().to(x.device))


def _e4m3_ulps(a, b):
    """|a - b| in e4m3 ulps of the larger magnitude (per element)."""
    fa, fb = ref.decode_e4m3(a.cpu()), ref.decode_e4m3(b.cpu())
    big = torch.maximum(fa.abs(), fb.abs()).clamp(min=2.0 ** -6)
    ulp = torch.exp2(torch.floor(torch.log2(big)) - 3)
    return (fa - fb).abs() / ulp


def _skip_unless_interpreter():
    if not interpreting():
        pytest.skip("runs the Triton kernel in the interpreter (TRITON_INTERPRET=1, no GPU)")
    why = triton_interpreter_reasons()
    if why:
        pytest.skip(why[0])


# -- the quantizer: reference definition and layout --------------------------------

@pytest.mark.parametrize("m,k,m_mult,k_mult", [(5, 300, 4, 128), (5, 300, 4, 512), (8, 512, 4, 512),
                                               (1, 128, 1, 128), (3, 1024, 4, 512)])
def test_mmajor_reference_layout_and_definition(m, k, m_mult, k_mult):
    x = _x(m, k, torch.bfloat16, row_stride=k + 40)
    q, s = gq.per_token_group_quant_fp8_mmajor_ref(x, m_mult, k_mult)
    mp, kp = -(-m // m_mult) * m_mult, -(-k // k_mult) * k_mult
    assert q.dtype == torch.float8_e4m3fn and q.shape == (mp, kp) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (mp, kp // 128) and s.stride() == (1, mp)  # M-major
    q0, s0 = ref.per_token_group_quant_fp8_ref(x)  # the row-major definition
    g = s0.shape[1]
    assert torch.equal(s[:m, :g], s0) and torch.equal(q[:m, :k].view(torch.uint8), q0.view(torch.uint8))
    # Padding rows and columns are quantized zeros: q = 0, scale = eps / 448.
    assert not q[m:].view(torch.uint8).any() and not q[:, k:].view(torch.uint8).any()
    pad = torch.tensor(gq.EPS, dtype=torch.float32) / 448.0  # fp32 eps, then the fp32 division
    assert torch.equal(s[m:], pad.expand_as(s[m:])) and torch.equal(s[:, -(-k // 128):], pad.expand_as(s[:, -(-k // 128):]))


def test_quantizer_argument_errors():
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        gq.per_token_group_quant_fp8_mmajor(torch.zeros(4))
    with pytest.raises(ValueError, match="x: dtype must be bf16, fp16 or fp32"):
        gq.per_token_group_quant_fp8_mmajor(torch.zeros(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: must have unit stride along K"):
        gq.per_token_group_quant_fp8_mmajor(torch.zeros(128, 4).t())
    with pytest.raises(ValueError, match="k_multiple: expected a multiple of 128"):
        gq.per_token_group_quant_fp8_mmajor(torch.zeros(4, 128), 4, 100)
    with pytest.raises(ValueError, match="m_multiple: expected an int >= 1"):
        gq.per_token_group_quant_fp8_mmajor(torch.zeros(4, 128), 0)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,k_mult", [(1, 512, 512), (5, 300, 512), (70, 512, 512), (33, 384, 128)])
def test_triton_quantizer_matches_reference_in_the_interpreter(dt, m, k, k_mult):
    """Scales bit-exact, in the M-major layout; q bit-exact too (the interpreter's
    fp32 -> fp8 cast is unreliable, so the interpreted kernel leaves that cast to
    torch; on a GPU the kernel casts itself: CUDA test below)."""
    _skip_unless_interpreter()
    x = _x(m, k, dt, seed=m, row_stride=576 if k <= 512 else k)
    q, s = gq.per_token_group_quant_fp8_mmajor(x, 4, k_mult, use_triton=True)
    q_ref, s_ref = gq.per_token_group_quant_fp8_mmajor_ref(x, 4, k_mult)
    assert s.shape == s_ref.shape and s.stride() == s_ref.stride() == (1, s.shape[0])
    assert torch.equal(s, s_ref)
    assert q.shape == q_ref.shape and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_triton_quantizer_zero_rows_and_outliers_in_the_interpreter():
    _skip_unless_interpreter()
    x = torch.zeros(6, 256, dtype=torch.bfloat16)
    x[1, 5] = 3e4  # one large value in a group: the others quantize to (near) zero
    x[2] = -1.0
    q, s = gq.per_token_group_quant_fp8_mmajor(x, 4, 512, use_triton=True)
    q_ref, s_ref = gq.per_token_group_quant_fp8_mmajor_ref(x, 4, 512)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert float(ref.decode_e4m3(q[1, 5:6])) == 448.0 and float(ref.decode_e4m3(q[2, :1])) == -448.0


def test_quantizer_on_cpu_defaults_to_the_reference():
    x = _x(5, 300, torch.bfloat16)
    q, s = gq.per_token_group_quant_fp8_mmajor(x, 4, 512)
    q_ref, s_ref = gq.per_token_group_quant_fp8_mmajor_ref(x, 4, 512)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q0, s0 = gq.per_token_group_quant_fp8_mmajor(x[:0], 4, 512)
    assert q0.shape == (0, 512) and s0.shape == (0, 4)


# -- the weight side ---------------------------------------------------------------

def test_prepare_weight_uses_cublaslt_scale_layout():
    f = W.Fp8BlockWeight.from_dense(_rand(384, 512, scale=0.05), torch.bfloat16)
    w = S.prepare_weight(f.weight, f.weight_scale_inv)
    assert w.weight.data_ptr() == f.weight.data_ptr()  # K = 512: no copy
    assert (w.N, w.K, w.Kp) == (384, 512, 512)
    # [L4, N/128] with strides (1, L4): s[g, nb] is the checkpoint's [nb, g].
    assert w.scale.shape == (4, 3) and w.scale.stride() == (1, 4)
    assert torch.equal(w.scale, f.weight_scale_inv.t())
    assert w.b.shape == (512, 384) and w.b.stride() == (1, 512)  # mat2: column-major


def test_prepare_weight_pads_k_to_a_multiple_of_512():
    f = W.Fp8BlockWeight.from_dense(_rand(256, 300, scale=0.05), torch.bfloat16)
    w = S.prepare_weight(f.weight, f.weight_scale_inv)
    assert (w.K, w.Kp) == (300, 512) and w.weight.shape == (256, 512)
    assert torch.equal(w.weight[:, :300].view(torch.uint8), f.weight.view(torch.uint8))
    assert not w.weight[:, 300:].view(torch.uint8).any()
    assert w.scale.shape == (4, 2) and w.scale.stride() == (1, 4)
    assert torch.equal(w.scale[:3], f.weight_scale_inv.t()) and torch.equal(w.scale[3], torch.ones(2))


def test_prepare_weight_errors_name_the_argument():
    f = W.Fp8BlockWeight.from_dense(_rand(200, 256, scale=0.05), torch.bfloat16)
    with pytest.raises(ValueError, match="N=200 must be a multiple of 128"):
        S.prepare_weight(f.weight, f.weight_scale_inv)
    g = W.Fp8BlockWeight.from_dense(_rand(256, 256, scale=0.05), torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_s: expected float \[2, 2\]"):
        S.prepare_weight(g.weight, g.weight_scale_inv[:1])
    with pytest.raises(ValueError, match="w_q: expected a float8_e4m3fn"):
        S.prepare_weight(g.weight.float(), g.weight_scale_inv)


def test_layer_caches_the_prepared_weight_per_device():
    layer = _block_layer()
    a = layer.scaled_mm_block_weight("cpu")
    assert layer.scaled_mm_block_weight(torch.device("cpu")) is a
    with pytest.raises(ValueError, match="needs fp8_block weights"):
        KvBProj(W.Fp8Weight.from_dense(_rand(256, 512), params_dtype=torch.bfloat16)).scaled_mm_block_weight("cpu")


# -- the GEMM's layout contract, against an emulated cuBLASLt ------------------------


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 512), (5, 512), (64, 512), (6, 300)])
@pytest.mark.parametrize("with_out", [False, True])
def test_gemm_layout_contract_with_emulated_cublaslt(monkeypatch, dt, m, k, with_out):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm(calls))
    layer = _block_layer(256, k, dt)
    w = layer.scaled_mm_block_weight("cpu")
    x = _x(m, k, dt, row_stride=k + 64)
    out = torch.full((m, 256), float("nan"), dtype=dt) if with_out else None
    y = S.scaled_mm_block_linear(x, w, dt, out=out)
    assert calls == [(-(-m // 4) * 4, -(-k // 512) * 512, 256)]
    assert y.shape == (m, 256) and y.dtype == dt and (out is None or y is out)
    assert rel_fro(y, _w8a8_expect(x, layer)) <= FROB[dt]


def test_gemm_into_a_strided_out_and_fp8_input(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm([]))
    layer = _block_layer(256, 512)
    w = layer.scaled_mm_block_weight("cpu")
    x = _x(8, 512, torch.bfloat16)
    big = torch.full((8, 300), float("nan"), dtype=torch.bfloat16)
    y = S.scaled_mm_block_linear(x, w, torch.bfloat16, out=big[:, 10:266])
    assert y.data_ptr() == big[:, 10:266].data_ptr() and torch.isnan(big[:, :10]).all()
    assert rel_fro(y, _w8a8_expect(x, layer)) <= FROB[torch.bfloat16]
    # FP8 prefill hands fp8 x with a per-tensor scale: used as it is.
    xq = ref.quantize_e4m3(x.float() / 0.02)
    y8 = S.scaled_mm_block_linear(xq[:7], w, torch.bfloat16, x_scale=torch.tensor([0.02]))
    expect = ref.linear_ref(ref.decode_e4m3(xq[:7]) * 0.02, layer.weight_format.dequantize_fp32())
    assert rel_fro(y8, expect) <= FROB[torch.bfloat16]


def test_gemm_argument_errors():
    w = _block_layer().scaled_mm_block_weight("cpu")
    with pytest.raises(ValueError, match=r"x: expected a 2-D tensor \[M, K=512\]"):
        S.scaled_mm_block_linear(torch.zeros(4, 256), w, torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype: expected torch.bfloat16 or torch.float16"):
        S.scaled_mm_block_linear(torch.zeros(4, 512), w, torch.float32)
    with pytest.raises(ValueError, match="x: dtype must be"):
        S.scaled_mm_block_linear(torch.zeros(4, 512, dtype=torch.int32), w, torch.bfloat16)
    with pytest.raises(ValueError, match=r"out: expected torch.bfloat16 \[4, 256\]"):
        S.scaled_mm_block_linear(torch.zeros(4, 512), w, torch.bfloat16, out=torch.empty(4, 255))
    assert S.scaled_mm_block_linear(torch.zeros(0, 512), w, torch.bfloat16).shape == (0, 256)


# -- capability probe and the dispatcher's reasons -----------------------------------

def test_cpu_probe_says_whether_cpu_scaled_mm_takes_blockwise_scales():
    err = S.blockwise_scaled_mm_error("cpu")
    assert S.blockwise_scaled_mm_probed("cpu")
    assert S.blockwise_scaled_mm_error("cpu") is err  # probed once, cached
    if err is not None:  # torch 2.14: "Invalid scaling configuration"
        assert torch.__version__ in err and "blockwise 1x128 x 128x128" in err
        assert S.blockwise_scaled_mm_reasons("cpu") == [err]


def test_reasons_on_cpu_name_the_architecture_and_the_torch_build():
    layer = _block_layer()
    text = layer.explain(4096)
    assert "uses 'dequant_dense'" in text
    err = S.blockwise_scaled_mm_error("cpu")
    if err is None:
        pytest.skip("this torch's CPU _scaled_mm takes blockwise scales")
    line = next(ln for ln in text.splitlines() if "scaled_mm_block" in ln)
    assert "needs a CUDA sm_90 device (input is on the CPU)" in line and err in line
    with DISPATCH.force("scaled_mm_block"), pytest.raises(NoBackendError, match="needs a CUDA sm_90"):
        layer(_x(4, 512, torch.bfloat16))
    report = {name: why for _, name, why in L.backend_report()}
    if not torch.cuda.is_available():
        assert report["scaled_mm_block"] == ["no CUDA device visible", err]


def test_shape_dtype_and_format_reasons():
    odd = KvBProj(W.Fp8BlockWeight.from_dense(_rand(131, 512, scale=0.05), torch.bfloat16))
    assert "N=131 must be a multiple of 128" in odd.explain(64)
    fp32 = KvBProj(W.Fp8BlockWeight.from_dense(_rand(256, 512, scale=0.05), torch.float32))
    assert "out dtype must be bf16 or fp16" in fp32.explain(64)
    inp = L.KvBProjInputs(_block_layer(), 64, torch.device("cpu"), None, torch.int32)
    assert any("activation dtype must be" in r for r in DISPATCH.get("scaled_mm_block").not_supported_reasons(inp))
    other = KvBProj(W.Fp8Weight.from_dense(_rand(256, 512), params_dtype=torch.bfloat16))
    assert "weight format is fp8, not fp8_block" in other.explain(64)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a CUDA device of a given capability is present, with the blockwise
    probe's verdict given (no kernel runs: only the choice is tested)."""
    def install(cap=(9, 0), probe_error=None, name="NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(L, "_DEVICE_NAMES", {})
        for dt in (torch.bfloat16, torch.float16):
            monkeypatch.setitem(S._PROBED, ("cuda", 0, dt), probe_error)
        monkeypatch.setenv("MLA_EXT_DISPATCH_TABLES", "off")  # the stated order
    return install


def test_stated_order_prefers_scaled_mm_block_on_sm90(fake_cuda):
    fake_cuda((9, 0))
    layer = _block_layer()
    assert layer.backend_for(4096, device="cuda") == "scaled_mm_block"
    assert "[*] scaled_mm_block" in layer.explain(1, device="cuda")


def test_sm89_and_a_failing_probe_fall_back_to_the_triton_kernel(fake_cuda):
    layer = _block_layer()
    fake_cuda((8, 9))
    text = layer.explain(4096, device="cuda")
    assert "needs sm_90 (cuBLASLt's 1x128 / 128x128 block scaling is Hopper-only), device is sm_89" in text
    if not triton_interpreter_reasons():
        assert layer.backend_for(4096, device="cuda") == "triton_fp8_block"
    fake_cuda((9, 0), probe_error="torch._scaled_mm of torch 0.0 on NVIDIA H200 does not take blockwise scales")
    assert "does not take blockwise scales" in layer.explain(4096, device="cuda")
    assert layer.backend_for(4096, device="cuda") != "scaled_mm_block"


# -- GPU ----------------------------------------------------------------------------

def _cuda_reasons(dt=torch.bfloat16):
    if not torch.cuda.is_available():
        return ["no CUDA device"]
    return S.blockwise_scaled_mm_reasons(torch.device("cuda"), dt)


@pytest.mark.cuda
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 512), (5, 300), (300, 512), (4096, 512)])
def test_cuda_quantizer_matches_reference(dt, m, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the kernel stores fp8 e4m3: sm_89+")
    x = (_rand(m, 576, seed=m) * 3).to(dt).cuda()[:, :k]
    q, s = gq.per_token_group_quant_fp8_mmajor(x, 4, 512)
    q_ref, s_ref = gq.per_token_group_quant_fp8_mmajor_ref(x, 4, 512)
    assert s.stride() == s_ref.stride() == (1, s.shape[0])
    assert torch.equal(s, s_ref)  # IEEE divisions on both sides: bit-exact
    ulps = _e4m3_ulps(q, q_ref)
    assert float(ulps.max()) <= 1.0 and float((ulps > 0).float().mean()) < 1e-3


@pytest.mark.cuda
def test_cuda_probe_verdict():
    """On sm_90 the probe either passes, or says this torch/cuBLAS build lacks blockwise
    scaling; a probe that runs but gives wrong numbers means the layout assumed here is
    not the one this build expects: a failure, never a skip."""
    cap = torch.cuda.get_device_capability()
    why = _cuda_reasons()
    if cap[0] != 9:
        assert any("needs sm_90" in r for r in why)
        return
    err = S.blockwise_scaled_mm_error("cuda")
    assert err is None or "wrong results" not in err, err
    if err is not None:
        pytest.skip(err)


@pytest.mark.cuda
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 64, 300, 4096])
@pytest.mark.parametrize("n,k", [(512, 512), (2048, 512), (256, 300)])
def test_cuda_scaled_mm_block_matches_dequantized_reference(dt, m, n, k):
    why = _cuda_reasons(dt)
    if why:
        pytest.skip("; ".join(why))
    layer = _block_layer(n, k, dt).to("cuda")
    x = _x(m, k, dt, row_stride=k + 64).cuda()
    out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    with DISPATCH.force("scaled_mm_block"):
        y = layer(x, out=out)
        y2 = layer(x)
    assert y is out and torch.isfinite(y).all()
    expect = _w8a8_expect(x.cpu(), layer.to("cpu"))
    assert rel_fro(y.cpu(), expect) <= FROB[dt]
    assert torch.equal(y, y2)
    dense = ref.linear_ref(x.cpu(), layer.weight_format.dequantize_fp32().cpu())
    assert rel_mean_abs(y.cpu(), dense) < 0.04  # SPEC §9 bound


@pytest.mark.cuda
def test_cuda_fp8_input_auto_choice_and_graph_capture():
    why = _cuda_reasons()
    if why:
        pytest.skip("; ".join(why))
    layer = _block_layer(1024, 512).to("cuda").prepare()
    x = _x(256, 512, torch.bfloat16, row_stride=576).cuda()
    xq = ref.quantize_e4m3(x.float() / 0.02)
    with DISPATCH.force("scaled_mm_block"):
        y8 = layer(xq, x_scale=torch.tensor([0.02], device="cuda"))
    expect = ref.linear_ref(ref.decode_e4m3(xq.cpu()) * 0.02, layer.weight_format.dequantize_fp32().cpu())
    assert rel_fro(y8.cpu(), expect) <= FROB[torch.bfloat16]
    # The automatic choice serves the call correctly, whichever backend it is.
    chosen = layer.backend_for(256)
    y = layer(x)
    tol_ref = _w8a8_expect(x.cpu(), layer.to("cpu")) if chosen != "dequant_dense" else \
        ref.linear_ref(x.cpu(), layer.weight_format.dequantize_fp32().cpu())
    assert rel_fro(y.cpu(), tol_ref) <= FROB[torch.bfloat16], layer.explain(256)
    # prepare() built the probe and the weight layout: a CUDA graph captures the call.
    out = torch.empty(256, 1024, dtype=torch.bfloat16, device="cuda")
    with DISPATCH.force("scaled_mm_block"):
        layer(x, out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer(x, out=out)
    ref_out = out.clone()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out)
