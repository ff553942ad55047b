"""The compiled DSA index-cache kernels (csrc/sparse/): the C++ CPU writer and gather are
bit-identical to the torch reference (index_cache_torch._write_torch / _gather_torch) on random
inputs, every format, several block sizes, poisoned outputs, -1 and out-of-range slots and
block ids; the layout header agrees with the Python module through the compiled
`index_cache_format_info`; the dispatch picks the C++ CPU backend on the CPU. CUDA tests are
marked `cuda` (skipped without a GPU)."""
from __future__ import annotations

import struct

import pytest
import torch

import mla_ext  # noqa: F401  (loads the compiled ops)
from mla_ext.sparse import index_cache as ic
from mla_ext.sparse import index_cache_torch as ict
from mla_ext.sparse.index_cache_backends import INDEX_GATHER, INDEX_WRITE, IndexGatherInputs, IndexWriteInputs
from helpers.sparse_cache import paged_layout
from helpers.numeric import same_bytes

ops = torch.ops.mla_ext
pytestmark = pytest.mark.skipif(not hasattr(ops, "index_cache_write"), reason="mla_ext built without the ops")

CASES = [("bfloat16", None, None), ("float32", None, None), ("fp8", 16, None), ("fp8", 16, "ue8m0"),
         ("fp8", 64, None), ("fp8", 8, "ue8m0")]
D = 64


def _keys(T, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, D, generator=g) * torch.logspace(-3, 2, T)[:, None]  # wide range: subnormal e4m3 too
    if T > 2:
        k[1, :8] = 0  # a group of zeros: the 1e-4 floor
        k[2, 3] = 1e4  # one large value: saturation ties
    return k.to(dtype)


def _poisoned_cache(fmt, nb, B, Q, device="cpu"):
    c = ic.get_index_format(fmt).empty(nb, B, D, Q, device=device)
    return c.fill_(0xA5) if c.dtype == torch.uint8 else c.fill_(float("nan"))


