"""The page-granular gathers and the vectorised writer against the CPU kernel.

Without a GPU the CUDA kernels' own code runs in a host emulator:
tests/cache/emulator/paged_gather_emulator.cpp, built here with the system C++ compiler,
runs csrc/cache/paged_gather.h / write_lanes.h / vec.h thread by thread (the
kernels' phases separated as their __syncthreads and shuffles separate them);
only the few device instructions behind __CUDA_ARCH__ are replaced by the
portable code next to them. Every comparison is bitwise (any NaN matches any
NaN), outputs are poisoned, guard rows and columns around dst must stay
untouched, and the inputs cover partial first and last pages, seq_starts in
mid-page, zero-length requests, out-of-range block ids (zero rows), strided
and misaligned caches and dst (the narrower fallback paths), and every format.

With a GPU (`cuda` tests) the same cases run through the real kernels:
backend "cuda_paged" against the CPU kernel, "cuda_vector"
writer and kv scale against the CPU kernel, and a CUDA-graph capture.

The Triton paged gather runs in the interpreter (small shapes) against the
reference, bit-exactly: fp32 outputs always, 16-bit outputs where every value is
exact (power-of-two scales; the interpreter truncates fp32 -> bf16 stores).

Also here: the proof that x * (1 / 2^k) is bit-identical to x / 2^k (the
writer's reciprocal multiply), over every power of two and adversarial x.
"""
from __future__ import annotations

import ctypes
import hashlib
import inspect
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_ext import _ext
from mla_ext.cache import api, reference as ref
from mla_ext.cache import triton_gather as tg
from mla_ext.config.formats import get_format
from helpers.gather import POISON_BYTE, make_batch, make_cache, poisoned_dst, strided_copy
from helpers.numeric import same_bits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_ext = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

# Kinds and element types as csrc/cache/cache_kernels.h numbers them.
KIND = {"raw": 0, "e4m3": 1, "e5m2": 2, "ds": 3, "nvfp4": 4}
ELEM = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
FORMAT_ID = {"auto": 0, "bfloat16": 1, "float16": 2, "fp8": 3, "fp8_e4m3": 3, "fp8_e5m2": 4, "fp8_ds_mla": 5,
             "nvfp4_ds_mla": 6}


# -- the emulator ----------------------------------------------------------------

EMU_SRC = os.path.join(ROOT, "tests", "cache", "emulator", "paged_gather_emulator.cpp")


