"""Raw ops and kernels refuse or survive out-of-range inputs found by fuzzing and by a
static review, one test (or a few) per input.

- 64-bit row sizes: rows of >= 2^31 bytes or elements (cp_gather, fp8 gather,
  compute_kv_scale) used to wrap an int32 size (SIGSEGV, or a 1e-12 scale),
  and format_info wrapped L, R.
- Overlapping arguments: outputs that share memory with an input, or whose own
  rows overlap, are ValueErrors naming both arguments (public API and raw ops).
- Raw ops check k_scale values on the host when the scale is a CPU tensor; a
  device scale is never read on the host and an invalid one gives NaN.
- Every tensor argument of a raw op on one device; the fake kernels reject a
  meta tensor mixed with real ones (the op would otherwise silently do nothing).
- Triton kernels compute row offsets in int64 (int32 products wrapped and wrote
  ~4 GiB before `out`).
- Every Triton launch runs under its tensors' CUDA device.

Tensors of 2^31+ bytes are allocated with torch.empty: the kernel reads of
untouched pages map the shared zero page, so only what a test writes is
committed. The tests that write a 2-4 GiB row skip when less memory is free.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from mla_ext import _ext
from mla_ext.attention import merge_attn_states
from mla_ext.cache import api, checks

needs_ext = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

BIG = 2**31


def _mem_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def needs_free_gib(gib: float):
    return pytest.mark.skipif(_mem_available_gib() < gib, reason=f"needs {gib} GiB of free memory")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _lazy_zeros(*shape, dtype, device):
    """Zeros: on the CPU torch.empty's fresh pages (committed only when written),
    on a GPU real zeros."""
    if device == "cpu":
        return torch.empty(*shape, dtype=dtype)
    return torch.zeros(*shape, dtype=dtype, device=device)


def _one_request(device="cpu"):
    bt = torch.tensor([[0]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    return bt, cu


# ---------------------------------------------------------------------------
# 64-bit sizes
# ---------------------------------------------------------------------------

@needs_ext
@needs_free_gib(6)
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("via", ["raw", "api"])
def test_cp_gather_row_of_2_31_bytes(via, device):
    """A 2^31-byte row: the copy and the zero row of an out-of-range block both
    move exactly 2^31 bytes (the int32 size was negative: SIGSEGV)."""
    run = torch.ops.mla_ext.cp_gather_cache if via == "raw" else api.cp_gather_cache
    bt, cu = _one_request(device)
    marks = [0, 12345, BIG // 2 + 7, BIG - 1]
    # Block 0 exists: the row is copied.
    cache = _lazy_zeros(1, 1, BIG, dtype=torch.uint8, device=device)
    for i, v in zip(marks, (3, 5, 7, 9)):
        cache[0, 0, i] = v
    dst = torch.empty(1, BIG, dtype=torch.uint8, device=device)
    dst[0, 0], dst[0, -1] = 0xAB, 0xCD
    run(cache, dst, bt, cu, 1)
    assert [int(dst[0, i]) for i in marks] == [3, 5, 7, 9]
    assert int(dst[0, 1]) == 0 and int(dst[0, BIG - 2]) == 0
    del cache
    # No block at all: the row is zero-filled, all 2^31 bytes of it.
    empty = torch.empty(0, 1, BIG, dtype=torch.uint8, device=device)
    for i in marks:
        dst[0, i] = 0x5A
    run(empty, dst, bt, cu, 1)
    assert [int(dst[0, i]) for i in marks] == [0, 0, 0, 0]


@needs_ext
@needs_free_gib(8)
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gather_into_2_31_element_bf16_row(device):
    """fp8 -> bf16 with a 2^31-element row (4 GiB): every element is written."""
    bt, cu = _one_request(device)
    cache = _lazy_zeros(1, 1, BIG, dtype=torch.uint8, device=device)
    marks = {0: 0x38, 99: 0xB8, BIG - 1: 0x40}  # e4m3 1.0, -1.0, 2.0
    for i, v in marks.items():
        cache[0, 0, i] = v
    dst = torch.empty(1, BIG, dtype=torch.bfloat16, device=device)
    dst[0, 0], dst[0, 1], dst[0, -1] = math.nan, math.nan, math.nan
    scale = torch.tensor([0.5], device=device)
    torch.ops.mla_ext.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 1, "fp8", scale)
    assert [float(dst[0, i]) for i in marks] == [0.5, -0.5, 1.0]
    assert float(dst[0, 1]) == 0.0  # an untouched (zero) cache byte
    del cache
    empty = torch.empty(0, 1, BIG, dtype=torch.uint8, device=device)
    dst[0, 0], dst[0, -1] = math.nan, math.nan
    torch.ops.mla_ext.gather_and_maybe_dequant_cache(empty, dst, bt, cu, 1, "fp8", scale)
    assert float(dst[0, 0]) == 0.0 and float(dst[0, -1]) == 0.0


@needs_ext
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_compute_kv_scale_of_2_31_element_rows(device):
    """kv_c [1, 2^31] (on the CPU virtual: only the written pages are committed):
    the amax is found past the int32 range (the truncated width returned 1e-12)."""
    kv_c = _lazy_zeros(1, BIG, dtype=torch.bfloat16, device=device)
    kv_c[0, 3] = 5.0
    kv_c[0, BIG - 1] = -896.0  # the amax: 896 / 448 = 2
    k_pe = torch.full((1, 64), 0.25, dtype=torch.bfloat16, device=device)
    s = torch.ops.mla_ext.compute_kv_scale(kv_c, k_pe, "fp8")
    assert float(s) == 2.0


@needs_ext
@pytest.mark.parametrize("name,L,R", [
    ("fp8_ds_mla", 2**32 + 512, 64), ("fp8_ds_mla", 512, 2**32 + 64), ("auto", 2**32 + 512, 64),
    ("fp8", BIG, 0), ("bfloat16", 512, BIG - 512),
])
def test_format_info_takes_64_bit_dims(name, L, R):
    from mla_ext.config.formats import get_format

    f = get_format(name)
    got = list(_ext.ops().format_info(name, L, R, 2))
    want_bpt = f.bytes_per_token(L, R, torch.bfloat16) if f.supports_dims(L, R) else -1
    assert got[1] == want_bpt
    if f.supports_dims(L, R):
        assert got[5] == f.entry_elems(L, R)


@needs_ext
def test_format_info_rejects_dims_it_cannot_represent():
    with pytest.raises(ValueError, match="L: expected"):
        _ext.ops().format_info("auto", 2**62, 0, 4)
    with pytest.raises(ValueError, match="R: expected"):
        _ext.ops().format_info("auto", 512, -(2**62), 4)


# ---------------------------------------------------------------------------
# Overlapping arguments
# ---------------------------------------------------------------------------

def _merge_inputs(t=5, n=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    o1, o2 = (torch.randn(t, n, d, generator=g) for _ in range(2))
    l1, l2 = (torch.randn(n, t, generator=g) for _ in range(2))
    return o1, l1, o2, l2


def test_merge_out_shifted_over_an_input_is_an_error():
    """out=buf[1:6] with o1=buf[:5]: rows would be read after being overwritten."""
    _, l1, o2, l2 = _merge_inputs()
    buf = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match=r"out.*o1|o1.*out"):
        merge_attn_states(buf[:5], l1, o2, l2, out=buf[1:6])
    with pytest.raises(ValueError, match=r"out.*o2|o2.*out"):
        merge_attn_states(o2, l1, buf[:5], l2, out=buf[1:6])


def test_merge_out_lse_overlapping_an_lse_is_an_error():
    o1, _, o2, l2 = _merge_inputs()
    lbuf = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"out_lse.*lse1|lse1.*out_lse"):
        merge_attn_states(o1, lbuf[:, :5], o2, l2, out_lse=lbuf[:, 1:])


def test_merge_out_sharing_memory_with_an_lse_is_an_error():
    o1, l1, o2, l2 = _merge_inputs(t=4, n=2, d=4)
    out = torch.empty(4, 2, 4)
    with pytest.raises(ValueError, match=r"out.*lse2|lse2.*out"):
        merge_attn_states(o1, l1, o2, out.view(-1)[:8].view(2, 4), out=out)
    with pytest.raises(ValueError, match=r"out.*out_lse|out_lse.*out"):
        merge_attn_states(o1, l1, o2, l2, out=out, out_lse=out.view(-1)[:8].view(2, 4))


def test_merge_out_with_overlapping_rows_is_an_error():
    o1, l1, o2, l2 = _merge_inputs()
    out = torch.empty(8).as_strided((5, 2, 8), (0, 0, 1))  # every row is the same memory
    with pytest.raises(ValueError, match="out"):
        merge_attn_states(o1, l1, o2, l2, out=out)


def test_merge_exact_alias_and_interleaved_views_are_accepted():
    """In place (out is o1, out_lse is lse2) and disjoint column halves of one buffer."""
    from mla_ext.attention.reference import merge_attn_states_ref

    o1, l1, o2, l2 = _merge_inputs()
    want_o, want_l = merge_attn_states_ref(o1, l1, o2, l2)
    a, la = o1.clone(), l2.clone()
    merge_attn_states(a, l1, o2, la, out=a, out_lse=la)
    assert torch.allclose(a, want_o, atol=1e-5) and torch.allclose(la, want_l, atol=1e-5)
    buf = torch.randn(5, 2, 16)
    buf[:, :, 8:] = o2
    out = buf[:, :, :8]
    merge_attn_states(o1, l1, buf[:, :, 8:], l2, out=out)
    assert torch.allclose(out, want_o, atol=1e-5)


@needs_ext
def test_raw_merge_rejects_partial_overlap():
    _, l1, o2, l2 = _merge_inputs()
    buf = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match=r"output.*prefix_output"):
        torch.ops.mla_ext.merge_attn_states(buf[1:6], None, buf[:5], l1, o2, l2)
    with pytest.raises(ValueError, match="output"):
        torch.ops.mla_ext.merge_attn_states(torch.empty(8).as_strided((5, 2, 8), (0, 0, 1)), None,
                                            o2, l1, o2, l2)


def _fp8_gather_case():
    from helpers.gather import make_cache

    cache, k_scale = make_cache("fp8", 2, 4, 16, 8, gen=torch.Generator().manual_seed(3))
    bt = torch.tensor([[1, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    return cache, k_scale, bt, cu


GATHERS = {
    "api": lambda c, d, bt, cu, s: api.gather_and_maybe_dequant_cache(c, d, bt, cu, 1, "fp8", s),
    "api_cp": lambda c, d, bt, cu, s: api.cp_gather_cache(c, d, bt, cu, 1),
    "raw": lambda c, d, bt, cu, s: torch.ops.mla_ext.gather_and_maybe_dequant_cache(c, d, bt, cu, 1, "fp8", s),
    "raw_cp": lambda c, d, bt, cu, s: torch.ops.mla_ext.cp_gather_cache(c, d, bt, cu, 1),
}


def _gather_params():
    return [pytest.param(k, marks=needs_ext if k.startswith("raw") else ()) for k in GATHERS]


@pytest.mark.parametrize("via", _gather_params())
def test_gather_dst_inside_the_cache_is_an_error(via):
    cache, k_scale, bt, cu = _fp8_gather_case()
    flat = cache.view(-1)
    dst = flat[24:24 + 6 * 24].view(6, 24)  # a uint8 dst over the cache's own bytes
    with pytest.raises(ValueError, match=r"dst.*src_cache|src_cache.*dst"):
        GATHERS[via](cache, dst, bt, cu, k_scale)


@pytest.mark.parametrize("via", _gather_params())
def test_gather_dst_sharing_storage_with_the_block_table_is_an_error(via):
    cache, k_scale, _, cu = _fp8_gather_case()
    buf = torch.zeros(40 * 24 // 4, dtype=torch.int32)
    buf[:2] = torch.tensor([1, 0], dtype=torch.int32)
    bt = buf[:2].view(1, 2)
    dst = buf.view(torch.uint8)[:6 * 24].view(6, 24)
    with pytest.raises(ValueError, match=r"dst.*block_table|block_table.*dst"):
        GATHERS[via](cache, dst, bt, cu, k_scale)


@pytest.mark.parametrize("via", _gather_params())
@pytest.mark.parametrize("layout", ["expanded", "overlapping_rows"])
def test_gather_dst_with_overlapping_rows_is_an_error(via, layout):
    cache, k_scale, bt, cu = _fp8_gather_case()
    dtype = torch.float32 if via in ("api", "raw") else torch.uint8
    if layout == "expanded":
        dst = torch.empty(1, 24, dtype=dtype).expand(6, 24)
    else:
        dst = torch.empty(64, dtype=dtype).as_strided((6, 24), (8, 1))
    with pytest.raises(ValueError, match="dst"):
        GATHERS[via](cache, dst, bt, cu, k_scale)


@pytest.mark.parametrize("via", _gather_params())
def test_gather_into_disjoint_column_slices_of_one_buffer_is_accepted(via):
    """A workspace viewed as [:, :24] while [:, 24:] holds something else is fine."""
    cache, k_scale, bt, cu = _fp8_gather_case()
    dtype = torch.float32 if via in ("api", "raw") else torch.uint8
    ws = torch.zeros(6, 48, dtype=dtype)
    GATHERS[via](cache, ws[:, :24], bt, cu, k_scale)
    want = torch.zeros(6, 24, dtype=dtype)
    GATHERS[via](cache, want, bt, cu, k_scale)
    assert torch.equal(ws[:, :24], want) and not (ws[:, 24:] != 0).any()


def test_write_cache_sharing_memory_with_its_input_is_an_error():
    cache = torch.zeros(2, 4, 24, dtype=torch.bfloat16)
    kv_c = cache.view(-1)[:3 * 16].view(3, 16)
    k_pe = torch.randn(3, 8).bfloat16()
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"kv_cache.*kv_c|kv_c.*kv_cache"):
        api.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", torch.ones(1))


def test_overlap_helpers_are_exact_for_strided_views():
    buf = torch.zeros(10, 16)
    assert checks.may_overlap(buf[:5], buf[4:])
    assert not checks.may_overlap(buf[:5], buf[5:])
    assert not checks.may_overlap(buf[:, :8], buf[:, 8:])  # interleaved column halves
    assert checks.may_overlap(buf[:, :9], buf[:, 8:])
    assert not checks.may_overlap(buf[0::2], buf[1::2])  # interleaved rows
    assert not checks.may_overlap(buf, torch.zeros(10, 16))
    assert checks.may_overlap(buf[:, 3], buf[2])  # a column and a row cross at [2, 3]
    assert not checks.has_internal_overlap(buf[:, :8])
    assert checks.has_internal_overlap(buf[0].expand(4, 16))
    assert checks.has_internal_overlap(buf.view(-1).as_strided((4, 16), (8, 1)))


# ---------------------------------------------------------------------------
# k_scale values in the raw ops
# ---------------------------------------------------------------------------

BAD_SCALES = [math.nan, math.inf, -math.inf, 0.0, -0.5]


@needs_ext
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_raw_gather_checks_a_cpu_scale(bad):
    cache, _, bt, cu = _fp8_gather_case()
    dst = torch.full((6, 24), 7.0)
    with pytest.raises(ValueError, match="k_scale: expected a finite value > 0"):
        torch.ops.mla_ext.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 1, "fp8", torch.tensor([bad]))
    assert (dst == 7.0).all()


@needs_ext
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_raw_write_checks_a_cpu_scale(bad):
    cache = torch.full((2, 4, 24), 0x11, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(3, 16).bfloat16(), torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match="k_scale: expected a finite value > 0"):
        torch.ops.mla_ext.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1, 2]), "fp8",
                                              torch.tensor([bad]))
    assert (cache == 0x11).all()


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_triton_gather_with_an_invalid_scale_gives_nan(bad):
    """The device-side (unchecked) contract: an invalid scale gives NaN, never zeros,
    saturated or sign-flipped values (Triton under the interpreter on the CPU)."""
    from mla_ext.cache import triton_gather

    if triton_gather.triton_not_supported_reasons(torch.empty(1, 1, 1, dtype=torch.uint8),
                                                  torch.empty(1, 1), "fp8"):
        pytest.skip("Triton cannot run here")
    cache, _, bt, cu = _fp8_gather_case()
    dst = torch.zeros(6, 24)
    triton_gather.gather_triton(cache, dst, bt, cu, 1, "fp8", torch.tensor([bad]))
    assert torch.isnan(dst).all()


@pytest.mark.cuda
@needs_ext
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_cuda_raw_ops_with_an_invalid_device_scale_give_nan(bad):
    cache, _, bt, cu = _fp8_gather_case()
    cache, bt, cu = cache.cuda(), bt.cuda(), cu.cuda()
    scale = torch.tensor([bad], device="cuda")
    dst = torch.zeros(6, 24, device="cuda")
    torch.ops.mla_ext.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 1, "fp8", scale)
    assert torch.isnan(dst).all()
    kv_c, k_pe = torch.randn(3, 16, device="cuda").bfloat16(), torch.randn(3, 8, device="cuda").bfloat16()
    torch.ops.mla_ext.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1, 2], device="cuda"), "fp8", scale)
    got = cache.view(-1)[: 3 * 24].view(torch.float8_e4m3fn).float()
    assert torch.isnan(got).all()


# ---------------------------------------------------------------------------
# One device per op; fake kernels reject meta mixed with real tensors
# ---------------------------------------------------------------------------


@needs_ext
def test_marlin_gemm_with_a_meta_activation_does_not_return_a_meta_tensor():
    import test_fake_kernels as tf

    a, q, s, *rest = tf._case_marlin_fp8_gemm()
    with pytest.raises(ValueError, match=r"^a: .*meta|a: expected device"):
        torch.ops.mla_ext.marlin_fp8_gemm(a.to("meta"), q, s, *rest)


@pytest.mark.cuda
@needs_ext
def test_cuda_ops_reject_a_cpu_scale_even_when_unused():
    from helpers.gather import make_cache

    cache, _ = make_cache("fp8_ds_mla", 2, 4, 512, 64, gen=torch.Generator().manual_seed(1), device="cuda")
    bt, cu = _one_request("cuda")
    dst = torch.zeros(1, 576, device="cuda")
    with pytest.raises(ValueError, match="k_scale: expected device"):
        torch.ops.mla_ext.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 1, "fp8_ds_mla", torch.ones(1))


# ---------------------------------------------------------------------------
# Triton: int64 row offsets
# ---------------------------------------------------------------------------

ROW = 2**28  # elements: row 8 starts at 2^31 elements, past int32


def _huge_row_stride(rows: int, cols: int, dtype) -> torch.Tensor:
    """[rows, cols] with a row stride of 2^28 elements over lazily committed storage."""
    storage = torch.empty((rows - 1) * ROW + cols, dtype=dtype)
    return storage.as_strided((rows, cols), (ROW, 1))


def _triton_interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


needs_interpreter = pytest.mark.skipif(not _triton_interpreting(), reason="runs the Triton interpreter")


@needs_interpreter
def test_fp8_block_gemm_out_with_a_huge_row_stride():
    """(M-1) * ldc >= 2^31: the int32 offsets wrote 4 GiB before `out`."""
    pytest.importorskip("triton")
    from mla_ext.kv_b_proj import weights as W
    from mla_ext.kv_b_proj.triton_fp8_block import fp8_block_linear

    g = torch.Generator().manual_seed(5)
    f = W.Fp8BlockWeight.from_dense(torch.randn(128, 128, generator=g) * 0.05, torch.bfloat16)
    x = torch.randn(9, 128, generator=g).bfloat16()
    want = fp8_block_linear(x, f.weight, f.weight_scale_inv, torch.bfloat16)
    out = _huge_row_stride(9, 128, torch.bfloat16)
    out.fill_(math.nan)
    got = fp8_block_linear(x, f.weight, f.weight_scale_inv, torch.bfloat16, out=out)
    assert torch.equal(got, want)


@needs_interpreter
@pytest.mark.parametrize("strided", ["x", "out"])
def test_w4a16_gemm_with_a_huge_row_stride(strided):
    pytest.importorskip("triton")
    from mla_ext.kv_b_proj import weights as W
    from mla_ext.kv_b_proj.triton_w4a16 import nvfp4_w4a16_matmul

    g = torch.Generator().manual_seed(6)
    f = W.Nvfp4Weight.from_dense(torch.randn(64, 128, generator=g) * 0.05, torch.bfloat16)
    x = torch.randn(9, 128, generator=g).bfloat16()
    want = nvfp4_w4a16_matmul(x, f.weight, f.weight_scale, f.weight_scale_2)
    out = None
    if strided == "x":
        xs = _huge_row_stride(9, 128, torch.bfloat16)
        xs.copy_(x)
        x = xs
    else:
        out = _huge_row_stride(9, 64, torch.bfloat16)
        out.fill_(math.nan)
    got = nvfp4_w4a16_matmul(x, f.weight, f.weight_scale, f.weight_scale_2, out=out)
    assert torch.equal(got, want)


@needs_interpreter
def test_group_quant_kernel_with_a_huge_row_stride():
    pytest.importorskip("triton")
    from mla_ext.kv_b_proj import quant

    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    want_q, want_s = quant.per_token_group_quant_fp8(x, use_triton=True)
    xs = _huge_row_stride(9, 256, torch.bfloat16)
    xs.copy_(x)
    q, s = quant.per_token_group_quant_fp8(xs, use_triton=True)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# ---------------------------------------------------------------------------
# Device guard around every Triton launch
# ---------------------------------------------------------------------------

class _GuardRecorder:
    """Stands in for torch.cuda.device: records the device and whether it is entered."""

    def __init__(self):
        self.entered: list = []
        self.depth = 0

    def __call__(self, device):
        rec = self

        @contextlib.contextmanager
        def cm():
            rec.entered.append(device)
            rec.depth += 1
            try:
                yield
            finally:
                rec.depth -= 1

        return cm()


class _FakeKernel:
    def __init__(self, rec):
        self.rec, self.launches = rec, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(self.rec.depth)

        return launch


def _launch_cases():
    pytest.importorskip("triton")
    from mla_ext.attention import triton_attention, triton_merge
    from mla_ext.cache import triton_gather
    from mla_ext.kv_b_proj import quant, triton_fp8_block, triton_w4a16

    o1, l1, o2, l2 = _merge_inputs()
    q = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cache, k_scale, bt, gcu = _fp8_gather_case()
    a_q = torch.randn(3, 128).to(torch.float8_e4m3fn)
    w_q = torch.randn(128, 128).to(torch.float8_e4m3fn)
    x16 = torch.randn(3, 128).bfloat16()
    return {
        "merge": (triton_merge, "_merge_kernel",
                  lambda: triton_merge.merge_attn_states_triton(torch.empty_like(o1), None, o1, l1, o2, l2)),
        "attention": (triton_attention, "_attn_fwd_kernel",
                      lambda: triton_attention.varlen_attention_triton(
                          q, q, q, cu, cu, 4, 0.25, True, torch.empty_like(q), torch.empty(2, 4))),
        "gather": (triton_gather, "_gather_paged_kernel",
                   lambda: triton_gather.gather_triton(cache, torch.empty(6, 24), bt, gcu, 1, "fp8", k_scale)),
        "fp8_block": (triton_fp8_block, "_fp8_block_gemm_kernel",
                      lambda: triton_fp8_block.w8a8_block_fp8_matmul(
                          a_q, torch.ones(3, 1), w_q, torch.ones(1, 1), torch.bfloat16)),
        "w4a16": (triton_w4a16, "_w4a16_kernel",
                  lambda: triton_w4a16.nvfp4_w4a16_matmul(
                      x16, torch.zeros(8, 64, dtype=torch.uint8),
                      torch.ones(8, 8).to(torch.float8_e4m3fn), torch.ones(1))),
        "quant": (quant, "_quant_kernel", lambda: quant.per_token_group_quant_fp8(x16, use_triton=True)),
    }


@pytest.mark.parametrize("kernel", ["merge", "attention", "gather", "fp8_block", "w4a16", "quant"])
def test_every_triton_launch_runs_under_a_device_guard(monkeypatch, kernel):
    """On the CPU the guard is entered with -1 (a no-op); on CUDA with the tensors' device."""
    module, attr, call = _launch_cases()[kernel]
    if kernel == "gather" and not _triton_interpreting():
        pytest.skip("CPU tensors reach the Triton gather only under the interpreter")
    rec = _GuardRecorder()
    fake = _FakeKernel(rec)
    monkeypatch.setattr(torch.cuda, "device", rec)
    monkeypatch.setattr(module, attr, fake)
    call()
    assert fake.launches and all(d >= 1 for d in fake.launches), "launched outside the guard"
    assert rec.entered and all(d == -1 for d in rec.entered)


@pytest.mark.cuda
def test_triton_merge_on_the_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from mla_ext.attention.reference import merge_attn_states_ref
    from mla_ext.attention.triton_merge import merge_attn_states_triton

    o1, l1, o2, l2 = _merge_inputs(t=64, n=4, d=32)
    want_o, want_l = merge_attn_states_ref(o1, l1, o2, l2)
    dev = torch.device("cuda", 1)
    args = [t.to(dev) for t in (o1, l1, o2, l2)]
    out, out_lse = torch.empty_like(args[0]), torch.empty_like(args[1])
    with torch.cuda.device(0):
        merge_attn_states_triton(out, out_lse, *args)
        torch.cuda.synchronize(dev)
    assert torch.allclose(out.cpu(), want_o, atol=1e-5)
    assert torch.allclose(out_lse.cpu(), want_l, atol=1e-5)
