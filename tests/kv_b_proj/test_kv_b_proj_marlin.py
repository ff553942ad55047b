"""Marlin packed FP8 (W8A16) kv_b_proj in vLLM's post-load layout: packing,
dequant, GEMM (CPU reference and CUDA), and vLLM's tensors used without a copy.

The layout checks compare the repack with `vllm_marlin_encode` below, an
encoder written here from the facts of vLLM's Marlin fp8 post-load layout
(shared/reference/vllm-compat.md; the scale permutation of vLLM's
`marlin_permute_scales`), independently of the C++ index math, so a
self-consistent but wrong packing would fail here.
"""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from mla_ext import _ext
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.marlin import (
    MarlinFp8Packed,
    grouped_scales,
    marlin_fp8_dequantize,
    marlin_fp8_from_vllm,
    marlin_fp8_gemm,
    marlin_fp8_repack,
    marlin_not_supported_reasons,
    scale_position,
    word_location,
)
from helpers.numeric import rel_fro, rel_mean_abs

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

ACT = [torch.bfloat16, torch.float16]
FOLD_LOG2 = {torch.float16: 8, torch.bfloat16: 120}
SHIFT = {torch.float16: 1, torch.bfloat16: 4}
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _rand_fp8(n, k, gen, amp=1.0):
    w = (torch.randn(n, k, generator=gen) * amp).clamp(-440, 440).to(torch.float8_e4m3fn)
    return w


def _rand_scales(shape, gen):
    return torch.rand(shape, generator=gen) * 0.02 + 1e-3