def _emu_sources() -> list[str]:
    out = [EMU_SRC]
    for sub in ("cache", "common"):
        d = os.path.join(ROOT, "csrc", sub)
        out += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".h"))
    return out


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernel emulator")
    digest = hashlib.sha256(b"".join(open(f, "rb").read() for f in _emu_sources())).hexdigest()[:16]
    so = tmp_path_factory.mktemp("emu") / f"mla_emu_{digest}.so"
    # No -ffast-math / -ffinite-math: subnormals and NaN behave as on the device.
    cmd = [cxx, "-std=c++20", "-O2", "-fPIC", "-shared", "-I", os.path.join(ROOT, "csrc"), EMU_SRC, "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lib = ctypes.CDLL(str(so))
    P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.mla_emulate_paged_gather.argtypes = [P, I64, I64, I32, I32, I64, P, I64, I32, I64, I32, I32, P, I64, I32,
                                             P, P, I32, P, I32, ctypes.c_char_p, I32, ctypes.POINTER(I32)]
    lib.mla_emulate_paged_gather.restype = I32
    lib.mla_emulate_write.argtypes = [P, I64, P, I64, I32, I32, I64, I64, P, I64, I64, I32, I32, P, I32, I32, P]
    lib.mla_emulate_write.restype = I32
    lib.mla_emulate_kv_scale.argtypes = [P, I64, P, I64, I32, I32, I64, I64, ctypes.c_float]
    lib.mla_emulate_kv_scale.restype = ctypes.c_float
    lib.mla_scaled_division.argtypes = [P, ctypes.c_float, P, I64]
    lib.mla_scaled_division.restype = I32
    return lib


def _ptr(t):
    return None if t is None else t.data_ptr()


def emulate_gather(lib, cache, dst, bt, cu, num_reqs, fmt_name, k_scale, starts, rounds=0):
    """gather_cuda on the host, with the parameters csrc/cache/cache_ops.cpp would pass.
    fmt_name None: cp_gather_cache. Returns (decoder name, rows per CTA)."""
    raw = fmt_name is None or dst.dtype == cache.dtype
    if raw:
        kind = KIND["raw"]
    else:
        qm = get_format(fmt_name).quant_mode
        kind = {2: KIND["ds"], 3: KIND["nvfp4"]}.get(int(qm))
        if kind is None:
            kind = KIND["e5m2"] if get_format(fmt_name).fp8_dtype == torch.float8_e5m2 else KIND["e4m3"]
    es, des = cache.element_size(), dst.element_size()
    name = ctypes.create_string_buffer(512)
    rows = ctypes.c_int32(0)
    assert bt.dtype == cu.dtype == torch.int32 and bt.stride(1) == 1
    lib.mla_emulate_paged_gather(
        _ptr(cache), cache.stride(0) * es, cache.stride(1) * es, cache.size(0), cache.size(1),
        dst.size(1) * des, _ptr(dst), dst.stride(0) * des, dst.size(0), dst.size(1), ELEM.get(dst.dtype, 3), kind,
        _ptr(bt), bt.stride(0), bt.size(1), _ptr(cu), _ptr(starts), num_reqs,
        None if raw or k_scale is None else _ptr(k_scale), rounds, name, 512, ctypes.byref(rows))
    return name.value.decode(), rows.value


def emulate_write(lib, kv_c, k_pe, cache, slots, fmt_name, k_scale):
    es = kv_c.element_size()
    ces = cache.element_size()
    lib.mla_emulate_write(
        _ptr(kv_c), kv_c.stride(0) * es, _ptr(k_pe), k_pe.stride(0) * es, ELEM[kv_c.dtype], kv_c.size(0),
        kv_c.size(1), k_pe.size(1), _ptr(cache), cache.stride(0) * ces, cache.stride(1) * ces, cache.size(0),
        cache.size(1), _ptr(slots), int(slots.dtype == torch.int32), FORMAT_ID[fmt_name], _ptr(k_scale))


# -- inputs ------------------------------------------------------------------------

FORMATS = ["bfloat16", "float16", "auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla"]


def _model_dtype(fmt):
    return {"float16": torch.float16, "auto": torch.float32}.get(fmt, torch.bfloat16)


def _dst_dtypes(fmt):
    if get_format(fmt).is_native:
        return ["raw"]
    return [torch.bfloat16, torch.float16, torch.float32, "raw"]


def _misaligned(cache: torch.Tensor) -> torch.Tensor:
    """`cache` re-homed one element into a byte buffer, its entries padded by one
    element: rows are not 16-byte aligned (the kernels' narrow fallbacks)."""
    nb, B, E = cache.shape
    es = cache.element_size()
    raw = torch.full((nb * B * (E + 1) * es + es + 16,), POISON_BYTE, dtype=torch.uint8)
    view = raw[es:es + nb * B * (E + 1) * es].view(nb, B, (E + 1) * es)[:, :, :E * es]
    view.copy_(cache.contiguous().view(torch.uint8).view(nb, B, E * es))
    return view.view(cache.dtype)


def gather_case(seed, fmt, dst_dtype, B=16, num_reqs=5, layout="dense", bad_ids=False, dst_pad=0, dst_col=0,
                R=None, cu_offset=0, k_scale=None, max_blocks=None):
    """(cache, k_scale, bt, cu, starts, dst view, whole dst buffer, width, num_reqs)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L = 512 if fmt in ("fp8_ds_mla", "nvfp4_ds_mla") else rng.choice([512, 256])
    if R is None:
        R = 64 if fmt != "fp8_ds_mla" else rng.choice([64, 0])
    num_blocks = rng.randint(3, max(4, 256 // B))
    max_blocks = max_blocks or max(2, min(num_blocks + 2, 512 // B))
    ks = k_scale if k_scale is not None else torch.tensor([rng.choice([0.03, 0.25, 1.7])], dtype=torch.float32)
    cache, ks = make_cache(fmt, num_blocks, B, L, R, _model_dtype(fmt), k_scale=ks,
                           strided=layout == "strided", gen=gen)
    if layout == "misaligned":
        cache = _misaligned(cache)
    bt, cu, starts = make_batch(rng, num_reqs, num_blocks, B, max_blocks, bad_ids=bad_ids)
    if bad_ids:
        bt = bt[:, :max(1, max_blocks - 1)].contiguous()  # some requests also run past the table width
    cu = cu + cu_offset
    raw = dst_dtype == "raw"
    dtype = cache.dtype if raw else dst_dtype
    width = cache.shape[2] if raw or fmt not in ("fp8_ds_mla", "nvfp4_ds_mla") else L + R
    rows = int(cu[-1]) + 4  # rows past cu[-1] stay untouched
    buf = torch.empty(rows + 6, width + dst_pad + dst_col, dtype=dtype)
    if dtype.is_floating_point:
        buf.fill_(float("nan"))
    else:
        buf.view(torch.uint8).fill_(0xFF)
    dst = buf[3:3 + rows, dst_col:dst_col + width]
    return cache, ks, bt, cu, starts, dst, buf, width, num_reqs


def _cpu_gather(fmt, dst_dtype, cache, ks, bt, cu, starts, dst, n):
    if dst_dtype == "raw":
        api.cp_gather_cache(cache, dst, bt, cu, n, starts)
    else:
        api.gather_and_maybe_dequant_cache(cache, dst, bt, cu, n, fmt, ks, starts)


def _check_emulated(emu, seed, fmt, dst_dtype, rounds=0, expect_vector=None, **kw):
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(seed, fmt, dst_dtype, **kw)
    want_buf = buf.clone()
    want = want_buf[3:3 + dst.shape[0], kw.get("dst_col", 0):kw.get("dst_col", 0) + width]
    _cpu_gather(fmt, dst_dtype, cache, ks, bt, cu, starts, want, n)
    name, rows = emulate_gather(emu, cache, dst, bt, cu, n, None if dst_dtype == "raw" else fmt, ks, starts, rounds)
    assert same_bits(buf, want_buf), (name, rows)
    if expect_vector is not None:
        vector_names = ("RawOp<16>", ", 16>", "DsMlaOp<", "Nvfp4Op<")
        assert any(v in name for v in vector_names) == expect_vector, name
    return name


# -- the paged gather, emulated ------------------------------------------------------

@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("B", [1, 16, 64])
def test_emulated_paged_gather_every_format_dense(emu, fmt, B):
    """Dense caches and dst: the 16-byte paths, every dst type, several window heights."""
    for i, dd in enumerate(_dst_dtypes(fmt)):
        for rounds in (1, 2, 8):
            _check_emulated(emu, 100 * B + 10 * i + rounds, fmt, dd, rounds=rounds, B=B, expect_vector=True)


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["strided", "misaligned"])
def test_emulated_paged_gather_strided_and_misaligned(emu, fmt, layout):
    """Views into larger buffers (padded entries and blocks) and caches at odd offsets:
    the 8/4/2/1-byte and one-value fallbacks give the same bits."""
    for i, dd in enumerate(_dst_dtypes(fmt)):
        name = _check_emulated(emu, 7 + i, fmt, dd, layout=layout, B=16)
        if layout == "misaligned":
            assert "RawOp<16>" not in name and ", 16>" not in name and "DsMlaOp<" not in name and "Nvfp4Op<" not in name


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dst_col, dst_pad", [(0, 8), (1, 8), (8, 0)])
def test_emulated_paged_gather_dst_columns(emu, fmt, dst_col, dst_pad):
    """dst as a column slice of a wider poisoned buffer: pad columns stay untouched;
    an odd column offset misaligns every dst row (fallbacks)."""
    for i, dd in enumerate(_dst_dtypes(fmt)):
        _check_emulated(emu, 31 + i, fmt, dd, dst_col=dst_col, dst_pad=dst_pad, B=16)


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_paged_gather_bad_ids_and_offsets(emu, fmt):
    """Out-of-range block ids and logical blocks past the table width give zero rows;
    cu_seq_lens not starting at 0 leaves the rows above it untouched."""
    for i, dd in enumerate(_dst_dtypes(fmt)):
        _check_emulated(emu, 51 + i, fmt, dd, bad_ids=True, B=16, num_reqs=7)
        _check_emulated(emu, 61 + i, fmt, dd, cu_offset=5, B=64, num_reqs=3)


@needs_ext
def test_emulated_paged_gather_non_monotone_cu_seq_lens(emu):
    """Any cu_seq_lens (even decreasing) maps each row to the CPU kernel's request."""
    for fmt in ("fp8", "fp8_ds_mla", "bfloat16"):
        dd = _dst_dtypes(fmt)[0]
        cache, ks, bt, _, starts, dst, buf, width, n = gather_case(5, fmt, dd, num_reqs=4)
        cu = torch.tensor([0, 40, 12, 70, 55], dtype=torch.int32)
        full = torch.empty(86, width, dtype=dst.dtype)
        full.view(torch.uint8).fill_(0xFF)
        want_full = full.clone()
        _cpu_gather(fmt, dd, cache, ks, bt, cu, starts, want_full[3:83], n)
        emulate_gather(emu, cache, full[3:83], bt, cu, n, None if dd == "raw" else fmt, ks, starts)
        assert same_bits(full, want_full)


@needs_ext
@given(
    fmt=st.sampled_from(FORMATS), dst_i=st.integers(0, 3), B=st.sampled_from([1, 3, 16, 64]),
    num_reqs=st.integers(1, 24), layout=st.sampled_from(["dense", "strided", "misaligned"]),
    bad_ids=st.booleans(), dst_col=st.sampled_from([0, 0, 1, 8]), rounds=st.sampled_from([0, 1, 3, 8]),
    seed=st.integers(0, 2**31 - 1),
)
@SETTINGS
def test_emulated_paged_gather_property(emu, fmt, dst_i, B, num_reqs, layout, bad_ids, dst_col, rounds, seed):
    dts = _dst_dtypes(fmt)
    _check_emulated(emu, seed, fmt, dts[dst_i % len(dts)], rounds=rounds, B=B, num_reqs=num_reqs, layout=layout,
                    bad_ids=bad_ids, dst_col=dst_col, dst_pad=8 if dst_col else 0)


@needs_ext
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_emulated_every_fp8_byte(emu, fmt, dst_dtype):
    """All 256 encodings (subnormals, max, NaN) through the vector decode, x k_scale."""
    cache = torch.arange(256, dtype=torch.uint8).repeat(2).reshape(1, 2, 256)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    for scale in (1.0, 0.0173, 3e-39):  # the last makes subnormal products
        ks = torch.tensor([scale])
        got = torch.full((2, 256), float("nan"), dtype=dst_dtype)
        want = got.clone()
        api.gather_and_maybe_dequant_cache(cache, want, bt, cu, 1, fmt, ks)
        name, _ = emulate_gather(emu, cache, got, bt, cu, 1, fmt, ks, None)
        assert ", 16>" in name
        assert same_bits(got, want)


@needs_ext
def test_emulated_huge_row_width_takes_64_bit_indices(emu):
    """A row of more than 2^22 units: 64-bit unit indices, same bits (a small copy of the
    hardening tests' 2^31-byte rows, which run on a GPU)."""
    width = (1 << 22) + 48
    cache = torch.randint(0, 256, (1, 1, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    bt = torch.zeros(1, 1, dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    dst = torch.empty(1, width, dtype=torch.uint8).fill_(0xEE)
    name, rows = emulate_gather(emu, cache, dst, bt, cu, 1, None, None, None)
    assert "RawOp<16>" in name and rows == 1
    assert torch.equal(dst, cache[0])
    out = torch.full((1, width), float("nan"), dtype=torch.bfloat16)
    want = out.clone()
    ks = torch.tensor([0.5])
    api.gather_and_maybe_dequant_cache(cache, want, bt, cu, 1, "fp8", ks)
    emulate_gather(emu, cache, out, bt, cu, 1, "fp8", ks, None)
    assert same_bits(out, want)


@needs_ext
def test_emulated_invalid_device_scale_gives_nan_rows(emu):
    """An unchecked invalid k_scale (as a device scale would be) gives NaN values while
    zero rows stay zero: the CPU kernel's policy (which checks a CPU scale itself)."""
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(9, "fp8", torch.float32, bad_ids=True, num_reqs=8)
    valid = buf.clone()
    _cpu_gather("fp8", torch.float32, cache, ks, bt, cu, starts, valid[3:3 + dst.shape[0], :width], n)
    zero_rows = (valid[3:3 + int(cu[-1]), :width] == 0).all(dim=1)
    assert zero_rows.any() and not zero_rows.all()
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        got_buf = buf.clone()
        emulate_gather(emu, cache, got_buf[3:3 + dst.shape[0], :width], bt, cu, n, "fp8", torch.tensor([bad]), starts)
        live = got_buf[3:3 + int(cu[-1]), :width]
        assert (live[zero_rows] == 0).all() and live[~zero_rows].isnan().all(), bad


# -- the writer, emulated -------------------------------------------------------------

def _write_inputs(seed, fmt, in_dtype, T, R, layout, special):
    """(poisoned base buffer, base -> cache view, kv_c, k_pe, slots) for a write.

    layout: dense cache and inputs; strided: the cache is layer 1 of a padded
    two-layer buffer; misaligned: that, and kv_c / k_pe start one element into
    wider rows (not 16-byte aligned). L is a multiple of 8 or not (the per-tensor
    groups of 8 and their element-wise fallback)."""
    gen = torch.Generator().manual_seed(seed)
    L = 512 if fmt in ("fp8_ds_mla", "nvfp4_ds_mla") else 256 + 3 * (seed % 3)
    if fmt == "nvfp4_ds_mla":
        R = 64
    num_blocks, B = 8, 16
    f = get_format(fmt)
    cache_dtype = in_dtype if f.is_native else torch.uint8
    entry = f.entry_elems(L, R)
    shape = (num_blocks, B, entry) if layout == "dense" else (2, num_blocks, B + 1, entry + 16)
    if cache_dtype == torch.uint8:
        base = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)
    else:
        base = torch.randn(shape, generator=gen).to(cache_dtype)
    cache_of = (lambda b: b) if layout == "dense" else (lambda b: b[1, :, :B, :entry])
    kv_full = (torch.randn(T, L + 9, generator=gen) * 40).to(in_dtype)
    pe_full = (torch.randn(T, R + 9, generator=gen) * 3).to(in_dtype)
    off = 1 if layout == "misaligned" else 0
    kv_c, k_pe = kv_full[:, off:off + L], pe_full[:, off:off + R]
    if special and T:
        kv_c[0, :8] = torch.tensor([0.0, -0.0, 1e-9, 6e4, -6e4, 448.0, 1e-3, -2.5e-8])
        if T > 1:
            kv_c[1, :128] = 1e-30  # a tile at the scale floor (zero in fp16)
        if T > 2 and in_dtype == torch.float32:
            kv_c[2, 3] = 3.0e38  # a huge tile: scale 2^120
    slots = torch.randperm(num_blocks * B + 8, generator=gen)[:T] - 4  # some -ve / past the end
    slots = torch.where(slots < 0, torch.full_like(slots, -1), slots)
    return base, cache_of, kv_c, k_pe, slots


WRITE_FORMATS = ["bfloat16", "float16", "auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla"]


def _writer_cases(fmt, scales):
    """(i, in_dtype, R, scale) for a format: its input dtypes, rope widths and k_scales."""
    in_dtypes = [_model_dtype(fmt)] if get_format(fmt).is_native else [torch.bfloat16, torch.float16, torch.float32]
    for i, in_dtype in enumerate(in_dtypes):
        for R in ((64,) if fmt == "nvfp4_ds_mla" else (64, 0)):
            for scale in scales:
                yield i, in_dtype, R, scale


@needs_ext
@pytest.mark.parametrize("fmt", WRITE_FORMATS)
@pytest.mark.parametrize("layout", ["dense", "strided", "misaligned"])
def test_emulated_writer_matches_cpu(emu, fmt, layout):
    for i, in_dtype, R, scale in _writer_cases(fmt, (1.0, 0.25, 0.0137, 2.0**127, 2.0**-127)):
        seed = 1000 * i + 17 * R + int(abs(np.log2(scale)) * 3)
        base, cache_of, kv_c, k_pe, slots = _write_inputs(seed, fmt, in_dtype, 37, R, layout, True)
        ks = torch.tensor([scale], dtype=torch.float32)
        want = base.clone()
        api.concat_and_cache_mla(kv_c, k_pe, cache_of(want), slots, fmt, ks)
        got = base.clone()
        emulate_write(emu, kv_c, k_pe, cache_of(got), slots.to(torch.int32 if i % 2 else torch.int64), fmt, ks)
        assert same_bits(got, want), (fmt, in_dtype, R, scale)


@needs_ext
@given(fmt=st.sampled_from(["fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla", "bfloat16"]),
       in_i=st.integers(0, 2), T=st.integers(0, 70), layout=st.sampled_from(["dense", "strided", "misaligned"]),
       seed=st.integers(0, 2**31 - 1))
@SETTINGS
def test_emulated_writer_property(emu, fmt, in_i, T, layout, seed):
    in_dtype = torch.bfloat16 if fmt == "bfloat16" else [torch.bfloat16, torch.float16, torch.float32][in_i]
    base, cache_of, kv_c, k_pe, slots = _write_inputs(seed, fmt, in_dtype, T, 64, layout, seed % 2 == 0)
    ks = torch.tensor([0.031], dtype=torch.float32)
    want = base.clone()
    api.concat_and_cache_mla(kv_c, k_pe, cache_of(want), slots, fmt, ks)
    got = base.clone()
    emulate_write(emu, kv_c, k_pe, cache_of(got), slots, fmt, ks)
    assert same_bits(got, want)


@needs_ext
def test_emulated_writer_infinities_and_nan(emu):
    """Non-finite inputs: the reciprocal multiply keeps the division's results (an
    infinite tile amax gives an infinite scale, x * 0 == x / inf)."""
    for fmt in ("fp8_ds_mla", "fp8", "nvfp4_ds_mla"):
        base, cache_of, kv_c, k_pe, slots = _write_inputs(3, fmt, torch.float32, 6, 64, "dense", False)
        kv_c[0, 5] = float("inf")
        kv_c[1, 7] = float("-inf")
        kv_c[2, 9] = float("nan")
        k_pe[3, 1] = float("nan")
        slots = torch.arange(6)
        ks = torch.tensor([0.5])
        want = base.clone()
        api.concat_and_cache_mla(kv_c, k_pe, cache_of(want), slots, fmt, ks)
        got = base.clone()
        emulate_write(emu, kv_c, k_pe, cache_of(got), slots, fmt, ks)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), fmt


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("L, R, off", [(512, 64, 0), (512, 64, 1), (100, 7, 0), (5000, 64, 0), (9000, 3, 1)])
def test_emulated_kv_scale_matches_cpu(emu, dtype, L, R, off):
    gen = torch.Generator().manual_seed(L + R + off)
    kv_full = (torch.randn(41, L + 3, generator=gen) * 7).to(dtype)
    pe_full = (torch.randn(41, R + 3, generator=gen) * 20).to(dtype)
    kv_c, k_pe = kv_full[:, off:off + L], pe_full[:, off:off + R]
    kv_c[2, 1] = float("inf")  # ignored
    k_pe[5, 0] = float("nan")  # ignored
    kv_c[40, L - 1] = -900.0  # the amax, in the last chunk's tail
    for fmt, fmax in (("fp8", 448.0), ("fp8_e5m2", 57344.0)):
        want = float(api.compute_kv_scale(kv_c, k_pe, fmt))
        es = kv_c.element_size()
        got = emu.mla_emulate_kv_scale(_ptr(kv_c), kv_c.stride(0) * es, _ptr(k_pe), k_pe.stride(0) * es,
                                       ELEM[dtype], kv_c.size(0), L, R, fmax)
        assert np.float32(got).tobytes() == np.float32(want).tobytes()


# -- x * (1 / 2^k) == x / 2^k ------------------------------------------------------------

def _adversarial_floats(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)  # every bit pattern
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 3.0, 448.0, 464.0, 480.0,
                        np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                        np.finfo(np.float32).tiny * 3, 1e-45, -1e-45, 3e-45, 1.5, 2.5, 0.75], dtype=np.float32)
    # Values whose quotient is exactly half an ulp of a subnormal (ties to even).
    ties = (np.arange(1, 64, dtype=np.float32) * np.float32(2.0**-149) * np.float32(2.0**20)).astype(np.float32)
    return np.concatenate([x, special, ties, -ties])


