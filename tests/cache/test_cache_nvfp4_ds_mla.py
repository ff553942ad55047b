"""nvfp4_ds_mla, the 352-byte NVFP4 latent-cache row, on every backend.

The oracle is mla_ext.cache.reference (encode_nvfp4_ds_mla_row /
decode_nvfp4_ds_mla_row). This file first checks that oracle against an
independent encoder and decoder written here, element by element in numpy
float32, from the layout facts alone:

  bytes   0..255  512 latent values as e2m1, two per byte, low nibble = even
                  element; sign in bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
  bytes 256..319  64 rope values as e4m3, no scale (saturating cast)
  bytes 320..351  32 e4m3 scales, scale of element block s at byte
                  320 + 8 * (s % 4) + s // 4, value e4m3(max(amax16 / 6, 2^-9))

with the rounding rules mla_ext documents: e4m3 and e2m1 round to nearest,
ties to the even code, saturating (448, 6); a latent keeps the sign of x;
a block holding NaN/inf stores the NaN scale 0x7F and zero codes.

Then the kernels (C++ CPU, CUDA, Triton) against the oracle, bit for bit:
the writer's bytes equal the reference encoder's, and every gather (bf16,
fp16, fp32, raw bytes) equals the reference decoder of those bytes; decoded
values are exact in every dst dtype, so even the Triton interpreter (whose
fp32 -> 16-bit stores truncate) must match exactly. Outputs are poisoned
first; guard rows/columns prove nothing else is written.
"""
from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_ext import _ext
from mla_ext.cache import api, reference as ref
from mla_ext.config.formats import Nvfp4DsMla, QuantMode, ScaleKind, get_format
from helpers.gather import make_batch, make_cache, poisoned_dst, strided_copy
from helpers.numeric import rel_fro, same_bits

FMT = "nvfp4_ds_mla"
L, R, ENTRY = 512, 64, 352
needs_ext = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DST_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


# -- the independent encoder / decoder (layout facts only) ---------------------

def _all_e4m3() -> list[tuple[float, int]]:
    """(value, byte) of every non-negative finite e4m3fn byte, from the bit layout:
    1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F is NaN; subnormals m * 2^-9."""
    out = []
    for b in range(0x7F):
        e, m = b >> 3, b & 7
        v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out.append((v, b))
    return out


E4M3_TABLE = _all_e4m3()
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # index = the 3 magnitude bits


def _nearest(a: float, grid: list[float]) -> int:
    """Index of the grid value nearest to a >= 0; ties to the even index; past the
    last value, the last (saturation)."""
    if a >= grid[-1]:
        return len(grid) - 1
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - a), i % 2))
    return best


def _e4m3_byte(x: float) -> int:
    """RNE, saturating at 448, sign kept (x is finite here)."""
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    vals = [v for v, _ in E4M3_TABLE]
    return sign | E4M3_TABLE[_nearest(abs(x), vals)][1]


def _e4m3_value(b: int) -> float:
    if b & 0x7F == 0x7F:
        return float("nan")
    v = E4M3_TABLE[b & 0x7F][0]
    return -v if b & 0x80 else v


