"""csrc/common/fp8.h is bit-exact with torch's conversions (through the cache ops).

Decode: all 256 bytes of e4m3 and e5m2 gathered with k_scale = 1 into fp32.
Encode: random floats across the whole range, every exact midpoint between
neighbouring fp8 values (round-half-even ties), subnormals, saturation and
signed zeros, written with k_scale = 1 from fp32. fp32 -> bf16/fp16 rounding:
all 256 bytes times awkward scales (overflow to inf, fp16 subnormals).
"""
from __future__ import annotations

import pytest
import torch

from mla_ext import _ext
from mla_ext.cache import api
from helpers.numeric import assert_same_bits

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MAXES = {"fp8": 448.0, "fp8_e5m2": 57344.0}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _all_bytes_cache(device):
    return torch.arange(256, dtype=torch.uint8).reshape(1, 1, 256).to(device)


def _gather_all_bytes(fmt, dtype, scale, device):
    cache = _all_bytes_cache(device)
    dst = torch.full((1, 256), float("nan"), dtype=dtype, device=device)
    api.gather_and_maybe_dequant_cache(
        cache, dst, torch.zeros(1, 1, dtype=torch.int32, device=device),
        torch.tensor([0, 1], dtype=torch.int32, device=device), 1, fmt,
        torch.tensor([scale], dtype=torch.float32, device=device),
    )
    return dst[0].cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_decode_all_bytes(device, fmt):
    got = _gather_all_bytes(fmt, torch.float32, 1.0, device)
    want = torch.arange(256, dtype=torch.uint8).view(FP8[fmt]).float()
    assert_same_bits(got, want, "decoded bytes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.0123457, 3.14159, 1e-5, 300.0])
def test_dequant_rounding_to_16_bit(device, fmt, dtype, scale):
    got = _gather_all_bytes(fmt, dtype, scale, device)
    want = (torch.arange(256, dtype=torch.uint8).view(FP8[fmt]).float() * torch.tensor(scale)).to(dtype)
    assert_same_bits(got, want, "dequantized bytes")


def _encode_inputs(fmt):
    gen = torch.Generator().manual_seed(0)
    m = MAXES[fmt]
    vals = torch.arange(256, dtype=torch.uint8).view(FP8[fmt]).float()
    pos = vals[torch.isfinite(vals) & (vals >= 0)].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties in fp32
    rnd = torch.cat([
        torch.randn(4096, generator=gen) * m / 4,
        torch.exp(torch.empty(4096).uniform_(-30, 12, generator=gen)),  # wide magnitude range
        torch.empty(1024).uniform_(-2 * m, 2 * m, generator=gen),  # saturation
    ])
    special = torch.tensor([0.0, -0.0, m, -m, m * 1.03, 1e30, -1e30, float("inf"), -float("inf"), 1e-45])
    x = torch.cat([mids, -mids, pos, rnd, -rnd, special])
    n = (x.numel() + 63) // 64 * 64
    return torch.cat([x, torch.zeros(n - x.numel())]).reshape(-1, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_encode_matches_torch(device, fmt):
    x = _encode_inputs(fmt)
    T = x.shape[0]
    cache = torch.zeros(T, 1, 64, dtype=torch.uint8, device=device)
    api.concat_and_cache_mla(x.to(device), torch.zeros(T, 0, device=device), cache,
                             torch.arange(T, device=device), fmt, torch.ones(1, device=device))
    want = x.clamp(-MAXES[fmt], MAXES[fmt]).to(FP8[fmt]).view(torch.uint8)
    got = cache[:, 0].cpu()
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} mismatches, first x={x[tuple(bad[0])]}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"