def _same_float_bits(a: np.ndarray, b: np.ndarray) -> bool:
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32)))


@needs_ext
def test_reciprocal_multiply_is_division_for_powers_of_two(emu):
    """pow2_reciprocal (csrc/cache/write_lanes.h): for every normal power of two s
    (and +inf) x * (1 / s) has the bits of x / s, over every float bit pattern class;
    for anything else the helper refuses and the division runs."""
    x = _adversarial_floats(20000, 1)
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        for k in range(-149, 128):
            s = np.float32(2.0**k)
            used = emu.mla_scaled_division(x.ctypes.data, float(s), out.ctypes.data, x.size)
            assert used == (k >= -126), k  # subnormal powers of two are refused
            assert _same_float_bits(out, x / s), k
            # Independently of the helper: IEEE multiply by the exact reciprocal.
            inv = np.float32(1.0) / s
            if k >= -126:
                assert inv == np.float32(2.0**-k)
                assert _same_float_bits(x * inv, x / s), k
        used = emu.mla_scaled_division(x.ctypes.data, float("inf"), out.ctypes.data, x.size)
        assert used == 1 and _same_float_bits(out, x / np.float32(np.inf))
        for s in (0.0137, 3.0, 0.75, 1e-40, -2.0, float("nan"), 0.0):
            assert emu.mla_scaled_division(x.ctypes.data, s, out.ctypes.data, x.size) == 0
            assert _same_float_bits(out, x / np.float32(s))