def _case(n, k, group_size, seed, amp=60.0):
    """A random fp8 weight [n, k] and its fp32 scales in the repack orientation."""
    gen = torch.Generator().manual_seed(seed)
    w = _rand_fp8(n, k, gen, amp=amp)
    assert bool((w.float() != 0).any())
    return w, _rand_scales((n,) if group_size == -1 else (k // 128, n), gen), gen


def _applied_scales(scales, act):
    """The fp32 scales the packed weight applies: scale * 2^fold rounded to `act`, / 2^fold (exact)."""
    return (scales.float() * 2.0 ** FOLD_LOG2[act]).to(act).float() / 2.0 ** FOLD_LOG2[act]


def _ref_weight(w, scales, group_size, act=None):
    """fp32 dequantized reference [N, K] from torch's fp8 decode; with `act`, the
    scales are the ones the packed weight holds (rounded to the activation dtype)."""
    if act is not None:
        scales = _applied_scales(scales, act)
    if group_size == -1:
        return w.float() * scales.reshape(-1)[:, None]
    return w.float() * scales.repeat_interleave(group_size, 0).t()


# ---------------------------------------------------------------------------
# An independent encoder of vLLM's post-load Marlin fp8 layout
# ---------------------------------------------------------------------------


def vllm_marlin_encode(w_fp8, scales, group_size, act):
    """(qweight, scales) as vLLM leaves them in a Marlin fp8 layer after
    process_weights_after_loading, for an fp8 weight [N, K] and fp32 scales
    ([N], or [K/g, N] for group size g). From the layout facts:

    - qweight int32 [K/16, 4N]: 16 (k) x 64 (n) tiles, k-tiles outermost (row kt
      holds the tiles of every 64-column block in order); inside a tile, word
      lane*8 + j carries column 8j + lane//4 at k0 = 2*(lane % 4), its bytes
      (least significant first) being k0, k0+8, k0+1, k0+9.
    - scales: rounded to the activation dtype, permuted -- per-channel (and
      group size >= K): in each 32-column block, position 8i + x takes column
      2i + (0, 1, 8, 9, 16, 17, 24, 25)[x]; grouped: in each 64-column block,
      position 8i + x takes column i + 8x -- then multiplied by 2^120 (bf16) or
      2^8 (fp16) in the activation dtype.
    N not a multiple of 64 (which vLLM's Marlin refuses) is padded with zero
    columns, as mla_ext's repack does.
    """
    n, k = w_fp8.shape
    n_pad = -(-n // 64) * 64
    wb = torch.zeros(n_pad, k, dtype=torch.uint8)
    wb[:n] = w_fp8.view(torch.uint8)
    kt = torch.arange(k // 16).view(-1, 1, 1, 1, 1)
    nt = torch.arange(n_pad // 64).view(1, -1, 1, 1, 1)
    lane = torch.arange(32).view(1, 1, -1, 1, 1)
    j = torch.arange(8).view(1, 1, 1, -1, 1)
    dk = torch.tensor([0, 8, 1, 9]).view(1, 1, 1, 1, -1)
    byte = wb[nt * 64 + j * 8 + lane // 4, kt * 16 + 2 * (lane % 4) + dk].to(torch.int64)
    words = (byte << torch.tensor([0, 8, 16, 24])).sum(-1)  # [K/16, N_pad/64, 32, 8]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    qweight = words.reshape(k // 16, 4 * n_pad)

    s = torch.zeros(scales.reshape(-1, n).shape[0], n_pad)
    s[:, :n] = scales.reshape(-1, n).float()
    s = s.to(act)
    if 0 < group_size < k:
        perm = torch.tensor([i + 8 * x for i in range(8) for x in range(8)])
    else:
        perm = torch.tensor([2 * i + off for i in range(4) for off in (0, 1, 8, 9, 16, 17, 24, 25)])
    s = s.reshape(-1, perm.numel())[:, perm].reshape(-1, n_pad)
    s = s * torch.tensor(2.0 ** FOLD_LOG2[act], dtype=act)
    return qweight, s.contiguous()


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


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
@pytest.mark.parametrize("group_size, k", [(-1, 256), (128, 256), (128, 512), (128, 128), (-1, 48)])
@pytest.mark.parametrize("n", [64, 256, 200])
def test_repack_equals_the_vllm_encoder_bytes(act, group_size, k, n):
    """The repack writes vLLM's post-load bytes exactly (N=200: padded to 256 with zeros;
    group 128 with K=128 is one group and takes the per-channel permutation, as in vLLM)."""
    w, s, _ = _case(n, k, group_size, seed=n + k + group_size, amp=40.0)
    p = marlin_fp8_repack(w, s, act, group_size)
    q_want, s_want = vllm_marlin_encode(w, s, group_size, act)
    n_pad = -(-n // 64) * 64
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (k // 16, 4 * n_pad)
    assert (p.N, p.K, p.group_size, p.act_dtype) == (n, k, group_size, act)
    assert torch.equal(p.qweight, q_want)
    assert p.scales.dtype == act and p.scales.shape == s_want.shape
    assert torch.equal(_bits(p.scales), _bits(s_want))


def test_layout_helpers_agree_with_the_repack():
    """marlin.py's word_location / scale_position (the Python mirror of marlin_fp8.h)
    locate every byte and scale the repack wrote."""
    n, k = 130, 256
    gen = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 0x7F, (n, k), generator=gen, dtype=torch.uint8)  # no NaN
    w = raw.view(torch.float8_e4m3fn)
    q = marlin_fp8_repack(w, torch.ones(n), torch.bfloat16).qweight
    qb = q.view(torch.uint8).view(q.shape[0], q.shape[1], 4)
    got = torch.empty_like(raw)
    for nn in range(n):
        for kk in range(k):
            r, c, b = word_location(nn, kk)
            got[nn, kk] = qb[r, c, b]
    assert torch.equal(got, raw)
    for group_size, kk in ((-1, 256), (128, 256), (128, 128)):
        s = torch.arange(1, 1 + n * (kk // 128 if group_size > 0 else 1), dtype=torch.float32)
        s = s.view(-1, n) / 1024 if group_size > 0 else s / 1024
        p = marlin_fp8_repack(w[:, :kk], s, torch.float16, group_size)
        grouped = grouped_scales(kk, group_size)
        assert grouped == (group_size == 128 and kk > 128)
        sf = p.scales.float() / 2.0 ** 8
        for c in range(n):
            pos = c // 64 * 64 + scale_position(c % 64, grouped)
            assert torch.equal(sf[:, pos], s.view(-1, n)[:, c]), (group_size, kk, c)


def _layout_block(text, prefix):
    block = text.split("LAYOUT BEGIN", 1)[1].split("LAYOUT END", 1)[0]
    lines = [re.sub(rf"^\s*{re.escape(prefix)}", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


def test_layout_text_is_the_same_in_the_header_and_in_python():
    header = _layout_block((ROOT / "csrc/kv_b_proj/marlin_fp8.h").read_text(), "//")
    python = _layout_block((ROOT / "mla_ext/kv_b_proj/marlin.py").read_text(), "")
    assert len(header) > 10 and header == python


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
def test_dequantize_exact_with_scales(act, group_size):
    n, k = 200, 512
    w, s, _ = _case(n, k, group_size, seed=7, amp=50.0)
    p = marlin_fp8_repack(w, s, act, group_size)
    ref = _ref_weight(w, s, group_size, act)
    got = marlin_fp8_dequantize(p, torch.float32)
    assert got.shape == (n, k) and torch.equal(got, ref)
    assert torch.equal(marlin_fp8_dequantize(p), ref.to(act))


# ---------------------------------------------------------------------------
# vLLM's tensors, used as they are
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("m", [1, 37])
def test_from_vllm_shares_storage_and_the_cpu_gemm_matches_dense(act, group_size, m):
    n, k = 256, 512
    w, s, gen = _case(n, k, group_size, seed=31 + m + group_size)
    qweight, scales = vllm_marlin_encode(w, s, group_size, act)
    fmt = W.MarlinFp8Weight.from_vllm(qweight, scales, n, k, group_size, act)
    # No copy: the weight object reads vLLM's tensors.
    assert fmt.weight.data_ptr() == qweight.data_ptr() and fmt.packed.scales.data_ptr() == scales.data_ptr()
    assert (fmt.N, fmt.K, fmt.params_dtype) == (n, k, act)
    a = torch.randn(m, k, generator=gen).to(act)
    dense = a.float() @ _ref_weight(w, s, group_size).t()  # the checkpoint's own scales
    out = marlin_fp8_gemm(a, fmt.packed)
    assert out.dtype == act and out.shape == (m, n)
    assert rel_mean_abs(out, dense) < 0.04  # SPEC §9
    out32 = marlin_fp8_gemm(a, fmt.packed, out_dtype=torch.float32)
    ref = a.float() @ _ref_weight(w, s, group_size, act).t()  # the scales vLLM stored
    torch.testing.assert_close(out32, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert rel_mean_abs(out32, dense) < 5e-3
    assert torch.equal(marlin_fp8_dequantize(fmt.packed, torch.float32), _ref_weight(w, s, group_size, act))


def test_from_vllm_per_channel_scales_may_be_1d_and_stay_a_view():
    n, k = 128, 256
    w, s, _ = _case(n, k, -1, seed=2)
    qweight, scales = vllm_marlin_encode(w, s, -1, torch.bfloat16)
    flat = scales.reshape(-1)
    p = marlin_fp8_from_vllm(qweight, flat, n, k, -1, torch.bfloat16)
    assert p.scales.shape == (1, n) and p.scales.data_ptr() == flat.data_ptr()


def _vllm_small(group_size=-1, act=torch.bfloat16):
    w, s, _ = _case(128, 256, group_size, seed=9)
    return vllm_marlin_encode(w, s, group_size, act)


@pytest.mark.parametrize("mutate, match", [
    (lambda q, s: (q, s, 200, 256, -1, torch.bfloat16), r"qweight: expected shape \[K_pad/16, 4\*N_pad\] .*N_pad >= 256"),
    (lambda q, s: (q, s, 128, 200, -1, torch.bfloat16), r"size_k: expected a positive multiple of 16"),
    (lambda q, s: (q, s, 128, 256, 64, torch.bfloat16), r"group_size: expected -1 .* or 128"),
    (lambda q, s: (q, s, 128, 256, -1, torch.float32), r"act_dtype"),
    (lambda q, s: (q.view(-1, 256), s, 128, 256, -1, torch.bfloat16), r"qweight: expected shape \[K_pad/16"),
    (lambda q, s: (q.float(), s, 128, 256, -1, torch.bfloat16), r"qweight: expected torch.int32"),
    (lambda q, s: (q.t().contiguous().t(), s, 128, 256, -1, torch.bfloat16), r"qweight: expected a contiguous"),
    (lambda q, s: (q, s.float(), 128, 256, -1, torch.bfloat16), r"scales: expected torch.bfloat16"),
    (lambda q, s: (q, s, 128, 256, -1, torch.float16), r"scales: expected torch.float16"),
    (lambda q, s: (q, s[:, :64], 128, 256, -1, torch.bfloat16), r"scales: expected shape \[G, N_pad\]"),
    (lambda q, s: (q, s, 128, 256, 128, torch.bfloat16), r"scales: expected shape \[G, N_pad\] with G >= 2"),
    (lambda q, s: (q, torch.full_like(s, float("inf")), 128, 256, -1, torch.bfloat16), r"scales: expected finite"),
], ids=["n_past_qweight", "k_not_16", "group_64", "act_fp32", "q_shape", "q_dtype", "q_strided", "s_fp32",
        "s_dtype_mismatch", "s_shape", "s_groups", "s_inf"])
def test_from_vllm_bad_arguments_name_the_argument(mutate, match):
    q, s = _vllm_small()
    with pytest.raises(ValueError, match=match):
        marlin_fp8_from_vllm(*mutate(q, s))


def _vllm_padded_nk(n, k, group_size):
    """vLLM 0.33's Marlin thread-tile padding (marlin_utils.marlin_padded_nk, from
    its documented rule): the cheaper of (N to 64, K to lcm(128, g)) and (N to 128,
    K to lcm(64, g)) by padded area, then by padded sum."""
    import math

    def up(x, m):
        return -(-x // m) * m

    g = group_size if group_size > 0 else 1
    cands = ((up(n, 64), up(k, math.lcm(128, g))), (up(n, 128), up(k, math.lcm(64, g))))
    return min(cands, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def vllm_padded_encode(w, s, group_size, act, pad=None):
    """What vLLM 0.33 leaves after prepare_fp8_layer_for_marlin for a shape Marlin
    must pad: the weight zero-padded to (N_pad, K_pad), scales padded, then packed."""
    n, k = w.shape
    np_, kp = pad or _vllm_padded_nk(n, k, group_size)
    wp = torch.zeros(np_, kp, dtype=torch.uint8).view(torch.float8_e4m3fn)
    wp[:n, :k] = w
    if group_size == -1:
        sp = torch.ones(np_)
        sp[:n] = s
    else:
        sp = torch.ones(kp // 128, np_)
        sp[: k // 128, :n] = s
    return vllm_marlin_encode(wp, sp, group_size, act)


@pytest.mark.parametrize("n,k,group_size,pad", [
    (200, 512, -1, None),      # DeepSeek-size K, N=200 -> 256 (the case)
    (200, 512, 128, None),     # block fp8: group 128
    (200, 400, -1, None),      # K padded too: 400 -> 448
    (576, 64, -1, None),       # N padded past its 64-tile (576 -> 640): one copy
    (130, 256, 128, (256, 256)),  # N to 128 (192 would do): cut to 192 with one copy
])
def test_from_vllm_takes_padded_layers_with_the_true_sizes(n, k, group_size, pad):
    w, s, _ = _case(n, k, group_size, seed=n + k)
    act = torch.bfloat16
    q_pad, s_pad = vllm_padded_encode(w, s, group_size, act, pad)
    assert q_pad.shape[1] // 4 > n or q_pad.shape[0] * 16 > k  # really padded
    got = marlin_fp8_from_vllm(q_pad, s_pad, n, k, group_size, act)
    assert (got.N, got.K) == (n, k)
    if q_pad.shape[1] // 4 == -(-n // 64) * 64:  # no N copy: a view of vLLM's own tensor
        assert got.qweight.data_ptr() == q_pad.data_ptr()
    want = marlin_fp8_dequantize(marlin_fp8_repack(w, s, act, group_size=group_size))
    assert torch.equal(marlin_fp8_dequantize(got), want)


def test_from_vllm_refuses_padding_vllm_would_not_make():
    """A qweight wider or longer than vLLM's Marlin padding of the stated sizes
    means the sizes are not the weight's: refused, not silently cut."""
    w, s, _ = _case(256, 512, -1, seed=5)
    q, sc = vllm_marlin_encode(w, s, -1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"do the stated sizes belong to this weight"):
        marlin_fp8_from_vllm(q, sc, 128, 512, -1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"do the stated sizes belong to this weight"):
        marlin_fp8_from_vllm(q, sc, 256, 256, -1, torch.bfloat16)


def test_from_vllm_params_dtype_must_be_16_bit():
    q, s = _vllm_small()
    with pytest.raises(ValueError, match=r"params_dtype: expected torch.bfloat16 or torch.float16"):
        W.MarlinFp8Weight.from_vllm(q, s, 128, 256, -1, torch.float32)


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
    ref = a.float() @ _ref_weight(w, s, group_size).t()  # the fp32 checkpoint scales
    out = marlin_fp8_gemm(a, p)
    assert out.dtype == act and out.shape == (m, n)
    assert not out.isnan().any()
    assert rel_mean_abs(out, ref) < 0.04  # SPEC §9 weight-only GEMM metric
    frob = rel_fro(out, ref)
    assert frob <= (1e-2 if act == torch.bfloat16 else 5e-3)
    # The fp32 output against the scales the packing holds (rounded to `act`)
    # isolates the packing: only fp32 summation order differs.
    out32 = marlin_fp8_gemm(a, p, out_dtype=torch.float32)
    ref_held = a.float() @ _ref_weight(w, s, group_size, act).t()
    torch.testing.assert_close(out32, ref_held, rtol=1e-4, atol=1e-4 * ref_held.abs().max().item())


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
    ref = a.float() @ _ref_weight(w, s, group_size, act).t()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    torch.testing.assert_close(out, marlin_fp8_gemm(a.contiguous(), p, out_dtype=torch.float32))


@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("split_k", [1, 2, 3, 5, 16])
def test_gemm_cpu_split_k_slices_match_dense(act, group_size, split_k):
    """The CPU reference reproduces the CUDA kernel's split-K order (per-slice group
    partials, slices added in order): any split is the same GEMM."""
    n, k, m = 200, 512, 9
    w, s, gen = _case(n, k, group_size, seed=split_k * 10 + group_size)
    p = marlin_fp8_repack(w, s, act, group_size)
    a = torch.randn(m, k, generator=gen).to(act)
    ref = a.float() @ _ref_weight(w, s, group_size, act).t()
    out = marlin_fp8_gemm(a, p, out_dtype=torch.float32, split_k=split_k)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    one = marlin_fp8_gemm(a, p, out_dtype=torch.float32, split_k=1)
    assert torch.equal(one, marlin_fp8_gemm(a, p, out_dtype=torch.float32, split_k=0))  # 0: one slice on the CPU


@pytest.mark.parametrize("kw, match, raw_match", [
    (dict(split_k=-1), r"split_k: expected an int from 0", r"split_k: expected 0 \(automatic\) to 64"),
    (dict(split_k=65), r"split_k: expected an int from 0", r"split_k: expected 0 \(automatic\) to 64"),
    (dict(split_k=2.0), r"split_k: expected an int from 0", None),
])
def test_gemm_split_k_is_checked(kw, match, raw_match):
    w, s = _small()
    p = marlin_fp8_repack(w, s, torch.bfloat16)
    a = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        marlin_fp8_gemm(a, p, **kw)
    if raw_match is not None:  # the op checks them too
        with pytest.raises(ValueError, match=raw_match):
            _ext.ops().marlin_fp8_gemm(a, p.qweight, p.scales, p.N, p.K, p.group_size, p.act_dtype, None,
                                       kw.get("split_k", 0))


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
        (lambda w, s: (w, torch.full((64,), 256.0), torch.float16, -1), "scales.*torch.float16.*overflows"),
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
    with pytest.raises(ValueError, match="scales: expected torch.bfloat16"):
        marlin_fp8_dequantize(bad)
    # The old mla_ext layout's shape ([N_pad/64, 16K]) is refused by name.
    bad = MarlinFp8Packed(p.qweight.reshape(1, 16 * 256), p.scales, p.N, p.K, p.group_size, p.act_dtype)
    with pytest.raises(ValueError, match=r"qweight: expected shape \[K/16, 4\*N_pad\] = \[16, 256\]"):
        marlin_fp8_gemm(a, bad)


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
    for split_k in (0, 3):
        torch.library.opcheck(ops.marlin_fp8_gemm, (a, p.qweight, p.scales, 200, 256, 128, torch.bfloat16,
                                                    torch.float32, split_k))
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
    assert torch.equal(marlin_fp8_dequantize(pg, torch.float32).cpu(), _ref_weight(w, s, group_size, act))


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
    ref = a.float().cpu() @ _ref_weight(w, s, group_size, act).t()
    out = marlin_fp8_gemm(a, p)
    assert out.dtype == act and out.shape == (m, n) and not out.isnan().any()
    assert rel_mean_abs(out.cpu(), ref) < 0.04
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
@pytest.mark.parametrize("split_k", [0, 2])
def test_cuda_gemm_short_and_long_k(act, k, split_k):
    """K=16/48: the pipeline stage is half full, no split possible, and the pipeline
    never fills; K=1024 wraps it often (with 2 slices: 32 k-tiles each)."""
    from mla_ext.kv_b_proj.marlin import plan_gemm

    n, m = 136, 19
    w, s, gen = _case(n, k, -1, seed=k)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), act)
    a = torch.randn(m, k, generator=gen).to(act)
    split = plan_gemm(m, n, k, -1, torch.cuda.get_device_properties(0).multi_processor_count, split_k).split
    want = marlin_fp8_gemm(a, marlin_fp8_repack(w, s, act), out_dtype=torch.float32, split_k=split)
    got = marlin_fp8_gemm(a.cuda(), p, out_dtype=torch.float32, split_k=split_k).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("k", [16, 48])
def test_gemm_cpu_short_k(k):
    w, s, gen = _case(72, k, -1, seed=k)
    p = marlin_fp8_repack(w, s, torch.bfloat16)
    a = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    ref = a.float() @ _ref_weight(w, s, -1, torch.bfloat16).t()
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
    err = rel_mean_abs(out, ref)
    assert err < 0.04, f"RMS {rms} {act}: mean relative error {err:.3g} (subnormal products flushed?)"


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size, k", [(-1, 512), (128, 512), (128, 128)])
def test_cuda_repack_equals_the_vllm_encoder_bytes(act, group_size, k):
    n = 200
    w, s, _ = _case(n, k, group_size, seed=41 + k)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), act, group_size)
    q_want, s_want = vllm_marlin_encode(w, s, group_size, act)
    assert torch.equal(p.qweight.cpu(), q_want)
    assert torch.equal(_bits(p.scales.cpu()), _bits(s_want))


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_gemm_on_vllm_tensors_without_a_copy(act, group_size, m):
    """vLLM's post-load tensors (from the independent encoder) fed to the CUDA kernel as they are."""
    n, k = 1024, 512
    w, s, gen = _case(n, k, group_size, seed=51 + m + group_size)
    qweight, scales = (t.cuda() for t in vllm_marlin_encode(w, s, group_size, act))
    fmt = W.MarlinFp8Weight.from_vllm(qweight, scales, n, k, group_size, act)
    assert fmt.weight.data_ptr() == qweight.data_ptr() and fmt.packed.scales.data_ptr() == scales.data_ptr()
    a = torch.randn(m, k, generator=gen).to(act)
    dense = a.float() @ _ref_weight(w, s, group_size).t()
    out = marlin_fp8_gemm(a.cuda(), fmt.packed).cpu()
    assert out.dtype == act and not out.isnan().any()
    assert rel_mean_abs(out, dense) < 0.04  # SPEC §9
    out32 = marlin_fp8_gemm(a.cuda(), fmt.packed, out_dtype=torch.float32).cpu()
    ref = a.float() @ _ref_weight(w, s, group_size, act).t()
    torch.testing.assert_close(out32, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    assert torch.equal(marlin_fp8_dequantize(fmt.packed, torch.float32).cpu(), _ref_weight(w, s, group_size, act))


# ---------------------------------------------------------------------------
# CUDA kernel (split-K, multi-row-block tiles) against the CPU reference
# ---------------------------------------------------------------------------


def _cpu_and_cuda(m, n, k, group_size, act, seed, row_stride=None):
    w, s, gen = _case(n, k, group_size, seed=seed)
    pc = marlin_fp8_repack(w, s, act, group_size)
    pg = marlin_fp8_repack(w.cuda(), s.cuda(), act, group_size)
    ws = torch.randn(m, row_stride or k, generator=gen).to(act)
    return pc, pg, ws[:, :k], ws.cuda()[:, :k]


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("m", [1, 16, 17, 32, 33, 64, 65, 128, 300])  # every (mb, ws) tiling, several row tiles
@pytest.mark.parametrize("split_k", [0, 1, 3, 8])
def test_cuda_gemm_gemm_matches_cpu_reference_with_the_same_split(act, group_size, m, split_k):
    """N = 4160: not a multiple of any CTA's columns (64/128/256); row stride 576."""
    n, k = 4160, 512
    pc, pg, a_cpu, a_gpu = _cpu_and_cuda(m, n, k, group_size, act, seed=m + split_k + group_size, row_stride=576)
    from mla_ext.kv_b_proj.marlin import plan_gemm

    plan = plan_gemm(m, n, k, group_size, torch.cuda.get_device_properties(0).multi_processor_count, split_k)
    want = marlin_fp8_gemm(a_cpu, pc, out_dtype=torch.float32, split_k=plan.split)  # the kernel's slicing
    got = marlin_fp8_gemm(a_gpu, pg, out_dtype=torch.float32, split_k=split_k).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    for odt in (act, torch.float32 if act == torch.float16 else torch.float16):
        y = marlin_fp8_gemm(a_gpu, pg, out_dtype=odt, split_k=split_k).cpu()
        assert y.dtype == odt and rel_mean_abs(y, want) < 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACT)
@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_cuda_gemm_matches_fp32_reference(act, group_size, m):
    """At the production shape (N = 4096, K = 512): the kernel against the float32 GEMM on
    the weight as packed (scales rounded to the activation dtype)."""
    n, k = 4096, 512
    w, s, gen = _case(n, k, group_size, seed=7 + m)
    pg = marlin_fp8_repack(w.cuda(), s.cuda(), act, group_size)
    a = torch.randn(m, k, generator=gen).to(act)
    want = a.float() @ _ref_weight(w, s, group_size, act).t()
    got = marlin_fp8_gemm(a.cuda(), pg, out_dtype=torch.float32).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("split_k", [0, 5, 16])
def test_cuda_gemm_split_k_is_deterministic_and_the_counters_reset(split_k):
    """The last slice sums the partials in slice order: bitwise equal results call
    after call (the per-tile counters are reset by the kernel, workspace reused)."""
    _, pg, _, a = _cpu_and_cuda(16, 4096, 512, 128, torch.bfloat16, seed=11)
    first = marlin_fp8_gemm(a, pg, out_dtype=torch.float32, split_k=split_k)
    for _ in range(5):
        assert torch.equal(marlin_fp8_gemm(a, pg, out_dtype=torch.float32, split_k=split_k), first)


@pytest.mark.cuda
@pytest.mark.parametrize("m, split_k", [(8, 0), (8, 8), (48, 0)])
def test_cuda_gemm_split_k_graph_capturable(m, split_k):
    gen = torch.Generator().manual_seed(2)
    w, s = _rand_fp8(4096, 512, gen), _rand_scales((4, 4096), gen)
    p = marlin_fp8_repack(w.cuda(), s.cuda(), torch.bfloat16, 128)
    a = torch.randn(m, 512, generator=gen).to(torch.bfloat16).cuda()
    want = marlin_fp8_gemm(a, p, split_k=split_k)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = marlin_fp8_gemm(a, p, split_k=split_k)
    for _ in range(3):  # replays reuse the captured workspace and counters
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
