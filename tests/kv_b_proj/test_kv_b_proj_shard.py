"""Tensor-parallel shards of kv_b_proj for every weight format (SPEC §10).

Rank r of tp_size holds heads [r·n, (r+1)·n), n = heads / tp_size, i.e. the
output rows [r·n·(P+V), (r+1)·n·(P+V)) of the full weight. A shard's
dequantized weight must be exactly those rows of the full format's, and its
forward exactly those columns of the full forward (within rounding).
"""
from __future__ import annotations

import types

import pytest
import torch

from mla_ext.kv_b_proj import DISPATCH, KvBProj, shard_for, shard_rows, shard_weight
from mla_ext.kv_b_proj import weights as W

HEADS, HEAD_ROWS, K = 8, 256, 256  # P = V = 128
SPLITS = [(1, 0), (2, 1), (4, 0), (4, 3), (8, 5)]


def _randn(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    assert bool((w != 0).all())
    return w


@pytest.fixture(scope="module")
def full_formats():
    w = _randn(HEADS * HEAD_ROWS, K)
    return {name: W.quantize(name, w, torch.bfloat16) for name in sorted(W.RECIPES)}


@pytest.mark.parametrize("name", sorted(W.RECIPES))
def test_shard_dequantizes_to_the_rows_of_its_heads(full_formats, name):
    full = full_formats[name]
    ref = full.dequantize_fp32()
    for tp, rank in SPLITS:
        start, stop = shard_rows(HEADS, HEAD_ROWS, tp, rank)
        assert (start, stop) == (rank * HEADS // tp * HEAD_ROWS, (rank + 1) * HEADS // tp * HEAD_ROWS)
        shard = shard_weight(full, HEADS, HEAD_ROWS, tp, rank)
        assert type(shard) is type(full) and shard.name == full.name
        assert (shard.N, shard.K, shard.params_dtype) == (stop - start, K, full.params_dtype)
        assert torch.equal(shard.dequantize_fp32(), ref[start:stop]), (name, tp, rank)
        # The method reads the same.
        assert torch.equal(full.shard(HEADS, HEAD_ROWS, tp, rank).dequantize_fp32(), ref[start:stop])


@pytest.mark.parametrize("name", sorted(W.RECIPES))
def test_shard_forward_is_the_columns_of_the_full_forward(full_formats, name):
    full = full_formats[name]
    x = _randn(7, K, seed=1).to(torch.bfloat16)
    y_full = KvBProj(full)(x).float()
    for tp, rank in [(2, 1), (4, 2)]:
        start, stop = shard_rows(HEADS, HEAD_ROWS, tp, rank)
        y = KvBProj(shard_weight(full, HEADS, HEAD_ROWS, tp, rank))(x).float()
        torch.testing.assert_close(y, y_full[:, start:stop], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", ["marlin_fp8", "marlin_fp8_g128"])
def test_marlin_shard_through_the_packed_gemm(full_formats, name):
    # The CPU reference of the Marlin GEMM reads the cut tiles and scale blocks.
    full = full_formats[name]
    x = _randn(5, K, seed=2).to(torch.bfloat16)
    with DISPATCH.force("marlin_w8a16"):
        y_full = KvBProj(full)(x).float()
        start, stop = shard_rows(HEADS, HEAD_ROWS, 4, 1)
        y = KvBProj(shard_weight(full, HEADS, HEAD_ROWS, 4, 1))(x).float()
    torch.testing.assert_close(y, y_full[:, start:stop], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", ["marlin_fp8", "marlin_fp8_g128", "fp8_block", "int4_group", "nvfp4"])
def test_slice_up_to_a_ragged_end(name):
    # N = 131: the last 64-row tile / 128-row block is partial; a slice may end at N.
    full = W.quantize(name, _randn(131, K, seed=3), torch.bfloat16)
    part = full.slice_rows(128, 131)
    assert part.N == 3
    assert torch.equal(part.dequantize_fp32(), full.dequantize_fp32()[128:131])


def test_shard_owns_its_memory_and_tp1_is_identity(full_formats):
    full = full_formats["dense"]
    shard = shard_weight(full, HEADS, HEAD_ROWS, 8, 3)
    assert shard.weight.untyped_storage().nbytes() == shard.weight.numel() * shard.weight.element_size()
    assert shard_weight(full, HEADS, HEAD_ROWS, 1, 0) is full


def test_deepseek_v3_tp8_block_fp8_is_aligned():
    # 128 heads, P + V = 256, TP 8: 16 heads = 4096 rows per rank, 32 blocks each.
    full = W.Fp8BlockWeight.from_dense(_randn(128 * 256, 128, seed=4), torch.bfloat16)
    shard = shard_weight(full, 128, 256, 8, 7)
    assert (shard.N, tuple(shard.weight_scale_inv.shape)) == (4096, (32, 1))
    assert torch.equal(shard.dequantize_fp32(), full.dequantize_fp32()[7 * 4096:])


def test_block_fp8_boundary_inside_a_128_row_block_is_an_error():
    # P=192, V=256 -> 448 rows per head = 3.5 blocks: one head per rank splits block 3.
    full = W.Fp8BlockWeight.from_dense(_randn(16 * 448, 128, seed=5), torch.bfloat16)
    with pytest.raises(ValueError, match=r"tp_size=16, rank=0 .*rows \[0, 448\)\).*block 3 \(rows \[384, 512\)"):
        shard_weight(full, 16, 448, 16, 0)
    with pytest.raises(ValueError, match=r"rank=1 .*block 3 \(rows \[384, 512\).*at row 448"):
        shard_weight(full, 16, 448, 16, 1)
    # Two heads per rank (896 rows = 7 blocks) align.
    shard = shard_weight(full, 16, 448, 8, 3)
    assert torch.equal(shard.dequantize_fp32(), full.dequantize_fp32()[3 * 896:4 * 896])


def test_marlin_boundary_inside_a_packing_tile_is_an_error_and_the_checkpoint_route_works():
    heads, head_rows = 4, 96  # 96 rows per head: ranks start inside a 64-row tile
    w = _randn(heads * head_rows, K, seed=6)
    fp8 = W.Fp8Weight.from_dense(w, per_channel=True, params_dtype=torch.bfloat16)
    packed = W.MarlinFp8Weight.from_fp8(fp8)
    with pytest.raises(ValueError, match=r"rank=1 .*packing tile 1 \(rows \[64, 128\)\) at row 96.*from_fp8"):
        shard_weight(packed, heads, head_rows, 4, 1)
    # Shard the checkpoint fp8 weight, then pack the shard.
    for rank in range(4):
        shard = W.MarlinFp8Weight.from_fp8(shard_weight(fp8, heads, head_rows, 4, rank))
        assert torch.equal(shard.dequantize_fp32(), packed.dequantize_fp32()[rank * 96:(rank + 1) * 96])


def test_marlin_from_a_sharded_block_checkpoint_equals_the_packed_shard(full_formats):
    blk = full_formats["fp8_block"]
    packed = W.MarlinFp8Weight.from_fp8(blk)
    for tp, rank in SPLITS[1:]:
        a = W.MarlinFp8Weight.from_fp8(shard_weight(blk, HEADS, HEAD_ROWS, tp, rank))
        b = shard_weight(packed, HEADS, HEAD_ROWS, tp, rank)
        assert torch.equal(a.packed.qweight, b.packed.qweight) and torch.equal(a.packed.scales, b.packed.scales)


@pytest.mark.parametrize("group_size", [-1, 128])
def test_marlin_shard_of_vllm_tensors_is_the_vllm_layout_of_the_shard(group_size):
    """A TP shard cut from vLLM's post-load Marlin tensors (64-column blocks: 256 words
    of every qweight row, 64 scale columns) equals vLLM's layout of the sharded weight."""
    from test_kv_b_proj_marlin import vllm_marlin_encode

    n = HEADS * HEAD_ROWS
    if group_size == 128:
        blk = W.Fp8BlockWeight.from_dense(_randn(n, K, seed=8), torch.bfloat16)
        w, s = blk.weight, blk.weight_scale_inv.repeat_interleave(128, 0).t().contiguous()  # [K/128, N]
    else:
        f = W.Fp8Weight.from_dense(_randn(n, K, seed=8), per_channel=True, params_dtype=torch.bfloat16)
        w, s = f.weight, f.weight_scale
    q, sc = vllm_marlin_encode(w, s, group_size, torch.bfloat16)
    full = W.MarlinFp8Weight.from_vllm(q, sc, n, K, group_size, torch.bfloat16)
    for tp, rank in SPLITS[1:]:
        start, stop = shard_rows(HEADS, HEAD_ROWS, tp, rank)
        want_q, want_s = vllm_marlin_encode(w[start:stop], s[..., start:stop], group_size, torch.bfloat16)
        shard = shard_weight(full, HEADS, HEAD_ROWS, tp, rank)
        assert torch.equal(shard.packed.qweight, want_q)
        assert torch.equal(shard.packed.scales.view(torch.int16), want_s.view(torch.int16))
        assert shard.weight.data_ptr() != q.data_ptr()  # the shard owns its tensors


def test_shard_for_reads_the_full_model_config(full_formats):
    cfg = types.SimpleNamespace(num_heads=HEADS, P=128, V=128)
    a = shard_for(full_formats["nvfp4"], cfg, 4, 2)
    b = shard_weight(full_formats["nvfp4"], HEADS, 256, 4, 2)
    assert torch.equal(a.dequantize_fp32(), b.dequantize_fp32())
    with pytest.raises(ValueError, match="model_config.V: expected an int >= 1"):
        shard_for(full_formats["nvfp4"], types.SimpleNamespace(num_heads=HEADS, P=128), 4, 2)
    per_rank = types.SimpleNamespace(num_heads=HEADS // 4, P=128, V=128)
    with pytest.raises(ValueError, match=r"fmt: expected the full model's kv_b_proj, \[2 \* 256 = 512, "
                                         r"L\] .* got N = 2048"):
        shard_for(full_formats["nvfp4"], per_rank, 4, 2)
    with pytest.raises(ValueError, match="tp_size, rank: required with a full-model config"):
        shard_for(full_formats["nvfp4"], cfg)


def test_shard_for_takes_the_rank_from_a_per_rank_model_config(full_formats):
    """MLAModelConfig.shard(tp_size, rank) knows its place: no need to repeat it."""
    from mla_ext.config.models import MLAModelConfig

    full = MLAModelConfig("m", L=full_formats["nvfp4"].K, R=64, P=128, V=128, num_heads=HEADS,
                          num_layers=2)
    mine = full.shard(4, 2)
    a = shard_for(full_formats["nvfp4"], mine)
    b = shard_weight(full_formats["nvfp4"], HEADS, 256, 4, 2)
    assert torch.equal(a.dequantize_fp32(), b.dequantize_fp32())
    assert torch.equal(shard_for(full_formats["nvfp4"], mine, 4, 2).dequantize_fp32(),
                       b.dequantize_fp32())
    with pytest.raises(ValueError, match="rank: model_config is rank 2 of 4; expected 2 or None, got 1"):
        shard_for(full_formats["nvfp4"], mine, 4, 1)


@pytest.mark.parametrize("args, match", [
    ((HEADS, HEAD_ROWS, 3, 0), "tp_size: expected a divisor of num_heads=8"),
    ((HEADS, HEAD_ROWS, 0, 0), "tp_size: expected an int >= 1"),
    ((HEADS, HEAD_ROWS, 2.0, 0), "tp_size: expected an int >= 1, got 2.0"),
    ((HEADS, HEAD_ROWS, True, 0), "tp_size: expected an int >= 1, got True"),
    ((HEADS, HEAD_ROWS, 4, 4), r"rank: expected 0 <= rank < tp_size=4, got 4"),
    ((HEADS, HEAD_ROWS, 4, -1), "rank: expected an int >= 0, got -1"),
    ((HEADS, 0, 4, 1), "head_rows: expected an int >= 1"),
    ((0, HEAD_ROWS, 1, 0), "num_heads: expected an int >= 1"),
    ((16, HEAD_ROWS, 4, 1), r"fmt: expected the full kv_b_proj, N = num_heads \* head_rows = 16 \* 256 = 4096"),
])
def test_argument_errors(full_formats, args, match):
    with pytest.raises(ValueError, match=match):
        shard_weight(full_formats["dense"], *args)


def test_not_a_format_and_bad_row_ranges(full_formats):
    with pytest.raises(ValueError, match="fmt: expected a kv_b_proj WeightFormat .* got Tensor"):
        shard_weight(torch.zeros(4, 4), 1, 4, 1, 0)
    with pytest.raises(ValueError, match=r"expected 0 <= start < stop <= N=2048, got \[10, 10\)"):
        full_formats["dense"].slice_rows(10, 10)
    with pytest.raises(ValueError, match="stop: expected an int row index"):
        full_formats["dense"].slice_rows(0, 1.5)
