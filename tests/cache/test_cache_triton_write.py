"""Triton cache writer and KV-scale kernel (mla_ext/cache/triton_write.py): the same
bytes as the CPU writer in every cache format.

Runs under the Triton interpreter on the CPU (conftest sets TRITON_INTERPRET). The
kernel encodes fp8/e2m1 with integer operations, so the interpreter's wrong
fp32 -> fp8 casts cannot touch it: the check is byte equality with the CPU
backend, on random data that also hits saturation, subnormals, -0.0, ties and
non-finite values, with padding and out-of-range slots and a strided cache view.
"""
from __future__ import annotations

import pytest
import torch

from mla_ext.cache import api
from mla_ext.cache import reference as ref
from mla_ext.config.formats import get_format

triton = pytest.importorskip("triton")

FORMATS = ["auto", "bfloat16", "float16", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _values(T: int, n: int, dtype, gen) -> torch.Tensor:
    """Random rows with wide magnitudes and a sprinkle of special values."""
    x = torch.randn(T, n, generator=gen) * torch.exp2(torch.randint(-14, 10, (T, 1), generator=gen).float())
    flat = x.view(-1)
    k = flat.numel()
    idx = torch.randperm(k, generator=gen)
    specials = [0.0, -0.0, 1e-8, -3e-6, 448.0, -464.0, 1e5, 2.0**-10, 0.25, 0.75, 5.0, -2.5]
    for j, v in enumerate(specials[:k]):
        flat[idx[j]] = v
    return x.to(dtype)


def _with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 3] = float("nan")
    if x.shape[0] > 2:
        x[2, 7] = float("inf")
    return x


def _cache(fmt_name, dtype, num_blocks, B, L, R, gen, strided):
    fmt = get_format(fmt_name)
    entry = fmt.entry_elems(L, R)
    cdtype = fmt.storage_dtype(dtype)
    if strided:  # a view into a bigger buffer: padded entries and blocks
        buf = torch.zeros(num_blocks + 1, B + 1, entry + 16, dtype=cdtype)
        cache = buf[1:, 1:, :entry]
    else:
        cache = torch.zeros(num_blocks, B, entry, dtype=cdtype)
    raw = cache.view(torch.uint8) if cdtype.itemsize == 1 else cache
    raw.copy_(torch.randint(0, 255, raw.shape, generator=gen).to(raw.dtype))  # poison
    return cache


def _write(backend, kv_c, k_pe, cache, slots, name, scale):
    out = cache.clone() if cache.is_contiguous() else None
    if out is None:  # keep the view's strides: clone the base and re-slice
        base = cache._base.clone()
        out = base[1:, 1:, :cache.shape[2]]
    with api.WRITE.force(backend):
        api.concat_and_cache_mla(kv_c, k_pe, out, slots, name, scale)
    return out


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int8)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_writer_bytes_equal_cpu(name, dtype):
    fmt = get_format(name)
    if fmt.storage in ("bfloat16", "float16") and fmt.storage_dtype(dtype) != dtype:
        pytest.skip(f"{name} takes {fmt.storage} inputs only")
    gen = torch.Generator().manual_seed(hash((name, str(dtype))) % 2**31)
    L, R = (512, 64) if fmt.fixed_entry_bytes else (96, 32)
    T, num_blocks, B = 7, 3, 4
    kv_c = _values(T, L, dtype, gen)
    k_pe = _values(T, R, dtype, gen)
    if fmt.is_quantized:
        kv_c, k_pe = _with_nonfinite(kv_c), _with_nonfinite(k_pe)
    slots = torch.tensor([5, -1, 0, 11, 12, 3, 7], dtype=torch.int64)  # -1: padding, 12: past the end
    scale = torch.tensor([0.37], dtype=torch.float32)
    for strided in (False, True):
        cache = _cache(name, dtype, num_blocks, B, L, R, gen, strided)
        want = _write("cpu", kv_c, k_pe, cache, slots, name, scale)
        got = _write("triton", kv_c, k_pe, cache, slots, name, scale)
        assert torch.equal(_bytes(got), _bytes(want)), (name, dtype, strided)


@pytest.mark.parametrize("R", [0, 64])
def test_ds_mla_rope_width_and_int32_slots(R):
    gen = torch.Generator().manual_seed(R)
    kv_c = _values(3, 512, torch.bfloat16, gen)
    k_pe = _values(3, R, torch.bfloat16, gen)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    cache = _cache("fp8_ds_mla", torch.bfloat16, 1, 4, 512, R, gen, False)
    scale = torch.ones(1)
    want = _write("cpu", kv_c, k_pe, cache, slots, "fp8_ds_mla", scale)
    got = _write("triton", kv_c, k_pe, cache, slots, "fp8_ds_mla", scale)
    assert torch.equal(got, want)


def test_writer_matches_the_oracle():
    """Not only the CPU kernel: the Python reference agrees on written rows."""
    gen = torch.Generator().manual_seed(3)
    kv_c, k_pe = _values(4, 512, torch.float32, gen), _values(4, 64, torch.float32, gen)
    for name in ("fp8", "fp8_ds_mla", "nvfp4_ds_mla"):
        cache = torch.zeros(1, 4, get_format(name).entry_elems(512, 64), dtype=torch.uint8)
        slots = torch.arange(4)
        scale = torch.tensor([0.5])
        got = _write("triton", kv_c, k_pe, cache, slots, name, scale)
        want = cache.clone()
        ref.concat_and_cache_mla_ref(kv_c, k_pe, want, slots, name, scale)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 37])
def test_triton_kv_scale_equals_cpu(name, dtype, T):
    gen = torch.Generator().manual_seed(T)
    kv_c = _values(T, 96, dtype, gen) if T else torch.zeros(0, 96, dtype=dtype)
    k_pe = _values(T, 32, dtype, gen) if T else torch.zeros(0, 32, dtype=dtype)
    if T > 3:
        kv_c = _with_nonfinite(kv_c)
    with api.KV_SCALE.force("cpu"):
        want = api.compute_kv_scale(kv_c, k_pe, name)
    with api.KV_SCALE.force("triton"):
        got = api.compute_kv_scale(kv_c, k_pe, name)
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got, want)


def test_triton_comes_after_cuda_and_cpu_in_the_stated_order():
    for disp in (api.WRITE, api.KV_SCALE):
        names = [b.name for b in disp.backends]
        assert names.index("triton") > names.index("cuda_vector")
        assert names.index("triton") > names.index("cpu")