def independent_encode(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, 512] + [T, 64] (any float dtype) -> [T, 352] uint8, one element at a time."""
    x = kv_c.float().numpy()
    pe = k_pe.float().numpy()
    T = x.shape[0]
    out = np.zeros((T, 352), dtype=np.uint8)
    for t in range(T):
        for s in range(32):
            block = x[t, 16 * s:16 * s + 16]  # float32
            if not np.isfinite(block).all():
                sb, codes = 0x7F, [0] * 16
            else:
                amax = np.float32(np.abs(block).max())
                scale = max(np.float32(amax / np.float32(6.0)), np.float32(2.0**-9))  # fp32 division
                sb = _e4m3_byte(float(scale))
                inv = np.float32(np.float32(1.0) / np.float32(_e4m3_value(sb)))  # vLLM: 1.0f / sf
                codes = []
                for v in block:
                    q = np.float32(v * inv)  # fp32 multiply by the reciprocal, as vLLM's writer
                    sign = 8 if math.copysign(1.0, float(q)) < 0 else 0
                    codes.append(sign | _nearest(abs(float(q)), E2M1_GRID))
            for j in range(8):  # element 2j in the low nibble of byte j
                out[t, 8 * s + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
            out[t, 320 + 8 * (s % 4) + s // 4] = sb
        for i in range(64):
            v = float(pe[t, i])
            out[t, 256 + i] = 0x7F if math.isnan(v) else _e4m3_byte(max(-448.0, min(448.0, v)))
    return torch.from_numpy(out)


def independent_decode(rows: torch.Tensor) -> torch.Tensor:
    """[T, 352] uint8 -> float64 [T, 576] (kv_c then k_pe), one element at a time."""
    r = rows.numpy()
    T = r.shape[0]
    out = np.zeros((T, 576), dtype=np.float64)
    for t in range(T):
        for i in range(512):
            byte = int(r[t, i // 2])
            code = byte & 0xF if i % 2 == 0 else byte >> 4
            mag = E2M1_GRID[code & 7]
            s = i // 16
            out[t, i] = (-mag if code & 8 else mag) * _e4m3_value(int(r[t, 320 + 8 * (s % 4) + s // 4]))
        for i in range(64):
            out[t, 512 + i] = _e4m3_value(int(r[t, 256 + i]))
    return torch.from_numpy(out)


def special_rows(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that hit every rounding rule: exact e2m1 ties, saturation (a scale that
    e4m3 rounds down, a huge amax that saturates the scale at 448), the 2^-9 scale
    floor, -0.0 and tiny negatives, subnormal scales, and (fp32 only) NaN/inf blocks."""
    rows = []
    # Block 0 of row 0: amax 6 * 2^-3 makes the scale exactly 2^-3; the other
    # values are the seven e2m1 midpoints (ties) and their negatives, times it.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    r0 = torch.randn(512, generator=torch.Generator().manual_seed(1)).clamp(-2.9, 2.9)
    blk = [6.0] + ties + [-t for t in ties] + [0.1]
    r0[:16] = torch.tensor(blk) * 0.125
    r0[16:32] = torch.tensor([-0.0] * 8 + [1e-3, -1e-3, 1e-4, -1e-6, 0.0, 2e-3, -2e-3, 5e-3])
    r0[32:48] = torch.linspace(-7000.0, 9000.0, 16)  # amax/6 > 448: scale saturates
    r0[48:64] = torch.linspace(-1.0, 1.0, 16) * 2.0**-12  # scale floor 2^-9
    r0[64:80] = torch.linspace(-1.0, 1.0, 16) * 0.05  # a subnormal e4m3 scale (~4 * 2^-9)
    # amax/6 = 0.3125 + a bit: e4m3 rounds it down to 0.3125, so q = amax/scale > 6.
    r0[80:96] = torch.tensor([1.9] * 15 + [6 * 0.3125 * 1.03])
    rows.append(r0)
    pe0 = torch.linspace(-600.0, 600.0, 64)  # saturating e4m3 rope
    pe0[1] = -0.0
    pe0[2] = 2.0**-10  # below half the smallest subnormal: rounds to 0
    pe0[3] = 3 * 2.0**-10  # a tie between subnormals
    pes = [pe0]
    if dtype == torch.float32:
        r1 = torch.randn(512, generator=torch.Generator().manual_seed(2))
        r1[5] = float("nan")
        r1[40] = float("inf")
        r1[300] = -float("inf")
        rows.append(r1)
        pe1 = torch.randn(64, generator=torch.Generator().manual_seed(3))
        pe1[7] = float("nan")
        pe1[8] = float("inf")
        pes.append(pe1)
    return torch.stack(rows).to(dtype), torch.stack(pes).to(dtype)