def test_torch_division_by_power_of_two_is_multiplication():
    """The claim behind the reciprocal multiply, in torch float32 (the reference's
    arithmetic): x / 2^k == x * 2^-k bit for bit, for k in [-126, 127]."""
    x = torch.from_numpy(_adversarial_floats(4096, 2))
    for k in range(-126, 128):
        s = torch.tensor(2.0**k, dtype=torch.float32)
        a, b = x / s, x * (1.0 / s)
        assert same_bits(a, b), k


# -- the dispatcher ----------------------------------------------------------------------

def test_dispatchers_list_cuda_then_cpu_then_triton():
    assert [b.name for b in api.GATHER.backends] == ["cuda_paged", "cpu", "triton_paged"]
    assert [b.name for b in api.WRITE.backends] == ["cuda_vector", "cpu", "triton"]
    assert [b.name for b in api.KV_SCALE.backends] == ["cuda_vector", "cpu", "triton"]
    inp = api._probe_inputs(torch.device("cpu"))["gather"][1]
    why = api.GATHER.reasons_by_backend(inp)
    assert why["cuda_paged"]  # CPU tensors: it says why not
    if _ext.available():
        assert why["cpu"] == []
        assert "uses 'cpu'" in api.explain("gather", inp)
    with api.GATHER.force("cuda_paged"):
        assert "forced" in api.explain("gather", inp) and "cuda_paged" in api.explain("gather", inp)


