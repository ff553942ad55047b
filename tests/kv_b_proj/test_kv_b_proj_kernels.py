"""kv_b_proj Triton kernels called directly: ragged shapes (K not a multiple of the
tile), argument errors, the activation quantizer; CUDA-only checks marked."""
import pytest

pytest.importorskip("triton")  # a CPU-only torch install need not have triton
import torch

from mla_ext.kv_b_proj import quant
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.triton_fp8_block import fp8_block_linear, w8a8_block_fp8_matmul
from mla_ext.kv_b_proj.triton_w4a16 import nvfp4_w4a16_matmul
from helpers.numeric import rel_fro


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("m,n,k", [(5, 67, 200), (70, 129, 384)])
def test_fp8_block_ragged_k_and_n(m, n, k):
    f = W.Fp8BlockWeight.from_dense(_rand(n, k, scale=0.05), torch.bfloat16)
    x = _rand(m, k, seed=1).bfloat16()
    q, s = quant.per_token_group_quant_fp8(x)
    assert s.shape == (m, 2 if k == 200 else 3)
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    y = w8a8_block_fp8_matmul(q, s, f.weight, f.weight_scale_inv, torch.float16, out=out)
    expect = ref.linear_ref(ref.dequant_activation(q, s), f.dequantize_fp32())
    assert torch.isfinite(y).all() and rel_fro(y, expect) < 5e-3


@pytest.mark.parametrize("m,n,k", [(3, 33, 48), (65, 130, 272)])
def test_w4a16_ragged_k_and_n(m, n, k):
    f = W.Nvfp4Weight.from_dense(_rand(n, k, scale=0.05), torch.float16)
    x = _rand(m, k + 8, seed=2).half()[:, :k]
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    y = nvfp4_w4a16_matmul(x, f.weight, f.weight_scale, f.weight_scale_2, out=out)
    expect = ref.linear_ref(x, f.dequantize_fp32())
    assert torch.isfinite(y).all() and rel_fro(y, expect) < 5e-3


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_w4a16_decodes_every_code_and_scale_exactly(dt):
    """x = I reads the decoded weight back: all 16 e2m1 codes (both nibbles) times
    every finite e4m3 scale byte (subnormals, 448 included) come out exact (the
    products have at most 5 significant bits, exact in bf16 and fp16)."""
    k = 256
    codes = torch.arange(16).repeat(k // 16)                      # code of element k: k % 16 (both nibbles)
    sbytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F and b < 0x80], dtype=torch.uint8)  # 127
    n = len(sbytes)
    packed = ref.pack_nvfp4(codes.repeat(n, 1).to(torch.uint8))
    scale = sbytes[:, None].repeat(1, k // 16).view(torch.float8_e4m3fn)
    scale = torch.roll(scale.view(torch.uint8), shifts=1, dims=1).view(torch.float8_e4m3fn)  # vary along K too
    g = torch.ones(1)
    y = nvfp4_w4a16_matmul(torch.eye(k, dtype=dt), packed, scale, g)
    want = ref.dequant_nvfp4(packed, scale, g)                   # [n, k] fp32
    assert torch.equal(y.float(), want.t()), (y.float() - want.t()).abs().max()


def test_quant_reference_definition():
    x = _rand(4, 300, seed=3).bfloat16()
    q, s = quant.per_token_group_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3)
    groups = torch.nn.functional.pad(x.float(), (0, 84)).view(4, 3, 128)
    assert torch.equal(s, groups.abs().amax(-1) / 448.0)
    assert float(ref.decode_e4m3(q).abs().max()) == 448.0
    back = ref.dequant_activation(q, s)
    assert rel_fro(back, x.float()) < 0.04


def test_quant_triton_scales_match_reference_in_interpreter_or_gpu():
    # fp32 -> fp8 casts are wrong under the interpreter (toolchain notes), so on
    # the CPU only the scales are compared; the CUDA test compares everything.
    x = _rand(20, 260, seed=4).bfloat16()
    _, s = quant.per_token_group_quant_fp8(x, use_triton=True)
    _, s_ref = ref.per_token_group_quant_fp8_ref(x)
    assert torch.equal(s, s_ref)