def random_rows(T: int, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents with per-block magnitudes over many decades (so scales span the
    e4m3 range) and rope values of all sizes; never zeros."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.randint(-4, 4, (T, 32, 1), generator=g).float()
    kv = (torch.randn(T, 32, 16, generator=g) * mag).reshape(T, 512)
    pe = torch.randn(T, 64, generator=g) * 10.0 ** torch.randint(-3, 3, (T, 1), generator=g).float()
    assert bool((kv != 0).all())
    return kv.to(dtype), pe.to(dtype)


# -- registry, policy, planner ---------------------------------------------------

def test_registry_entry():
    f = get_format(FMT)
    assert (f.id, f.quant_mode, f.scale_kind, f.storage) == (6, QuantMode.NVFP4_PER_BLOCK, ScaleKind.PER_BLOCK,
                                                             "uint8")
    assert f.bytes_per_token(512, 64) == 352 == f.entry_elems(512, 64)
    assert f.storage_dtype(torch.bfloat16) == torch.uint8
    for bad in ((512, 0), (256, 64), (512, 32)):
        assert not f.supports_dims(*bad)
        with pytest.raises(ValueError, match=r"nvfp4_ds_mla' needs kv_lora_rank L=512 and qk_rope_head_dim R=64"):
            f.check_dims(*bad)
    # The permuted scale positions cover bytes 320..351 exactly once.
    assert sorted(Nvfp4DsMla.scale_byte(s) for s in range(32)) == list(range(32))
    assert [Nvfp4DsMla.scale_byte(s) for s in (0, 1, 2, 3, 4, 31)] == [0, 8, 16, 24, 1, 31]


def test_policy_and_planner_mix_nvfp4_with_native_layers():
    from mla_ext.config.models import get_model_config
    from mla_ext.config.planner import plan_model
    from mla_ext.config.policy import CacheConfig, resolve_layer

    m = get_model_config("deepseek-v3")
    cfg = CacheConfig(FMT, skip_layers=(0, "2"), block_size=64)
    q = resolve_layer(cfg, m, layer=1)
    assert (q.kv_cache_dtype, q.quant_mode, q.calculate_kv_scales) == (FMT, QuantMode.NVFP4_PER_BLOCK, False)
    assert q.page_bytes() == 64 * 352 == 22528 and q.cache_shape(3) == (3, 64, 352)
    s = resolve_layer(cfg, m, prefix="model.layers.2.self_attn.attn")
    assert s.skipped and s.kv_cache_dtype == "auto" and s.page_bytes() == 73728
    # calculate_kv_scales asks only per-tensor layers for a scale.
    assert not resolve_layer(CacheConfig(FMT, calculate_kv_scales=True), m, layer=5).calculate_kv_scales
    budget = 10 * 2**30
    plan = plan_model(cfg, m, budget)
    assert plan.bytes_used <= budget
    by_fmt = {p.format_name: p for p in plan.layers}
    assert set(by_fmt) == {"auto", FMT}
    assert by_fmt[FMT].page_bytes == 22528 and by_fmt[FMT].shape == (plan.num_blocks, 64, 352)
    caches = plan.allocate(shared=True)
    assert caches[1].shape == (plan.num_blocks, 64, 352) and caches[1].dtype == torch.uint8


def test_cli_plan_accepts_the_format():
    out = subprocess.run([sys.executable, "-m", "mla_ext", "plan", "--kv-cache-dtype", FMT, "--skip-layers", "0",
                          "--memory", "2GiB", "--block-size", "64", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    import json

    doc = json.loads(out.stdout)
    fmts = {(p["format"], p["bytes_per_token"], p["page_bytes"]) for p in doc["layers"]}
    assert (FMT, 352, 22528) in fmts and ("auto", 1152, 73728) in fmts


# -- the oracle against the independent codec -----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_encoder_matches_the_independent_encoder_on_special_rows(dtype):
    kv, pe = special_rows(dtype)
    got = ref.encode_nvfp4_ds_mla_row(kv, pe)
    assert torch.equal(got, independent_encode(kv, pe))
    # The hand-checked facts of block 0 of row 0: scale 2^-3 (e4m3 0x20), and the ties.
    assert int(got[0, 320]) == 0x20
    codes = [(int(got[0, j // 2]) >> (4 * (j % 2))) & 0xF for j in range(16)]
    assert codes[:8] == [7, 0, 2, 2, 4, 4, 6, 6]  # 6, then ties .25 .75 1.25 1.75 2.5 3.5 5
    assert codes[8:15] == [8, 10, 10, 12, 12, 14, 14]  # the same ties, negative
    # -0.0 keeps its sign; the 2^-9 floor (0x01); saturation at scale 448 (0x7E).
    assert (int(got[0, 8]) & 0xF) == 8
    assert int(got[0, 320 + Nvfp4DsMla.scale_byte(3)]) == 0x01
    assert int(got[0, 320 + Nvfp4DsMla.scale_byte(2)]) == 0x7E
    if dtype == torch.float32:  # NaN / inf blocks: NaN scale, zero codes
        for s in (0, 2, 18):
            assert int(got[1, 320 + Nvfp4DsMla.scale_byte(s)]) == 0x7F
            assert bool((got[1, 8 * s:8 * s + 8] == 0).all())


@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
@settings(max_examples=15, deadline=None)
def test_reference_encoder_matches_the_independent_encoder_seeded(seed, T, dtype):
    kv, pe = random_rows(T, seed, dtype)
    assert torch.equal(ref.encode_nvfp4_ds_mla_row(kv, pe), independent_encode(kv, pe))


def test_reference_decoder_matches_the_independent_decoder():
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 256, (6, 352), generator=g, dtype=torch.uint8)  # any bytes, NaN scales too
    kv_c, k_pe, scales = ref.decode_nvfp4_ds_mla_row(rows)
    want = independent_decode(rows)
    got = torch.cat([kv_c, k_pe], dim=-1).double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))
    assert same_bits(torch.signbit(got.nan_to_num(0)), torch.signbit(want.nan_to_num(0)))
    assert scales.shape == (6, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_error_is_within_one_scale_step(dtype):
    """Sanity of the format, not just self-consistency: each decoded latent is within
    one step (its block's scale) of the input, the largest e2m1 gap being 2, or, where
    e4m3 rounded the scale below amax / 6 (coarse subnormal scales) and the largest
    values saturate at 6 * scale, within amax - 6 * scale; the rope within an e4m3
    half-ulp."""
    kv, pe = random_rows(64, 11, dtype)
    kv_c, k_pe, scales = ref.decode_nvfp4_ds_mla_row(ref.encode_nvfp4_ds_mla_row(kv, pe))
    err = (kv_c - kv.float()).abs().reshape(64, 32, 16)
    unsaturated = scales < 448  # amax > 2688 saturates the scale (then the error is unbounded)
    assert bool(unsaturated.float().mean() > 0.5)
    amax = kv.float().abs().reshape(64, 32, 16).amax(-1)
    bound = torch.maximum(scales, amax - 6 * scales)
    assert bool((err <= bound[:, :, None])[unsaturated].all())
    normal = (scales >= 2.0**-6) & unsaturated
    assert bool((err <= scales[:, :, None])[normal].all())  # normal scales: one step
    assert bool(((k_pe - pe.float()).abs() <= pe.float().abs() * 2.0**-4 + 2.0**-10).all())
    ok = unsaturated[:, :, None].expand(64, 32, 16).reshape(64, 512)
    rel = rel_fro(kv_c[ok], kv.float()[ok])
    assert 0.0 < rel < 0.15


# -- kernels: writer ----------------------------------------------------------------

def _write_case(device, in_dtype, T, strided, seed, special=False):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, B = 8, 16
    if special:
        kv, pe = special_rows(in_dtype)
        T = kv.shape[0]
    else:
        kv, pe = random_rows(T, seed, in_dtype)
    if strided:  # layer 1 of a 2-layer buffer with padding after entries and blocks
        base = torch.randint(0, 256, (2, num_blocks, B + 1, ENTRY + 5), generator=gen, dtype=torch.uint8)
        view = lambda b: b[1, :, :B, :ENTRY]  # noqa: E731
    else:
        base = torch.randint(0, 256, (num_blocks, B, ENTRY), generator=gen, dtype=torch.uint8)
        view = lambda b: b  # noqa: E731
    slots = torch.randperm(num_blocks * B + 8, generator=gen)[:T] - 4
    slots = torch.where(slots < 0, torch.full_like(slots, -1), slots)  # padding and past-the-end slots
    want = base.clone()
    ref.concat_and_cache_mla_ref(kv, pe, view(want), slots, FMT, torch.ones(1))
    dev = torch.device(device)
    got = base.to(dev)
    api.concat_and_cache_mla(kv.to(dev), pe.to(dev), view(got), slots.to(dev), FMT, torch.ones(1, device=dev))
    assert torch.equal(got.cpu(), want)
    # The written rows are exactly the independent encoder's bytes.
    flat = view(want).reshape(-1, ENTRY)
    ok = (slots >= 0) & (slots < num_blocks * B)
    assert torch.equal(flat[slots[ok]], independent_encode(kv[ok], pe[ok]))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@given(in_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), T=st.integers(0, 40),
       strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
@SETTINGS
def test_writer_bytes_equal_the_reference_encoder(device, in_dtype, T, strided, seed):
    _write_case(device, in_dtype, T, strided, seed)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_writer_special_values(device, in_dtype, strided):
    _write_case(device, in_dtype, 0, strided, 3, special=True)


# -- kernels: gathers ------------------------------------------------------------------

def _gather_case(device, dst_dtype, num_reqs, block_size, strided, seed, bad_ids=False, backend=None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = rng.randint(2, max(3, 256 // block_size))
    max_blocks = max(1, min(num_blocks * 2, 512 // block_size))
    cache, _ = make_cache(FMT, num_blocks, block_size, L, R, strided=strided, gen=gen)
    bt, cu, starts = make_batch(rng, num_reqs, num_blocks, block_size, max_blocks, bad_ids=bad_ids)
    raw = dst_dtype == torch.uint8
    width = ENTRY if raw else L + R
    total = int(cu[-1])
    dst, buf = poisoned_dst(total + 2, width, dst_dtype, pad_cols=3)  # 2 spare rows stay untouched
    want = buf.clone()
    if raw:
        ref.cp_gather_ref(cache, want[3:3 + total + 2, :width], bt, cu, num_reqs, starts)
    else:
        ref.gather_ref(cache, want[3:3 + total + 2, :width], bt, cu, num_reqs, FMT, torch.ones(1), starts)
    dev = torch.device(device)
    got = buf.to(dev)
    src = strided_copy(cache, dev) if device != "cpu" else cache
    args = (src, got[3:3 + total + 2, :width], bt.to(dev), cu.to(dev), num_reqs)
    if backend == "triton":
        from mla_ext.cache import triton_gather as tg

        tg.gather_triton(*args, FMT, torch.ones(1, device=dev), starts.to(dev))
    else:
        api.gather_and_maybe_dequant_cache(*args, FMT, torch.ones(1, device=dev), starts.to(dev))
    assert same_bits(got.cpu(), want)
    if not raw and total:
        # The decoded rows are the independent decoder's values of the cached bytes.
        flat = cache.reshape(-1, ENTRY)
        for r in range(num_reqs):
            for i in range(int(cu[r]), int(cu[r + 1]), max(1, (int(cu[r + 1]) - int(cu[r])) // 3)):
                tok = int(starts[r]) + i - int(cu[r])
                blk = int(bt[r, tok // block_size])
                if 0 <= blk < num_blocks:
                    row = flat[blk * block_size + tok % block_size][None]
                    exp = independent_decode(row)[0]
                    g = want[3 + i, :width].double()
                    assert torch.equal(g.isnan(), exp.isnan())
                    assert torch.equal(g.nan_to_num(0), exp.to(dst_dtype).double().nan_to_num(0))


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@given(dst_i=st.integers(0, 3), num_reqs=st.integers(1, 24), block_size=st.sampled_from([1, 16, 64]),
       strided=st.booleans(), bad_ids=st.booleans(), seed=st.integers(0, 2**31 - 1))
@SETTINGS
def test_gather_matches_reference(device, dst_i, num_reqs, block_size, strided, bad_ids, seed):
    _gather_case(device, DST_DTYPES[dst_i], num_reqs, block_size, strided, seed, bad_ids)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dst_dtype", DST_DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_triton_gather_matches_reference(device, dst_dtype, strided):
    from mla_ext import compat
    from mla_ext.cache import triton_gather as tg

    if tg.triton is None:
        pytest.skip("triton is not installed")
    if device == "cpu" and compat.triton_interpreter_reasons():
        pytest.skip("; ".join(compat.triton_interpreter_reasons()))
    for seed, block_size, bad in ((1, 16, False), (2, 1, True)):
        _gather_case(device, dst_dtype, 5, block_size, strided, seed, bad_ids=bad, backend="triton")


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_cp_gather_copies_raw_rows(device):
    cache, _ = make_cache(FMT, 10, 16, L, R, strided=True, gen=torch.Generator().manual_seed(5))
    bt, cu, starts = make_batch(random.Random(5), 9, 10, 16, 8)
    dst, buf = poisoned_dst(int(cu[-1]), ENTRY, torch.uint8)
    want = buf.clone()
    ref.cp_gather_ref(cache, want[3:-3], bt, cu, 9, starts)
    dev = torch.device(device)
    got = buf.to(dev)
    api.cp_gather_cache(strided_copy(cache, dev), got[3:-3], bt.to(dev), cu.to(dev), 9, starts.to(dev),
                        validate=True)
    assert torch.equal(got.cpu(), want)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_round_trip_write_then_gather(device, in_dtype):
    """write (op) -> gather (op, every dst dtype) == reference decode of the reference
    encoder's bytes; NaN/inf blocks come back as NaN for exactly their 16 columns."""
    dev = torch.device(device)
    kv, pe = random_rows(45, 21, in_dtype)
    if in_dtype == torch.float32:
        kv[3, 100] = float("nan")  # block 6 of token 3
        kv[9, 511] = float("inf")  # block 31 of token 9
    cache = torch.full((4, 16, ENTRY), 0x5A, dtype=torch.uint8, device=dev)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:45]
    api.concat_and_cache_mla(kv.to(dev), pe.to(dev), cache, slots.to(dev), FMT, torch.ones(1, device=dev))
    expect = torch.cat(ref.decode_nvfp4_ds_mla_row(ref.encode_nvfp4_ds_mla_row(kv, pe))[:2], dim=-1)
    # Request r reads tokens 0..44 in slot order through a block table.
    bt = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    order = torch.argsort(slots)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        dst = torch.full((64, 576), float("nan"), dtype=dt, device=dev)
        api.gather_and_maybe_dequant_cache(cache, dst, bt.to(dev), cu.to(dev), 1, FMT,
                                           torch.ones(1, device=dev))
        got = dst.cpu()[slots.sort().values]
        assert same_bits(got, expect[order].to(dt))
    if in_dtype == torch.float32:
        row3 = got[(slots.sort().values == slots[3]).nonzero()[0, 0]]
        assert bool(row3[96:112].isnan().all()) and not bool(row3[:96].isnan().any())
        assert not bool(row3[112:].isnan().any())


# -- errors and odds ----------------------------------------------------------------

@needs_ext
@pytest.mark.parametrize("call", ["api", "op"])
def test_argument_errors_name_the_argument(call):
    ops = _ext.ops()
    cache = torch.zeros(2, 16, ENTRY, dtype=torch.uint8)
    bt, cu, one = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), torch.ones(1)
    gather = api.gather_and_maybe_dequant_cache if call == "api" else ops.gather_and_maybe_dequant_cache
    write = api.concat_and_cache_mla if call == "api" else ops.concat_and_cache_mla
    with pytest.raises(ValueError, match=r"dst: nvfp4_ds_mla dequantizes to 576 columns, got 512"):
        gather(cache, torch.zeros(4, 512, dtype=torch.bfloat16), bt, cu, 1, FMT, one)
    with pytest.raises(ValueError, match=r"nvfp4_ds_mla entries are 352 bytes, got.* 656"):
        gather(torch.zeros(2, 16, 656, dtype=torch.uint8), torch.zeros(4, 576), bt, cu, 1, FMT, one)
    with pytest.raises(ValueError, match=r"nvfp4_ds_mla.* needs a (torch\.)?uint8 cache"):
        gather(cache.view(torch.float8_e4m3fn), torch.zeros(4, 576), bt, cu, 1, FMT, one)
    kv, slots = torch.randn(3, 512), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"R=0|R=64|cannot hold L=512, R=0"):
        write(kv, kv[:, :0], cache, slots, FMT, one)
    with pytest.raises(ValueError, match=r"entry width 352|352"):
        write(kv, kv[:, :64], torch.zeros(2, 16, 576, dtype=torch.uint8), slots, FMT, one)


@needs_ext
def test_compute_kv_scale_is_one():
    x = torch.randn(5, 512) * 30
    assert float(api.compute_kv_scale(x, x[:, :64], FMT)) == 1.0
    assert float(ref.compute_kv_scale_ref(x, x[:, :64], FMT)) == 1.0


@needs_ext
def test_fake_kernel_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cache = torch.empty(2, 16, ENTRY, dtype=torch.uint8)
        torch.ops.mla_ext.gather_and_maybe_dequant_cache(
            cache, torch.empty(8, 576, dtype=torch.bfloat16), torch.empty(1, 1, dtype=torch.int32),
            torch.empty(2, dtype=torch.int32), 1, FMT, torch.empty(1))


# -- MLAPrefill end to end ----------------------------------------------------------------

@needs_ext
@pytest.mark.parametrize("workspace_rows", [32, 256])
def test_mla_prefill_with_an_nvfp4_ds_mla_layer(workspace_rows):
    """A whole layer: chunked, paged prefill over an nvfp4_ds_mla cache equals one-shot
    dense attention over what the cache holds (decoded by the reference), SPEC §9."""
    from mla_ext.config.policy import CacheConfig
    from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
    from mla_ext.prefill.reference import mla_prefill_reference
    from helpers.numeric import rel_fro
    from helpers.prefill import BLOCK, TINY, Batch, make_weight

    gen = torch.Generator().manual_seed(77)
    batch = Batch(ctx_lens=[70, 0, 5, 1, 33], q_lens=[3, 2, 1, 2, 4], seed=workspace_rows)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    cfg = CacheConfig(FMT, skip_layers=(0,), block_size=BLOCK)
    layer = MLAPrefill(TINY, cfg, make_weight("fp8_block", w), prefix="model.layers.1.self_attn",
                       workspace_rows_override=workspace_rows, max_num_seqs=8)
    assert layer.kv_cache_dtype == FMT and layer.spec.entry_elems == 352
    assert layer.compute_kv_scale(batch.kv_c_new, batch.k_pe_new) is None
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, None)
    cache = batch.fill_cache(layer, None)
    out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    assert not torch.isnan(out).any()
    flat = cache.reshape(-1, ENTRY)
    rows = [ref.decode_cache_rows(flat[s], FMT) for s in batch.slots]
    kv_c, k_pe = [r[:, :L] for r in rows], [r[:, L:] for r in rows]
    want = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
                                 layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                 layer.softmax_scale)
    assert rel_fro(out, want) <= 1e-2
    no_ctx = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, [t[:0] for t in kv_c],
                                   [t[:0] for t in k_pe], batch.q_lens,
                                   layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                   layer.softmax_scale)
    assert rel_fro(out, no_ctx) > 0.1
    # Skipped layer 0 of the same config stays native.
    native = MLAPrefill(TINY, cfg, make_weight("dense", w), prefix="model.layers.0.self_attn",
                        workspace_rows_override=workspace_rows, max_num_seqs=8)
    assert native.kv_cache_dtype == "auto" and native.spec.storage_dtype == torch.bfloat16


def _division_codes(kv_c: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes a writer that DIVIDES by the block scale would store ([T, 512])."""
    sbytes = ref.nvfp4_block_scale_bytes(kv_c)
    s = sbytes.view(torch.float8_e4m3fn).float()
    x = kv_c.float().reshape(kv_c.shape[0], 32, 16)
    return ref.e2m1_codes(x / s[:, :, None]).reshape(kv_c.shape[0], L)


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
def test_writer_multiplies_by_the_reciprocal_like_vllm(device):
    """vLLM's writer stores e2m1(x * (1.0f / sf)), an IEEE reciprocal then a multiply;
    a division differs at e2m1 rounding ties (the issue measured 73 of 180,224 bytes on
    512 random bf16 tokens). The written codes must be the reciprocal's everywhere, and
    the data must hold ties where the division would differ (else the test proves nothing)."""
    gen = torch.Generator().manual_seed(18)
    T = 512
    kv = torch.randn(T, L, generator=gen).to(torch.bfloat16)
    pe = torch.randn(T, R, generator=gen).to(torch.bfloat16)
    dev = torch.device(device)
    cache = torch.full((T // 16, 16, ENTRY), 0xAB, dtype=torch.uint8, device=dev)
    slots = torch.arange(T, dtype=torch.int64)
    api.concat_and_cache_mla(kv.to(dev), pe.to(dev), cache, slots.to(dev), FMT, torch.ones(1, device=dev))
    rows = cache.cpu().reshape(T, ENTRY)
    assert torch.equal(rows, independent_encode(kv, pe))
    packed = rows[:, :L // 2].to(torch.int32)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(T, L)
    division = _division_codes(kv).to(torch.int32)
    differ = int((codes != division).sum())
    assert 0 < differ < T * L // 1000, differ
