"""kv_b_proj weight formats: decoders, from_dense quantizers, checkpoint validation."""
import pytest
import torch

from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from helpers.numeric import rel_fro


@pytest.fixture
def w():
    torch.manual_seed(1)
    return torch.randn(131, 256) * 0.05  # odd N, two fp8 blocks along K


def test_e4m3_decoder_matches_torch_on_all_256_codes():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = ref.decode_e4m3(bits)
    theirs = bits.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(theirs)
    assert torch.equal(torch.isnan(ours), nan) and int(nan.sum()) == 2
    assert torch.equal(ours[~nan], theirs[~nan])


def test_e2m1_decoder_and_encoder_round_trip_all_16_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = ref.decode_e2m1(codes)
    assert vals[:8].tolist() == list(ref.E2M1_VALUES)
    assert torch.equal(vals[8:], -vals[:8])
    back = ref.encode_e2m1(vals)
    # -0 encodes as +0; every other code round-trips.
    assert torch.equal(back[torch.arange(16) != 8], codes[torch.arange(16) != 8])


def test_nvfp4_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = ref.pack_nvfp4(codes)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(ref.unpack_nvfp4(packed), codes)


def _bound(name):
    # Relative Frobenius error of quantize -> dequantize on Gaussian weights.
    return {"dense": 5e-3, "nvfp4": 0.12, "int4_group": 0.15}.get(name, 0.04)


def _make(name, w, dt):
    return W.quantize(name, w, dt)


NAMES = sorted(W.RECIPES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_from_dense_dequantize_is_close(w, name, dt):
    f = _make(name, w, dt)
    assert (f.N, f.K) == tuple(w.shape) and f.params_dtype == dt
    d = f.dequantize()
    assert d.dtype == dt and d.shape == w.shape
    d32 = f.dequantize(torch.float32)
    assert torch.isfinite(d32).all()
    err = rel_fro(d32, w)
    assert err < _bound(name), err


def test_fp8_block_from_checkpoint_matches_reference_decode(w):
    f = W.Fp8BlockWeight.from_dense(w, torch.bfloat16)
    g = W.Fp8BlockWeight.from_checkpoint(f.weight, f.weight_scale_inv, torch.bfloat16)
    expect = ref.decode_e4m3(f.weight) * ref.expand_block_scales(f.weight_scale_inv, 131, 256)
    assert torch.equal(g.dequantize_fp32(), expect)


def test_nvfp4_dequantize_matches_manual_decode():
    torch.manual_seed(2)
    n, k = 3, 32
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.int32).to(torch.uint8)
    scale = (torch.rand(n, k // 16) + 0.5).to(torch.float8_e4m3fn)
    g = torch.tensor([0.25])
    f = W.Nvfp4Weight.from_checkpoint(packed, scale, g, torch.bfloat16)
    d = f.dequantize_fp32()
    for i in range(n):
        for j in range(k):
            byte = int(packed[i, j // 2])
            code = (byte >> 4) if j % 2 else (byte & 0xF)
            mag = ref.E2M1_VALUES[code & 7] * (-1 if code & 8 else 1)
            assert d[i, j] == mag * float(scale[i, j // 16].float()) * 0.25


def test_int4_group_checkpoint_layout():
    # One word holds k = 0..7 of column n, lowest nibble first; zero point 8.
    q = torch.tensor([[0x76543210 | 0], [0x0FEDCBA9 - 0x10000000 + 0x10000000]], dtype=torch.int64)
    qweight = torch.where(q >= 2**31, q - 2**32, q).to(torch.int32).view(2, 1)
    scales = torch.tensor([[0.5]], dtype=torch.float16)
    f = W.Int4GroupWeight.from_checkpoint(qweight, scales, 16, torch.float16)
    expect = (torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]).float() - 8) * 0.5
    assert torch.equal(f.dequantize_fp32()[0], expect)
    zeros = torch.tensor([[3]], dtype=torch.int32)
    f2 = W.Int4GroupWeight.from_checkpoint(qweight, scales, 16, torch.float16, zeros=zeros)
    assert torch.equal(f2.dequantize_fp32()[0], expect + 2.5)


@pytest.mark.parametrize("make,match", [
    (lambda: W.DenseWeight(torch.zeros(4, 4, dtype=torch.int32)), "weight dtype"),
    (lambda: W.Fp8Weight(torch.zeros(4, 4), torch.ones(1), torch.bfloat16), "float8_e4m3fn"),
    (lambda: W.Fp8Weight(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(3), torch.bfloat16), "weight_scale"),
    (lambda: W.Fp8Weight(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.tensor([float("inf")]), torch.bfloat16),
     "finite"),
    (lambda: W.Fp8Weight(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(1), torch.int32), "params_dtype"),
    (lambda: W.Fp8BlockWeight(torch.zeros(130, 4).to(torch.float8_e4m3fn), torch.ones(1, 1), torch.bfloat16),
     r"weight_scale_inv must have shape \(2, 1\)"),
    (lambda: W.Fp8BlockWeight(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1), torch.bfloat16,
                              (64, 64)), "block_size"),
    (lambda: W.Nvfp4Weight(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 0).to(torch.float8_e4m3fn),
                           torch.ones(1), torch.bfloat16), "multiple of 16"),
    (lambda: W.Nvfp4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1).to(torch.float8_e4m3fn),
                           torch.zeros(1), torch.bfloat16), "weight_scale_2"),
    (lambda: W.Nvfp4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), torch.ones(1),
                           torch.bfloat16), "weight_scale dtype"),
    (lambda: W.Int4GroupWeight(torch.zeros(2, 4, dtype=torch.int32), torch.ones(1, 4), 12, torch.float16),
     "group_size"),
    (lambda: W.Int4GroupWeight(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 4), 16, torch.float16),
     "scales must have shape"),
])
def test_bad_checkpoint_tensors_raise_value_error_naming_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()