# -- the Triton paged gather in the interpreter ------------------------------------------

needs_triton = pytest.mark.skipif(tg.triton is None, reason="triton is not installed")


def _triton_exact_case(seed, fmt, dst_dtype, device="cpu", **kw):
    # A power-of-two k_scale: every product is exact in bf16/fp16 as well (the
    # interpreter's fp32 -> 16-bit stores truncate; exact values are unaffected).
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(seed, fmt, dst_dtype,
                                                                k_scale=torch.tensor([0.25]), **kw)
    want_buf = buf.clone()
    col = kw.get("dst_col", 0)
    want = want_buf[3:3 + dst.shape[0], col:col + width]
    if dst_dtype == "raw":
        ref.cp_gather_ref(cache, want, bt, cu, n, starts)
    else:
        ref.gather_ref(cache, want, bt, cu, n, fmt, ks, starts)
    if device != "cpu":
        buf = buf.to(device)
        dst = buf[3:3 + dst.shape[0], col:col + width]
        cache = strided_copy(cache, device)
        bt, cu, starts, ks = (t.to(device) for t in (bt, cu, starts, ks))
    tg.gather_triton(cache, dst, bt, cu, n, fmt, ks, starts)
    assert same_bits(buf.cpu(), want_buf)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_paged_matches_reference_bit_exactly(fmt):
    for i, dd in enumerate(_dst_dtypes(fmt)):
        for layout in ("dense", "strided"):
            _triton_exact_case(200 + i, fmt, dd, B=16, layout=layout, bad_ids=i % 2 == 1,
                               dst_col=8 if i == 2 else 0, dst_pad=8 if i == 2 else 0)


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla", "fp8", "bfloat16"])
def test_triton_paged_odd_layouts(fmt):
    """Block size 1 and 64, odd byte offsets (the ds_mla byte path), cu not at 0."""
    for B in (1, 64):
        _triton_exact_case(300 + B, fmt, _dst_dtypes(fmt)[-2 if len(_dst_dtypes(fmt)) > 1 else 0], B=B,
                           cu_offset=3, num_reqs=6)
    if fmt != "bfloat16":
        _triton_exact_case(333, fmt, torch.float32, B=16, layout="misaligned")