@pytest.mark.parametrize("fmt,Q,scale_fmt", CASES)
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("kdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_write_bit_identical(fmt, Q, scale_fmt, B, kdtype):
    lens = [5, 0, 11]
    table, nb, slots = paged_layout(lens, B, seed=B)
    slot = torch.cat(slots)
    slot = torch.cat([slot, torch.tensor([-1, nb * B, nb * B + 7, -5])])  # padding and past the cache
    k = _keys(slot.numel(), kdtype, seed=B + 7)
    want, got = _poisoned_cache(fmt, nb, B, Q), _poisoned_cache(fmt, nb, B, Q)
    f = ic.get_index_format(fmt)
    ict._write_torch(IndexWriteInputs(k, want, slot, f, Q, scale_fmt))
    ops.index_cache_write(k, got, slot.to(torch.int32), fmt, Q or 0, scale_fmt or "")
    assert same_bytes(got, want)
    got64 = _poisoned_cache(fmt, nb, B, Q)
    ops.index_cache_write(k, got64, slot, fmt, 0, scale_fmt or "")  # int64 slots, Q from the cache
    assert same_bytes(got64, want)


@pytest.mark.parametrize("fmt,Q,scale_fmt", CASES)
@pytest.mark.parametrize("B", [1, 4, 16])
def test_cpu_gather_bit_identical(fmt, Q, scale_fmt, B):
    lens = [7, 0, 19, 3]
    table, nb, slots = paged_layout(lens, B, seed=B + 1)
    cache = ic.get_index_format(fmt).empty(nb, B, D, Q)
    k = _keys(sum(lens), torch.float32, seed=B)
    ict._write_torch(IndexWriteInputs(k, cache, torch.cat(slots), ic.get_index_format(fmt), Q, scale_fmt))
    cu = torch.tensor([0, 7, 7, 26, 29], dtype=torch.int32)
    want = torch.full((29, D), float("nan"))
    ict._gather_torch(IndexGatherInputs(cache, table, cu, ic.get_index_format(fmt), None, D, want))
    got = torch.full((29, D), float("nan"))
    ops.index_cache_gather(cache, got, table, cu, fmt, D)
    assert same_bytes(got, want)
    # a chunk with seq_starts, the rows past the last request untouched
    starts = torch.tensor([2, 0, 5, 1], dtype=torch.int32)
    cu2 = torch.tensor([0, 4, 4, 14, 16], dtype=torch.int32)
    want2 = torch.full((18, D), float("nan"))
    ict._gather_torch(IndexGatherInputs(cache, table, cu2, ic.get_index_format(fmt), starts, D, want2[:16]))
    got2 = torch.full((18, D), float("nan"))
    ops.index_cache_gather(cache, got2, table, cu2, fmt, D, starts)
    assert same_bytes(got2, want2)
    if fmt == "fp8":  # raw bytes and scales, as vLLM's cp_gather_indexer_k_quant_cache
        S = D // Q
        wk, ws = torch.full((29, D), 0xA5, dtype=torch.uint8), torch.full((29, 4 * S), 0xA5, dtype=torch.uint8)
        ict._gather_torch(IndexGatherInputs(cache, table, cu, ic.get_index_format(fmt), None, D, wk, ws))
        gk, gs = torch.full_like(wk, 0x5A), torch.full((29, S), float("nan"))
        ops.index_cache_gather(cache, gk, table, cu, fmt, D, None, gs)
        assert torch.equal(gk, wk) and torch.equal(gs.view(torch.uint8), ws)


def test_cpu_gather_out_of_range_rows_are_zero():
    B = 4
    cache = ic.get_index_format("fp8").empty(3, B, D, 32).random_(0, 120)
    table = torch.tensor([[0, 7], [-1, 2]], dtype=torch.int32)  # block 7 past the cache, -1
    cu = torch.tensor([0, 12, 14], dtype=torch.int32)  # request 0 runs past the table width too
    out = torch.full((14, D), float("nan"))
    ops.index_cache_gather(cache, out, table, cu, "fp8", D)
    assert out[4:].eq(0).all() and out[:4].isfinite().all()


def test_layout_header_agrees_with_python():
    for name in list(ic.FORMATS) + list(ic.ALIASES):
        f = ic.get_index_format(name)
        for Dh, Q, B in [(128, 128, 64), (64, 16, 4), (32, 8, 1)]:
            fid, bpt, page, voff, soff, elem, e4m3_max, min_bits = ops.index_cache_format_info(name, Dh, Q, B)
            assert fid == {"bfloat16": 0, "fp8": 1, "float32": 2}[f.name]
            assert bpt == f.bytes_per_token(Dh, Q) and page == f.page_bytes(B, Dh, Q)
            assert elem == f.storage_dtype.itemsize
            if f.quantized:
                assert (voff, soff) == (Dh, B * Dh + 4 * (Dh // Q))  # token 1 of a page
            assert e4m3_max == ic.E4M3_MAX
            assert struct.unpack("<f", struct.pack("<i", min_bits))[0] == torch.tensor(ic.MIN_SCALE).item()
    with pytest.raises(ValueError, match="index_cache_dtype"):
        ops.index_cache_format_info("fp4", 128, 128, 64)
    with pytest.raises(ValueError, match="quant_block_size"):
        ops.index_cache_format_info("fp8", 128, 48, 64)


def test_op_errors_name_the_argument():
    cache = ic.get_index_format("fp8").empty(2, 4, D, 16)
    k, slots = torch.randn(2, D), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="quant_block_size"):
        ops.index_cache_write(k, cache, slots, "fp8", 32, "")
    with pytest.raises(ValueError, match="scale_fmt"):
        ops.index_cache_write(k, cache, slots, "fp8", 16, "mxfp8")
    with pytest.raises(ValueError, match="cache"):
        ops.index_cache_write(k, cache.view(torch.int8), slots, "fp8", 16, "")
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.index_cache_write(k, cache, slots[:1], "fp8", 16, "")
    with pytest.raises(ValueError, match="k"):
        ops.index_cache_write(k.double(), cache, slots, "fp8", 16, "")
    table, cu = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="dst"):
        ops.index_cache_gather(cache, torch.empty(2, D, dtype=torch.float16), table, cu, "fp8", D)
    with pytest.raises(ValueError, match="dst_scale"):
        ops.index_cache_gather(cache, torch.empty(2, D, dtype=torch.uint8), table, cu, "fp8", D, None,
                               torch.empty(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dst_scale"):
        bf = ic.get_index_format("bfloat16").empty(2, 4, D)
        ops.index_cache_gather(bf, torch.empty(2, D, dtype=torch.uint8), table, cu, "bf16", D, None,
                               torch.empty(2, 16, dtype=torch.uint8))


def test_dispatch_picks_the_cpu_kernel_and_force_torch_agrees():
    B = 8
    table, nb, slots = paged_layout([9, 4], B, seed=5)
    k, slot = _keys(13, torch.bfloat16, seed=2), torch.cat(slots)
    f = ic.get_index_format("fp8")
    winp = IndexWriteInputs(k, f.empty(nb, B, D, 32), slot, f, 32, "ue8m0")
    assert INDEX_WRITE.choose(winp).name == "cpu"
    ginp = IndexGatherInputs(winp.cache, table, torch.tensor([0, 9, 13], dtype=torch.int32), f, None, D,
                             torch.empty(13, D))
    assert INDEX_GATHER.choose(ginp).name == "cpu"
    assert "triton" in INDEX_WRITE.explain(winp) and "torch" in INDEX_GATHER.explain(ginp)
    caches = []
    for backend in ("cpu", "torch"):
        c = f.empty(nb, B, D, 32).fill_(0)
        with INDEX_WRITE.force(backend):
            ic.write_index_cache(k, c, slot, "fp8", quant_block_size=32, scale_fmt="ue8m0")
        with INDEX_GATHER.force(backend):
            caches.append((c, ic.gather_index_keys(c, table, ginp.cu_seq_lens, "fp8", head_dim=D)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,Q,scale_fmt", CASES)
@pytest.mark.parametrize("B", [1, 16, 64])
def test_cuda_kernels_bit_identical_to_cpu(fmt, Q, scale_fmt, B):
    lens = [70, 0, 33]
    table, nb, slots = paged_layout(lens, B, seed=B)
    slot = torch.cat([torch.cat(slots), torch.tensor([-1, nb * B])])
    k = _keys(slot.numel(), torch.bfloat16, seed=3)
    want, got = _poisoned_cache(fmt, nb, B, Q), _poisoned_cache(fmt, nb, B, Q, "cuda")
    ops.index_cache_write(k, want, slot, fmt, Q or 0, scale_fmt or "")
    ops.index_cache_write(k.cuda(), got, slot.cuda(), fmt, Q or 0, scale_fmt or "")
    assert same_bytes(got.cpu(), want)
    cu = torch.tensor([0, 70, 70, 103], dtype=torch.int32)
    wo, go = torch.full((105, D), float("nan")), torch.full((105, D), float("nan"), device="cuda")
    ops.index_cache_gather(want, wo, table, cu, fmt, D)
    ops.index_cache_gather(got, go, table.cuda(), cu.cuda(), fmt, D)
    assert same_bytes(go.cpu(), wo)
    inp = IndexWriteInputs(k.cuda(), got, slot.cuda(), ic.get_index_format(fmt), Q, scale_fmt)
    assert INDEX_WRITE.choose(inp).name == "cuda"
    bad = torch.tensor([[0, nb + 3, -1]], dtype=torch.int32)  # out-of-range block ids: zero rows on both
    cub, st = torch.tensor([0, 3 * B], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    wz, gz = torch.full((3 * B, D), float("nan")), torch.full((3 * B, D), float("nan"), device="cuda")
    ops.index_cache_gather(want, wz, bad, cub, fmt, D, st)
    ops.index_cache_gather(got, gz, bad.cuda(), cub.cuda(), fmt, D, st.cuda())
    assert same_bytes(gz.cpu(), wz)
    if fmt == "fp8":  # raw bytes + scales
        S = D // Q
        wk, ws = torch.full((105, D), 7, dtype=torch.uint8), torch.full((105, 4 * S), 7, dtype=torch.uint8)
        gk, gs = wk.cuda(), ws.cuda()
        ops.index_cache_gather(want, wk, table, cu, fmt, D, None, ws)
        ops.index_cache_gather(got, gk, table.cuda(), cu.cuda(), fmt, D, None, gs)
        assert torch.equal(gk.cpu(), wk) and torch.equal(gs.cpu(), ws)


def test_ue8m0_scale_one_ulp_above_a_power_of_two_rounds_up_everywhere():
    """amax / 448 = 2^k (1 + 2^-23): torch.exp2(ceil(log2)) would give 2^k (log2 rounds down); the
    reference, the C++ kernel and the Triton writer all take the exact ceiling, 2^(k+1)."""
    p2 = torch.tensor([2.0 ** -8, 2.0 ** -3, 1.0])
    amax = torch.nextafter(p2, torch.full_like(p2, 10.0)) * ic.E4M3_MAX
    k = torch.zeros(3, D)
    k[:, 0] = amax
    while not torch.equal(k[:, 0] / ic.E4M3_MAX, torch.nextafter(p2, torch.full_like(p2, 10.0))):
        pytest.skip("no fp32 amax gives exactly one ulp above here")
    _, s = ic.quantize_fp8_rows(k, D, "ue8m0")
    assert torch.equal(s[:, 0], p2 * 2)
    f = ic.get_index_format("fp8")
    want, got = f.empty(1, 4, D, D), f.empty(1, 4, D, D)
    ict._write_torch(IndexWriteInputs(k, want, torch.arange(3), f, D, "ue8m0"))
    ops.index_cache_write(k, got, torch.arange(3), "fp8", D, "ue8m0")
    tri = f.empty(1, 4, D, D)
    with INDEX_WRITE.force("triton"):  # the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
        ic.write_index_cache(k, tri, torch.arange(3), "fp8", scale_fmt="ue8m0")
    for c in (got, tri):
        assert torch.equal(c[0].reshape(-1)[:3 * D], want[0].reshape(-1)[:3 * D])
        assert torch.equal(c[0].reshape(-1)[4 * D:4 * D + 12], want[0].reshape(-1)[4 * D:4 * D + 12])


def test_cpu_range_check_refuses_exactly_what_the_torch_gather_refuses():
    """The wrappers' per-table-entry check (`check_gather_offsets`, i.e. mla_ext.cache.checks.check_block_ids)
    against the per-token `_token_slots`."""
    g = torch.Generator().manual_seed(11)
    for trial in range(200):
        B, nb, n = int(torch.randint(1, 5, (1,), generator=g)), 6, int(torch.randint(1, 4, (1,), generator=g))
        table = torch.randint(-1, nb + 2, (n, 3), generator=g, dtype=torch.int32)
        lens = torch.randint(0, 3 * B + 2, (n,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
        starts = torch.randint(0, B + 1, (n,), generator=g, dtype=torch.int32) if trial % 2 else None
        outcome = []
        cache = torch.empty(nb, B, 4)
        for check in (lambda: ict._token_slots(table, cu, starts, B, nb),
                      lambda: ic.check_gather_offsets(cache, table, cu, starts, B)):
            try:
                check()
                outcome.append("ok")
            except ValueError as e:
                past = "width" in str(e) or "columns" in str(e)  # a logical block past the table
                outcome.append(str(e).split(":")[0] + (" width" if past else ""))
        assert outcome[0] == outcome[1], (trial, outcome)
