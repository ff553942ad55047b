"""The DSA indexer key cache (mla_ext/sparse/index_cache.py): page sizes, vLLM's fp8 byte layout,
writer and gathers, and agreement with csrc/common/indexer_cache_layout.h."""
import re
from pathlib import Path

import pytest
import torch

from mla_ext.sparse import index_cache as ic
from helpers.sparse_cache import paged_layout

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "common" / "indexer_cache_layout.h"


def test_page_bytes_and_shapes():
    bf, f8 = ic.get_index_format("bf16"), ic.get_index_format("fp8")
    assert bf.page_bytes(64, 128) == 16384 and f8.page_bytes(64, 128, 128) == 64 * 132
    assert f8.bytes_per_token(128, 64) == 136 and f8.cache_shape(3, 16, 128) == (3, 16, 132)
    assert bf.cache_shape(3, 16, 128) == (3, 16, 128) and bf.storage_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="index_cache_dtype"):
        ic.get_index_format("fp4")
    with pytest.raises(ValueError, match="quant_block_size"):
        f8.bytes_per_token(128, 48)


def test_header_agrees():
    text = HEADER.read_text()
    assert "? 2 * head_dim" in text and "? 4 * head_dim" in text and ic.get_index_format("fp32").bytes_per_token(8) == 32
    assert "head_dim + 4 * (head_dim / quant_block_size)" in text
    assert re.search(r"kE4M3Max = 448\.0f", text) and re.search(r"kMinScale = 1e-4f", text)
    assert ic.E4M3_MAX == 448.0 and ic.MIN_SCALE == 1e-4
    assert "bytes_per_token(IndexFormat::kFp8, 128, 128) == 132" in text
    assert ic.get_index_format("fp8").bytes_per_token(128, 128) == 132


@pytest.mark.parametrize("fmt", ["bfloat16", "float32", "fp8"])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_write_then_gather(fmt, scale_fmt):
    if fmt != "fp8" and scale_fmt:
        pytest.skip("no scales")
    D, B, lens = 32, 8, [13, 0, 21]
    table, nb, slots = paged_layout(lens, B, seed=3)
    cache = ic.get_index_format(fmt).empty(nb, B, D, 16).fill_(0x7F if fmt == "fp8" else 0)
    keys = [torch.randn(n, D) * (1 + r) for r, n in enumerate(lens)]
    slot = torch.cat(slots)
    ic.write_index_cache(torch.cat(keys), cache, slot, fmt, quant_block_size=16, scale_fmt=scale_fmt)
    before = cache.clone()
    ic.write_index_cache(torch.randn(1, D), cache, torch.tensor([-1]), fmt, quant_block_size=16)  # skipped slot
    assert torch.equal(before, cache)
    cu = torch.tensor([0, 13, 13, 34], dtype=torch.int32)
    got = ic.gather_index_keys(cache, table, cu, fmt, head_dim=D)
    want = torch.cat(keys)
    if fmt != "fp8":
        assert torch.equal(got, want.to(ic.get_index_format(fmt).native_dtype).float())
    else:
        v, s = ic.quantize_fp8_rows(want, 16, scale_fmt)
        assert torch.equal(got, ic.dequantize_fp8_rows(v, s))
        assert ((got - want).abs() <= want.abs() / 16 + 1e-3).all()  # e4m3: 3 mantissa bits
        if scale_fmt == "ue8m0":
            assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    # a chunk with seq_starts
    part = ic.gather_index_keys(cache, table[2:], torch.tensor([0, 9], dtype=torch.int32), fmt,
                                seq_starts=torch.tensor([7], dtype=torch.int32), head_dim=D)
    assert torch.equal(part, got[13 + 7:13 + 16])