@needs_triton
def test_triton_paged_through_the_dispatcher():
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(11, "nvfp4_ds_mla", torch.float32)
    inp = api.GatherInputs(cache, dst, bt, cu, n, "nvfp4_ds_mla", ks, starts)
    reasons = api.GATHER.get("triton_paged").not_supported_reasons(inp)
    if reasons:
        pytest.skip("; ".join(reasons))
    want_buf = buf.clone()
    ref.gather_ref(cache, want_buf[3:3 + dst.shape[0], :width], bt, cu, n, "nvfp4_ds_mla", ks, starts)
    with api.GATHER.force("triton_paged"):
        assert "uses 'triton_paged'" in api.explain("gather", inp)
        api.gather_and_maybe_dequant_cache(cache, dst, bt, cu, n, "nvfp4_ds_mla", ks, starts)
    assert same_bits(buf, want_buf)


@needs_triton
def test_triton_paged_launch_runs_under_the_device_guard(monkeypatch):
    """As every Triton launch (tests/errors/test_raw_op_bounds.py): the paged kernel is
    launched inside launch_guard (on the CPU: torch.cuda.device(-1), a no-op)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors reach the Triton gather only under the interpreter")
    entered, launches, depth = [], [], [0]

    class Guard:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            depth[0] += 1
            entered.append(self.dev)

        def __exit__(self, *exc):
            depth[0] -= 1

    class Fake:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(depth[0])

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(tg, "_gather_paged_kernel", Fake())
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(3, "fp8", torch.float32)
    tg.gather_triton(cache, dst, bt, cu, n, "fp8", ks, starts)
    assert launches == [1] and entered == [-1]


_AOT_SCRIPT = r"""
import inspect, os, re, subprocess, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from mla_ext.cache import triton_gather as tg

try:
    from triton import knobs
    ptxas = knobs.nvidia.ptxas.path
except Exception:
    ptxas = None
src = open(tg.__file__).read().splitlines()
line = next(i for i, l in enumerate(src) if "def _gather_paged_kernel(" in l)
budget = int(re.match(r"\s*# register budget: (\d+)", src[line - 2]).group(1))
params = list(inspect.signature(tg._gather_paged_kernel.fn).parameters)
# (MODE, src, dst, ALIGNED): copies, per-tensor fp8, fp8_ds_mla, nvfp4_ds_mla.
cases = [(0, "bf16", "bf16", False), (0, "u8", "u8", False), (1, "u8", "bf16", False), (2, "u8", "fp16", False),
         (1, "u8", "fp32", False), (3, "u8", "bf16", True), (3, "u8", "fp32", True), (3, "u8", "bf16", False),
         (4, "u8", "bf16", False), (4, "u8", "fp32", False)]