def test_kernel_argument_errors():
    f = W.Fp8BlockWeight.from_dense(_rand(16, 128), torch.bfloat16)
    q, s = quant.per_token_group_quant_fp8(_rand(4, 128).bfloat16())
    with pytest.raises(ValueError, match="a_s must be fp32"):
        w8a8_block_fp8_matmul(q, s[:, :0], f.weight, f.weight_scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a8_block_fp8_matmul(q.float(), s, f.weight, f.weight_scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        w8a8_block_fp8_matmul(q, s, f.weight, f.weight_scale_inv, torch.bfloat16, out=torch.empty(4, 16))
    g = W.Nvfp4Weight.from_dense(_rand(16, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="x must be bf16 or fp16"):
        nvfp4_w4a16_matmul(_rand(4, 64), g.weight, g.weight_scale, g.weight_scale_2)
    with pytest.raises(ValueError, match="w_packed"):
        nvfp4_w4a16_matmul(_rand(4, 32).bfloat16(), g.weight, g.weight_scale, g.weight_scale_2)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_w4a16_matmul(_rand(4, 64).bfloat16(), g.weight, g.weight_scale, g.weight_scale_2.double())
    with pytest.raises(ValueError, match="unit stride"):
        quant.per_token_group_quant_fp8(_rand(128, 4).bfloat16().t())


# -- GPU ----------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_quant_triton_matches_torch_bitwise():
    x = (_rand(300, 576, seed=5) * 3).bfloat16().cuda()[:, :512]
    q, s = quant.per_token_group_quant_fp8(x)
    q_ref, s_ref = ref.per_token_group_quant_fp8_ref(x)
    assert torch.equal(s, s_ref)
    assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 1e-3  # x/scale rounding ties


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 300, 4096])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_cuda_triton_kernels_match_reference(m, dt):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tl.dot needs sm_89+")
    n, k = 4099, 512
    w = _rand(n, k, scale=0.05)
    x = _rand(m, k + 64, seed=6).to(dt).cuda()[:, :k]
    fb = W.Fp8BlockWeight.from_dense(w, dt).to("cuda")
    y = fp8_block_linear(x, fb.weight, fb.weight_scale_inv, dt)
    q, s = ref.per_token_group_quant_fp8_ref(x)
    expect = ref.linear_ref(ref.dequant_activation(q, s), fb.dequantize_fp32())
    assert rel_fro(y, expect) < (1e-2 if dt == torch.bfloat16 else 5e-3)
    f4 = W.Nvfp4Weight.from_dense(w, dt).to("cuda")
    y4 = nvfp4_w4a16_matmul(x, f4.weight, f4.weight_scale, f4.weight_scale_2)
    assert rel_fro(y4, ref.linear_ref(x, f4.dequantize_fp32())) < (1e-2 if dt == torch.bfloat16 else 5e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 17, 33, 64, 65, 300])  # every launch config
@pytest.mark.parametrize("n", [4099, 32768])  # 32- and 64-column tiles at M <= 16 on a 132-SM GPU
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_cuda_w4a16_matches_reference(m, n, dt):
    k = 512
    f4 = W.Nvfp4Weight.from_dense(_rand(n, k, scale=0.05), dt).to("cuda")
    x = _rand(m, k + 64, seed=8).to(dt).cuda()[:, :k]
    out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    y = nvfp4_w4a16_matmul(x, f4.weight, f4.weight_scale, f4.weight_scale_2, out=out)
    expect = ref.linear_ref(x, f4.dequantize_fp32())
    assert torch.isfinite(y).all() and rel_fro(y, expect) < (1e-2 if dt == torch.bfloat16 else 5e-3)


@pytest.mark.cuda
def test_cuda_w4a16_decodes_every_code_and_scale_exactly():
    k = 256
    codes = torch.arange(16).repeat(k // 16)
    sbytes = torch.tensor([b for b in range(128) if b != 0x7F], dtype=torch.uint8)
    packed = ref.pack_nvfp4(codes.repeat(len(sbytes), 1).to(torch.uint8))
    scale = sbytes[:, None].repeat(1, k // 16).view(torch.float8_e4m3fn)
    g = torch.ones(1)
    want = ref.dequant_nvfp4(packed, scale, g)
    y = nvfp4_w4a16_matmul(torch.eye(k, dtype=torch.bfloat16, device="cuda"), packed.cuda(), scale.cuda(),
                           g.cuda())
    assert torch.equal(y.float().cpu(), want.t())


@pytest.mark.cuda
def test_cuda_layer_forward_is_graph_capturable():
    from mla_ext.kv_b_proj import KvBProj

    x = _rand(64, 512, seed=7).bfloat16().cuda()
    for recipe in ("nvfp4", "fp8_block", "marlin_fp8", "int4_group"):
        layer = KvBProj(W.quantize(recipe, _rand(256, 512, scale=0.05), torch.bfloat16).to("cuda"))
        y0 = layer(x)  # warm-up (compiles, builds caches)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = layer(x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y0), recipe