def test_fp8_byte_layout_is_vllms():
    """Token j of a page: values at page byte j*D, its D/Q fp32 scales at B*D + 4*j*(D/Q)."""
    D, B, Q = 16, 4, 8
    cache = torch.zeros(2, B, D + 4 * D // Q, dtype=torch.uint8)
    k = torch.randn(3, D)
    ic.indexer_k_quant_and_cache(k, cache, torch.tensor([5, 0, 7]), Q, None)  # vLLM's op name
    v, s = ic.quantize_fp8_rows(k, Q)
    page = cache[1].reshape(-1)
    assert torch.equal(page[1 * D:2 * D], v[0])  # slot 5 = block 1, offset 1
    assert torch.equal(page[B * D + 4 * 2: B * D + 4 * 4].view(torch.float32), s[0])
    page3 = cache[1].reshape(-1)
    assert torch.equal(page3[3 * D:4 * D], v[2])
    dst_k, dst_s = torch.empty(2, D, dtype=torch.uint8), torch.empty(2, 4 * D // Q, dtype=torch.uint8)
    ic.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, torch.tensor([[0, 1]], dtype=torch.int32),
                                       torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(dst_k[0], v[1]) and torch.equal(dst_s[0].view(torch.float32), s[1])


def test_strided_pages_and_errors():
    D, B = 16, 4
    big = torch.zeros(3, 2, B, D + 4, dtype=torch.uint8)
    cache = big[:, 1]  # every other page of a cross-layer buffer
    k = torch.randn(2, D)
    ic.write_index_cache(k, cache, torch.tensor([9, 2]), "fp8")
    assert big[:, 0].eq(0).all()
    got = ic.gather_index_keys(cache, torch.tensor([[0, 2]], dtype=torch.int32),
                               torch.tensor([0, 2], dtype=torch.int32), "fp8", seq_starts=torch.tensor(
                                   [2], dtype=torch.int32), head_dim=D)
    v, s = ic.quantize_fp8_rows(k[[1]], D)
    assert torch.equal(got[0], ic.dequantize_fp8_rows(v, s)[0])
    with pytest.raises(ValueError, match="slot_mapping"):
        ic.write_index_cache(k, cache, torch.tensor([99, 0]), "fp8")
    with pytest.raises(ValueError, match=r"block_table: request 0, logical block 0 holds block id 7, outside \[0, 3\)"):
        ic.gather_index_keys(cache, torch.tensor([[7]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                             "fp8", head_dim=D)
    with pytest.raises(ValueError, match="index cache"):
        ic.gather_index_keys(cache.view(torch.int8), torch.tensor([[0]], dtype=torch.int32),
                             torch.tensor([0, 1], dtype=torch.int32), "fp8", head_dim=D)
    with pytest.raises(ValueError, match="head_dim"):
        ic.write_index_cache(torch.randn(2, 8), cache, torch.tensor([0, 1]), "fp8")


def test_planner_puts_index_pages_beside_the_latent_pages():
    from mla_ext.config.models import get_model_config
    from mla_ext.config.planner import plan_pool
    from mla_ext.config.policy import CacheConfig, resolve_model

    m = get_model_config("deepseek-v3")
    specs = resolve_model(CacheConfig("fp8_ds_mla", block_size=64), m)
    ispecs = [ic.IndexCacheSpec(s.layer_index, "fp8", 128, 64, 128) for s in specs]
    budget = 3 << 30
    plan = plan_pool(specs, budget, index_specs=ispecs)
    dense = plan_pool(specs, budget)
    assert ispecs[0].page_bytes() == 64 * 132 and plan.layers[0].page_bytes == 41_984
    assert plan.num_blocks == budget // (len(specs) * (41_984 + 8_448)) or \
        plan.num_blocks == budget // (len(specs) * (41_984 + 8_448)) - 1
    assert plan.num_blocks < dense.num_blocks and plan.bytes_used <= budget
    assert len(plan.index_layers) == len(specs) and plan.index_layers[0].shape == (plan.num_blocks, 64, 132)
    assert plan.index_layers[0].offset >= plan.layers[-1].offset + plan.layers[-1].bytes
    assert "index_layers" in plan.to_dict() and "index_layers" not in dense.to_dict()
    assert "index cache:     layers 0-60: index fp8, 132 B/token" in plan.format_table()
    small = plan_pool(specs[:2], 1 << 22, index_specs=ispecs[:2])
    lat, idx = small.allocate_all(shared=True)
    assert [t.shape for t in idx] == [(small.num_blocks, 64, 132)] * 2 and idx[0].dtype == torch.uint8
    for t in lat:
        t.view(torch.uint8).zero_()
    idx[0].fill_(7)
    idx[1].fill_(9)  # separate regions: writing the index caches leaves the latent ones and each other alone
    assert all(t.view(torch.uint8).eq(0).all() for t in lat) and idx[0].eq(7).all()
    assert idx[0].data_ptr() != idx[1].data_ptr() and lat[1].data_ptr() < idx[0].data_ptr()
    with pytest.raises(ValueError, match="index_specs"):
        plan_pool(specs, budget, index_specs=[ic.IndexCacheSpec(999, "fp8", 128, 64, 128)])
    with pytest.raises(ValueError, match="block_size"):
        plan_pool(specs, budget, index_specs=[ic.IndexCacheSpec(0, "bf16", 128, 16)])


# -- Triton writer and gather (interpreter) -------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mla_ext.sparse.triton_index_cache import f32_to_e4m3  # noqa: E402


@triton.jit
def _enc(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(o_ptr + i, f32_to_e4m3(x), mask=i < n)


def test_triton_e4m3_encoder_is_torchs_cast():
    g = torch.Generator().manual_seed(0)
    mags = torch.cat([torch.randn(3000, generator=g) * s for s in (1e-3, 0.05, 1, 30, 400)])
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    exact = codes.view(torch.float8_e4m3fn).float()
    mids = (exact.sort().values[1:] + exact.sort().values[:-1]) / 2  # ties: to even
    x = torch.cat([mags, exact, mids, torch.tensor([448.0, -448.0, 0.0, -0.0, 2 ** -10, 2 ** -9 * 1.5])])
    x = x.clamp(-448, 448)
    out = torch.empty(x.numel(), dtype=torch.int32)
    _enc[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    zero = (want & 0x7F) == 0  # +-0: the sign of a value that rounds to zero may differ
    assert torch.equal(out[~zero], want[~zero]) and ((out[zero] & 0x7F) == 0).all()


@pytest.mark.parametrize("fmt,scale_fmt", [("bfloat16", None), ("float32", None), ("fp8", None), ("fp8", "ue8m0")])
def test_triton_writer_and_gather_equal_the_torch_ones(fmt, scale_fmt):
    from mla_ext.sparse.triton_index_cache import gather_index_keys_triton, write_index_cache_triton

    D, B, lens = 32, 8, [13, 0, 21]
    table, nb, slots = paged_layout(lens, B, seed=5)
    k = torch.randn(34, D) * 3
    slot = torch.cat(slots)
    slot_pad = torch.cat([slot[:4], torch.tensor([-1, nb * B]), slot[4:]])  # padding; past the cache
    k_pad = torch.cat([k[:4], torch.randn(2, D), k[4:]])
    a = ic.get_index_format(fmt).empty(nb, B, D, 16).fill_(0)
    b = a.clone()
    ic.write_index_cache(k, a, slot, fmt, quant_block_size=16, scale_fmt=scale_fmt)
    write_index_cache_triton(k_pad, b, slot_pad, fmt, quant_block_size=16, scale_fmt=scale_fmt)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if fmt != "bfloat16" else \
        (a.float() - b.float()).abs().max() <= a.float().abs().max() * 2 ** -7  # interpreter bf16 stores truncate
    cu = torch.tensor([0, 13, 13, 34], dtype=torch.int32)
    starts = torch.tensor([2, 0, 5], dtype=torch.int32)
    cu2 = torch.tensor([0, 11, 11, 27], dtype=torch.int32)
    for c, s in ((cu, None), (cu2, starts)):
        want = ic.gather_index_keys(a, table, c, fmt, seq_starts=s, head_dim=D)
        out = torch.full_like(want, float("nan"))
        got = gather_index_keys_triton(a, table, c, fmt, seq_starts=s, head_dim=D, out=out)
        assert torch.equal(got, want)