out_bytes = {"bf16": 2, "fp16": 2, "fp32": 4, "u8": 1}
regs_seen = []
for cap in (86, 90):
    for dst_rows in (4096, 65536):  # both tile heights gather_triton uses on a GPU
        for mode, s, d, aligned in cases:
            rows, block_c, tail_c, warps = tg._paged_tiles(mode, out_bytes[d], 576, dst_rows)
            sig = {p: "i32" for p in params}
            sig.update(src_ptr="*" + s, src_f32_ptr="*fp32", src_bf16_ptr="*bf16", dst_ptr="*" + d,
                       bt_ptr="*i32", cu_ptr="*i32", starts_ptr="*i32", scale_ptr="*fp32")
            consts = dict(MODE=mode, HAS_STARTS=True, ALIGNED=aligned, HW_FP8=cap >= 89, BLOCK_R=rows,
                          BLOCK_C=block_c, TAIL_C=tail_c, s_col=1, d_col=1, bt_s1=1)
            sig.update({k: "constexpr" for k in consts})
            div16 = ["src_ptr", "src_f32_ptr", "src_bf16_ptr", "dst_ptr", "bt_ptr", "cu_ptr", "starts_ptr",
                     "scale_ptr", "s_blk", "s_ent", "d_row", "n_cols"]
            k = triton.compile(ASTSource(
                fn=tg._gather_paged_kernel, signature=sig,
                constexprs={(params.index(n),): v for n, v in consts.items()},
                attrs={(params.index(n),): [["tt.divisibility", 16]] for n in div16}),
                target=GPUTarget("cuda", cap, 32), options=dict(num_warps=warps))
            ptx = k.asm["ptx"]
            lines = ptx.splitlines()
            tag = (cap, dst_rows, mode, s, d, aligned)
            # 16-byte vectors for the row payload; byte loads only on the unaligned ds path.
            assert any("ld.global.v4" in l for l in lines) and any("st.global.v4" in l for l in lines), tag
            if aligned or mode != 3:
                assert not any(re.search(r"ld\.global(\.\w+)*\.(b8|u8)\b", l) for l in lines), tag
            # Every load of the tile comes before the first store (in program order).
            first_st = next(i for i, l in enumerate(lines) if "st.global" in l)
            assert max(i for i, l in enumerate(lines) if "ld.global" in l) < first_st, tag
            # Four 16-byte loads per thread for a 512-byte fp8 chunk into 16-bit outputs.
            if s == "u8" and d in ("bf16", "fp16") and mode in (1, 2, 3):
                assert sum("ld.global.v4" in l for l in lines) >= 4, tag
            # sm_90: the hardware fp8 conversion; sm_86: none (integer decode).
            cvt = any("cvt.rn.f16x2.e4m3x2" in l or "cvt.rn.f16x2.e5m2x2" in l for l in lines)
            assert cvt == (cap >= 89 and mode != 0), tag
            if ptxas:
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                    f.write(ptx)
                arch = "sm_90a" if cap == 90 else "sm_86"
                r = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull],
                                   capture_output=True, text=True)
                os.unlink(f.name)
                rep = r.stdout + r.stderr
                regs = int(re.search(r"Used (\d+) registers", rep).group(1))
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep).groups()
                assert spills == ("0", "0") and regs <= budget, (tag, regs, spills, budget)
                regs_seen.append(regs)
print("ok", min(regs_seen or [0]), max(regs_seen or [0]))
"""


@needs_triton
def test_triton_paged_kernel_compiles_for_sm86_and_sm90():
    """Ahead-of-time compile (no GPU needed) of every mode for both targets with
    gather_triton's launch configs; checks the PTX (16-byte vectors, loads before
    stores, hardware fp8 conversion on sm_90 only) and ptxas's report (no spills,
    registers within the kernel's stated budget)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# -- on a GPU: the real kernels ----------------------------------------------------------

def _cuda_case(seed, fmt, dst_dtype, backend, **kw):
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(seed, fmt, dst_dtype, **kw)
    want_buf = buf.clone()
    col = kw.get("dst_col", 0)
    _cpu_gather(fmt, dst_dtype, cache, ks, bt, cu, starts, want_buf[3:3 + dst.shape[0], col:col + width], n)
    gbuf = buf.cuda()
    gdst = gbuf[3:3 + dst.shape[0], col:col + width]
    gcache = strided_copy(cache, "cuda")
    with api.GATHER.force(backend):
        _cpu_gather(fmt, dst_dtype, gcache, ks.cuda(), bt.cuda(), cu.cuda(), starts.cuda(), gdst, n)
    assert same_bits(gbuf.cpu(), want_buf), (fmt, dst_dtype, backend, kw)


@needs_ext
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_gather_matches_cpu_every_format(fmt):
    backend = "cuda_paged"
    for i, dd in enumerate(_dst_dtypes(fmt)):
        for B in (1, 16, 64):
            _cuda_case(400 + 10 * i + B, fmt, dd, backend, B=B)
        for layout in ("strided", "misaligned"):
            _cuda_case(500 + i, fmt, dd, backend, layout=layout)
        _cuda_case(600 + i, fmt, dd, backend, bad_ids=True, num_reqs=7)
        _cuda_case(700 + i, fmt, dd, backend, dst_col=1, dst_pad=8, cu_offset=5)


@needs_ext
@pytest.mark.cuda
@given(fmt=st.sampled_from(FORMATS), dst_i=st.integers(0, 3), B=st.sampled_from([1, 3, 16, 64]),
       num_reqs=st.integers(1, 40), layout=st.sampled_from(["dense", "strided", "misaligned"]),
       bad_ids=st.booleans(), dst_col=st.sampled_from([0, 1, 8]), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_cuda_paged_property(fmt, dst_i, B, num_reqs, layout, bad_ids, dst_col, seed):
    dts = _dst_dtypes(fmt)
    _cuda_case(seed, fmt, dts[dst_i % len(dts)], "cuda_paged", B=B, num_reqs=num_reqs, layout=layout,
               bad_ids=bad_ids, dst_col=dst_col, dst_pad=8 if dst_col else 0)


@needs_ext
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WRITE_FORMATS)
@pytest.mark.parametrize("layout", ["dense", "strided", "misaligned"])
def test_cuda_writer_matches_cpu(fmt, layout):
    backend = "cuda_vector"
    for i, in_dtype, R, scale in _writer_cases(fmt, (1.0, 0.25, 0.0137)):
        base, cache_of, kv_c, k_pe, slots = _write_inputs(31 * i + R, fmt, in_dtype, 300, R, layout, True)
        ks = torch.tensor([scale], dtype=torch.float32)
        want = base.clone()
        api.concat_and_cache_mla(kv_c, k_pe, cache_of(want), slots, fmt, ks)
        got = base.cuda()
        with api.WRITE.force(backend):
            api.concat_and_cache_mla(strided_copy(kv_c, "cuda"), strided_copy(k_pe, "cuda"), cache_of(got),
                                     slots.cuda(), fmt, ks.cuda())
        assert same_bits(got.cpu(), want), (fmt, in_dtype, R, scale)


