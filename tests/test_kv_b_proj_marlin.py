"""Marlin-packed FP8 (W8A16) kv_b_proj: packing, dequant, GEMM (CPU reference and CUDA).

The layout checks decode qweight in Python from the layout documented in
csrc/kv_b_proj/marlin_fp8.h, independently of the C++ index math, so a
self-consistent but wrongly documented packing would fail here.
"""
from __future__ import annotations

import pytest
import torch

from mla_ext import _ext
from mla_ext.kv_b_proj.marlin import (
    MarlinFp8Packed,
    marlin_fp8_dequantize,
    marlin_fp8_gemm,
    marlin_fp8_repack,
    marlin_not_supported_reasons,
)

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

ACT = [torch.bfloat16, torch.float16]
FOLD_LOG2 = {torch.float16: 8, torch.bfloat16: 120}
SHIFT = {torch.float16: 1, torch.bfloat16: 4}


def _rand_fp8(n, k, gen, amp=1.0):
    w = (torch.randn(n, k, generator=gen) * amp).clamp(-440, 440).to(torch.float8_e4m3fn)
    return w


def _rand_scales(shape, gen):
    return torch.rand(shape, generator=gen) * 0.02 + 1e-3


def _case(n, k, group_size, seed, amp=60.0):
    """A random fp8 weight [n, k] and its fp32 scales in the repack orientation."""
    gen = torch.Generator().manual_seed(seed)
    w = _rand_fp8(n, k, gen, amp=amp)
    return w, _rand_scales((n,) if group_size == -1 else (k // 128, n), gen), gen


def _ref_weight(w, scales, group_size):
    """fp32 dequantized reference [N, K] from torch's fp8 decode."""
    if group_size == -1:
        return w.float() * scales[:, None]
    return w.float() * scales.repeat_interleave(group_size, 0).t()


def _rel_err(out, ref):
    return ((out.float() - ref).abs().mean() / ref.abs().mean()).item()


def _python_unpack_bytes(qweight, n, k):
    """fp8 bytes [N, K] recovered from qweight using the documented layout only."""
    n_pad = (n + 63) // 64 * 64
    words = qweight.reshape(n_pad // 64, k // 16, 32, 8)  # [nt, kt, lane, j]
    lane = torch.arange(32).view(32, 1)
    j = torch.arange(8).view(1, 8)
    col = j * 8 + lane // 4  # [32, 8]
    k0 = (lane % 4) * 2
    out = torch.zeros(n_pad, k, dtype=torch.uint8)
    for b, dk in enumerate((0, 1, 8, 9)):
        byte = ((words >> (8 * b)) & 0xFF).to(torch.uint8)  # [nt, kt, 32, 8]
        for nt in range(n_pad // 64):
            for kt in range(k // 16):
                rows = nt * 64 + col
                cols = (kt * 16 + k0 + dk).expand(32, 8)
                out[rows, cols] = byte[nt, kt]
    return out[:n]


# ---------------------------------------------------------------------------
# Dequant bit trick and layout
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACT)
def test_bit_shift_decode_matches_torch_fp8_for_all_bytes(act):
    """The documented shift (sign -> bit 15, e|m -> shifted) times 2^fold is torch's e4m3 decode."""
    b = torch.tensor([x for x in range(256) if x & 0x7F != 0x7F], dtype=torch.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << (8 - SHIFT[act]))
    h = bits.to(torch.int16).view(act).float() * 2.0 ** FOLD_LOG2[act]
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(h, want)


@pytest.mark.parametrize("act", ACT)
def test_dequantize_all_256_bytes_exact(act):
    """Every non-NaN e4m3 byte (subnormals, ±0, ±448) round-trips exactly through the packing."""
    vals = [x for x in range(256) if x & 0x7F != 0x7F]  # 254 values
    k = 256
    flat = torch.tensor(vals * (2 * 64 * k // len(vals) + 1), dtype=torch.uint8)[: 64 * k]
    w = flat.view(64, k).view(torch.float8_e4m3fn)
    p = marlin_fp8_repack(w, torch.ones(64), act)
    assert torch.equal(marlin_fp8_dequantize(p, torch.float32), w.float())
    assert torch.equal(marlin_fp8_dequantize(p), w.float().to(act))


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("n", [64, 200])
def test_packed_layout_and_scales_match_documentation(act, group_size, n):
    k = 256
    w, s, _ = _case(n, k, group_size, seed=n + group_size, amp=40.0)
    p = marlin_fp8_repack(w, s, act, group_size)
    n_pad = (n + 63) // 64 * 64
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (n_pad // 64, 16 * k)
    assert (p.N, p.K, p.group_size, p.act_dtype) == (n, k, group_size, act)
    # Words: decode with the documented index math, in Python.
    assert torch.equal(_python_unpack_bytes(p.qweight, n, k), w.view(torch.uint8))
    # Scales: position t*16 + j*2 + e of each 64-block holds column j*8 + t*2 + e, times 2^fold.
    pos = torch.arange(64)
    col_of_pos = (pos % 16) // 2 * 8 + (pos // 16) * 2 + pos % 2
    cols = (torch.arange(n_pad // 64).view(-1, 1) * 64 + col_of_pos).flatten()
    s2 = s.view(1, n) if group_size == -1 else s
    want = torch.zeros(s2.shape[0], n_pad)
    valid = cols < n
    want[:, valid] = s2[:, cols[valid]] * 2.0 ** FOLD_LOG2[act]
    assert p.scales.dtype == torch.float32 and torch.equal(p.scales, want)


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
def test_dequantize_exact_with_scales(act, group_size):
    n, k = 200, 512
    w, s, _ = _case(n, k, group_size, seed=7, amp=50.0)
    p = marlin_fp8_repack(w, s, act, group_size)
    ref = _ref_weight(w, s, group_size)
    got = marlin_fp8_dequantize(p, torch.float32)
    assert got.shape == (n, k) and torch.equal(got, ref)
    assert torch.equal(marlin_fp8_dequantize(p), ref.to(act))


# ---------------------------------------------------------------------------
# GEMM on the CPU (the packed-layout reference kernel)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n", [256, 200])
@pytest.mark.parametrize("k", [512, 256])
@pytest.mark.parametrize("group_size", [-1, 128])
def test_gemm_cpu_matches_dequantized_reference(act, m, n, k, group_size):
    w, s, gen = _case(n, k, group_size, seed=m * 1000 + n + k + group_size)
    p = marlin_fp8_repack(w, s, act, group_size)
    a = torch.randn(m, k, generator=gen).to(act)
    ref = a.float() @ _ref_weight(w, s, group_size).t()
    out = marlin_fp8_gemm(a, p)
    assert out.dtype == act and out.shape == (m, n)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < 0.04  # SPEC §9 weight-only GEMM metric
    frob = ((out.float() - ref).norm() / ref.norm()).item()
    assert frob <= (1e-2 if act == torch.bfloat16 else 5e-3)
    # The fp32 output isolates the packing: only fp32 summation order differs.
    out32 = marlin_fp8_gemm(a, p, out_dtype=torch.float32)
    torch.testing.assert_close(out32, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
def test_gemm_cpu_row_strided_activation(act, group_size):
    """The workspace view: kv_c = workspace[:, :512] with row stride 576."""
    n, k, m = 200, 512, 37
    w, s, gen = _case(n, k, group_size, seed=11)
    p = marlin_fp8_repack(w, s, act, group_size)
    workspace = torch.randn(m, 576, generator=gen).to(act)
    a = workspace[:, :k]
    assert a.stride() == (576, 1)
    assert marlin_not_supported_reasons(a, p) == []
    out = marlin_fp8_gemm(a, p, out_dtype=torch.float32)
    ref = a.float() @ _ref_weight(w, s, group_size).t()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    torch.testing.assert_close(out, marlin_fp8_gemm(a.contiguous(), p, out_dtype=torch.float32))


def test_gemm_cpu_empty_m():
    w = _rand_fp8(64, 128, torch.Generator().manual_seed(1))
    p = marlin_fp8_repack(w, torch.ones(64), torch.bfloat16)
    out = marlin_fp8_gemm(torch.empty(0, 128, dtype=torch.bfloat16), p)
    assert out.shape == (0, 64)


# ---------------------------------------------------------------------------
# Errors are API
# ---------------------------------------------------------------------------


def _small():
    gen = torch.Generator().manual_seed(3)
    return _rand_fp8(64, 256, gen), _rand_scales((64,), gen)


@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
def test_repack_rejects_nan_weights(nan_byte):
    w, s = _small()
    raw = w.view(torch.uint8).clone()
    raw[5, 17] = nan_byte
    with pytest.raises(ValueError, match="w_fp8.*NaN"):
        marlin_fp8_repack(raw.view(torch.float8_e4m3fn), s, torch.bfloat16)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda w, s: (w.float(), s, torch.bfloat16, -1), "w_fp8"),
        (lambda w, s: (w, s.double(), torch.bfloat16, -1), "scales"),
        (lambda w, s: (w, s, torch.float32, -1), "act_dtype"),
        (lambda w, s: (w, s, torch.bfloat16, 64), "group_size"),
        (lambda w, s: (w[:, :200], s, torch.bfloat16, -1), "K"),
        (lambda w, s: (w[:, :144], torch.ones(1, 64), torch.bfloat16, 128), "K"),
        (lambda w, s: (w, s[:10], torch.bfloat16, -1), "scales"),
        (lambda w, s: (w, torch.ones(3, 64), torch.bfloat16, 128), "scales"),
        (lambda w, s: (w, torch.full((64,), 300.0), torch.bfloat16, -1), "scales.*overflows"),
        (lambda w, s: (w, torch.full((64,), float("inf")), torch.float16, -1), "scales.*finite"),
        (lambda w, s: (w[0], s, torch.bfloat16, -1), "w_fp8"),
    ],
)
def test_repack_bad_arguments_name_the_argument(mutate, match):
    w, s = _small()
    args = mutate(w, s)
    with pytest.raises(ValueError, match=match):
        marlin_fp8_repack(*args[:3], group_size=args[3])


def test_gemm_bad_arguments_name_the_argument():
    w, s = _small()
    p = marlin_fp8_repack(w, s, torch.bfloat16)
    a = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="a: expected dtype"):
        marlin_fp8_gemm(a.half(), p)
    with pytest.raises(ValueError, match="a: expected shape"):
        marlin_fp8_gemm(a[:, :128], p)
    with pytest.raises(ValueError, match="a: expected a contiguous last dim"):
        marlin_fp8_gemm(torch.randn(256, 4).to(torch.bfloat16).t(), p)
    with pytest.raises(ValueError, match="out_dtype"):
        marlin_fp8_gemm(a, p, out_dtype=torch.int32)
    bad = MarlinFp8Packed(p.qweight[:, :100], p.scales, p.N, p.K, p.group_size, p.act_dtype)
    with pytest.raises(ValueError, match="qweight"):
        marlin_fp8_gemm(a, bad)
    bad = MarlinFp8Packed(p.qweight, p.scales.half(), p.N, p.K, p.group_size, p.act_dtype)
    with pytest.raises(ValueError, match="scales"):
        marlin_fp8_dequantize(bad)


def test_not_supported_reasons():
    w, s = _small()
    p = marlin_fp8_repack(w, s, torch.float16)
    a = torch.randn(4, 256).to(torch.float16)
    assert marlin_not_supported_reasons(a, p) == []
    assert any("packed for" in r for r in marlin_not_supported_reasons(a.bfloat16(), p))
    assert any("[M, 256]" in r for r in marlin_not_supported_reasons(a[:, :64], p))


def test_fake_kernels_opcheck():
    gen = torch.Generator().manual_seed(5)
    w, s = _rand_fp8(200, 256, gen), _rand_scales((2, 200), gen)
    p = marlin_fp8_repack(w, s, torch.bfloat16, 128)
    a = torch.randn(9, 256, generator=gen).to(torch.bfloat16)
    ops = _ext.ops()
    torch.library.opcheck(ops.marlin_fp8_gemm, (a, p.qweight, p.scales, 200, 256, 128, torch.bfloat16, None))
    torch.library.opcheck(ops.marlin_fp8_dequantize, (p.qweight, p.scales, 200, 256, 128, torch.bfloat16))


# ---------------------------------------------------------------------------
# CUDA kernels (skipped without a GPU)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
def test_cuda_repack_and_dequantize_match_cpu(act, group_size):
    n, k = 200, 512
    w, s, _ = _case(n, k, group_size, seed=21)
    pc = marlin_fp8_repack(w, s, act, group_size)
    pg = marlin_fp8_repack(w.cuda(), s.cuda(), act, group_size)
    assert torch.equal(pg.qweight.cpu(), pc.qweight)
    assert torch.equal(pg.scales.cpu(), pc.scales)
    assert torch.equal(marlin_fp8_dequantize(pg, torch.float32).cpu(), _ref_weight(w, s, group_size))


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("n", [4096, 200])
@pytest.mark.parametrize("group_size", [-1, 128])
def test_cuda_gemm_matches_dequantized_reference(act, m, n, group_size):
    k = 512
    w, s, gen = _case(n, k, group_size, seed=m + n + group_size)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), act, group_size)
    workspace = torch.randn(m, 576, generator=gen).to(act).cuda()
    a = workspace[:, :k]  # row stride 576
    assert marlin_not_supported_reasons(a, p) == []
    ref = a.float().cpu() @ _ref_weight(w, s, group_size).t()
    out = marlin_fp8_gemm(a, p)
    assert out.dtype == act and out.shape == (m, n) and not out.isnan().any()
    assert _rel_err(out.cpu(), ref) < 0.04
    out32 = marlin_fp8_gemm(a, p, out_dtype=torch.float32).cpu()
    torch.testing.assert_close(out32, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


@pytest.mark.cuda
def test_cuda_gemm_graph_capturable():
    gen = torch.Generator().manual_seed(2)
    w, s = _rand_fp8(4096, 512, gen), _rand_scales((4096,), gen)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), torch.bfloat16)
    a = torch.randn(16, 512, generator=gen).to(torch.bfloat16).cuda()
    want = marlin_fp8_gemm(a, p)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = marlin_fp8_gemm(a, p)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("k", [16, 48, 1024])
def test_cuda_gemm_short_and_long_k(act, k):
    """K=16/48: some warps own no k-tile and the pipeline never fills; K=1024 wraps it often."""
    n, m = 136, 19
    w, s, gen = _case(n, k, -1, seed=k)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), act)
    a = torch.randn(m, k, generator=gen).to(act)
    want = marlin_fp8_gemm(a, marlin_fp8_repack(w, s, act), out_dtype=torch.float32)
    got = marlin_fp8_gemm(a.cuda(), p, out_dtype=torch.float32).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("k", [16, 48])
def test_gemm_cpu_short_k(k):
    w, s, gen = _case(72, k, -1, seed=k)
    p = marlin_fp8_repack(w, s, torch.bfloat16)
    a = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    ref = a.float() @ _ref_weight(w, s, -1).t()
    out = marlin_fp8_gemm(a, p, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("rms", [1e-4, 1e-5])
@pytest.mark.parametrize("group_size", [-1, 128])
def test_cuda_gemm_tiny_activations_keep_subnormal_products(act, rms, group_size):
    """The exponent-bias correction (x2^120 for bf16, x2^8 for fp16) is folded into
    the scales, so the tensor-core products are ~2^-120 times the true ones: at
    activation RMS 1e-4..1e-5 they are fp32 subnormals. If the tensor cores flush
    them, the output loses 5-100% (emulated); this checks the device keeps them."""
    n, k, m = 512, 512, 33
    w, s, gen = _case(n, k, group_size, seed=int(1 / rms) + group_size)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), act, group_size)
    a = (torch.randn(m, k, generator=gen) * rms).to(act)
    ref = a.float() @ _ref_weight(w, s, group_size).t()
    out = marlin_fp8_gemm(a.cuda(), p, out_dtype=torch.float32).cpu()
    assert torch.isfinite(out).all()
    err = _rel_err(out, ref)
    assert err < 0.04, f"RMS {rms} {act}: mean relative error {err:.3g} (subnormal products flushed?)"