@needs_ext
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kv_scale_matches_cpu(dtype):
    backend = "cuda_vector"
    gen = torch.Generator().manual_seed(5)
    kv_full = (torch.randn(333, 5003, generator=gen) * 7).to(dtype)
    kv_c, k_pe = kv_full[:, 1:5001], (torch.randn(333, 64, generator=gen) * 20).to(dtype)
    kv_c[2, 1] = float("inf")
    k_pe[5, 3] = float("nan")
    want = api.compute_kv_scale(kv_c, k_pe, "fp8")
    with api.KV_SCALE.force(backend):
        got = api.compute_kv_scale(strided_copy(kv_c, "cuda"), k_pe.cuda(), "fp8").cpu()
    assert torch.equal(got, want)


@needs_ext
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla", "nvfp4_ds_mla", "bfloat16"])
def test_cuda_paged_gather_is_graph_capturable(fmt):
    """No host sync: captured once, replayed with a new block table."""
    cache, ks, bt, cu, starts, dst, buf, width, n = gather_case(4, fmt, _dst_dtypes(fmt)[0], B=16, num_reqs=4)
    dd = _dst_dtypes(fmt)[0]
    gcache, gbt, gcu, gst, gks = cache.cuda(), bt.cuda(), cu.cuda(), starts.cuda(), ks.cuda()
    gdst = torch.empty(dst.shape, dtype=dst.dtype, device="cuda")
    with api.GATHER.force("cuda_paged"):
        _cpu_gather(fmt, dd, gcache, gks, gbt, gcu, gst, gdst, n)  # warm-up
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _cpu_gather(fmt, dd, gcache, gks, gbt, gcu, gst, gdst, n)
    gbt.copy_(gbt.flip(1))
    gdst.fill_(0)
    g.replay()
    torch.cuda.synchronize()
    want = torch.zeros(dst.shape, dtype=dst.dtype)
    _cpu_gather(fmt, dd, cache, ks, bt.flip(1).contiguous(), cu, starts, want, n)
    assert same_bits(gdst.cpu(), want)


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_triton_paged_matches_reference(fmt):
    for i, dd in enumerate(_dst_dtypes(fmt)):
        _triton_exact_case(800 + i, fmt, dd, device="cuda", B=16, bad_ids=True)
        _triton_exact_case(900 + i, fmt, dd, device="cuda", B=64, layout="strided")


def test_emulator_source_lists_its_entry_points():
    """The emulator's exported functions are the ones this file binds."""
    src = open(EMU_SRC).read()
    for fn in ("mla_emulate_paged_gather", "mla_emulate_write", "mla_emulate_kv_scale", "mla_scaled_division"):
        assert f" {fn}(" in src
    assert inspect.getsource(emulate_gather)  # keeps the helper referenced


@needs_ext
@pytest.mark.parametrize("case", ["empty_requests", "negative_starts", "many_short", "walk_limit", "far_disorder"])
def test_emulated_paged_gather_mapping_walk(emu, case):
    """The window walk (one search per window, a block-table load per page) gives the CPU
    kernel's rows: zero-length requests, contexts starting before 0, a request per row,
    more requests than a window checks (per-row mapping), and a cu_seq_lens whose only
    decrease is far from the rows (per-row mapping too: the searches pass through it)."""
    rng = random.Random(hash(case) & 0xFFFF)
    for fmt, B in (("bfloat16", 1), ("bfloat16", 16), ("fp8", 3), ("fp8_ds_mla", 64)):
        dd = _dst_dtypes(fmt)[0]
        cache, ks, _, _, _, _, _, width, _ = gather_case(7, fmt, dd, B=B)
        nb = cache.shape[0]
        n = {"empty_requests": 40, "negative_starts": 9, "many_short": 300, "walk_limit": 2100,
             "far_disorder": 600}[case]
        if case == "empty_requests":
            lens = [rng.choice([0, 0, 0, 1, 5, 37]) for _ in range(n)]
        elif case in ("many_short", "walk_limit"):
            lens = [rng.choice([0, 1, 1, 2]) for _ in range(n)]
        else:
            lens = [rng.randint(0, 90) for _ in range(n)]
        cu_l = [0]
        for x in lens:
            cu_l.append(cu_l[-1] + x)
        if case == "far_disorder":
            cu_l[n // 3 + 7] = cu_l[3 * n // 4]  # one entry far too large; the rest non-decreasing
        cu = torch.tensor(cu_l, dtype=torch.int32)
        lo = -40 if case == "negative_starts" else 0
        starts = torch.tensor([rng.randint(lo, 3 * B) for _ in range(n)], dtype=torch.int32)
        width_bt = max(1, (max(lens) + 3 * B) // B)
        bt = torch.tensor([[rng.randint(-1, nb) if rng.random() < 0.1 else rng.randint(0, nb - 1)
                            for _ in range(width_bt)] for _ in range(n)], dtype=torch.int32)
        rows = max(cu_l[-1], 1) + 4
        dtype = cache.dtype if dd == "raw" else dd
        full = torch.empty(rows + 6, width, dtype=dtype)
        full.view(torch.uint8).fill_(0xFF)
        want_full = full.clone()
        _cpu_gather(fmt, dd, cache, ks, bt, cu, starts, want_full[3:3 + rows], n)
        emulate_gather(emu, cache, full[3:3 + rows], bt, cu, n, None if dd == "raw" else fmt, ks, starts)
        assert same_bits(full, want_full), (case, fmt, B)
