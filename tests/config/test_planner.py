"""Page sizes and the pool plan (SPEC §4): table-driven sizes, invariants under
hypothesis, and allocation of the planned caches."""
import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mla_ext.config.models import MLAModelConfig, get_model_config
from mla_ext.config.planner import REGION_ALIGN, format_bytes, plan_model, plan_pool, render_plan
from mla_ext.config.policy import CacheConfig, resolve_layer, resolve_model

V3 = get_model_config("deepseek-v3")
GiB = 2**30


@pytest.mark.parametrize("model,dtype,B,page", [
    ("deepseek-v3", "auto", 64, 73_728),
    ("deepseek-v3", "bfloat16", 64, 73_728),
    ("deepseek-v3", "fp8", 64, 36_864),
    ("deepseek-v3", "fp8_e5m2", 64, 36_864),
    ("deepseek-v3", "fp8_ds_mla", 64, 41_984),
    ("deepseek-v3", "auto", 16, 18_432),
    ("deepseek-v3", "fp8_ds_mla", 16, 10_496),
    ("deepseek-v2-lite", "fp8_ds_mla", 64, 41_984),
    ("kimi-k2", "fp8", 1, 576),
])
def test_page_bytes_table(model, dtype, B, page):
    s = resolve_layer(CacheConfig(dtype, block_size=B), get_model_config(model), layer=1)
    assert s.page_bytes() == page


def test_fp32_model_native_page():
    m = dataclasses.replace(V3, model_dtype=torch.float32)
    assert resolve_layer(CacheConfig(block_size=64), m, layer=0).page_bytes() == 64 * 4 * 576


def test_deepseek_v3_mixed_plan():
    """The setup upstream refuses (656- and 1152-byte pages): planned here."""
    cfg = CacheConfig("fp8_ds_mla", skip_layers=[0, 1, 60], block_size=64)
    plan = plan_model(cfg, V3, 60 * GiB)
    per_block = 3 * 73_728 + 58 * 41_984
    assert plan.num_blocks == 60 * GiB // per_block == 24_253
    assert plan.bytes_used == plan.num_blocks * per_block <= 60 * GiB
    assert plan.tokens_capacity == 24_253 * 64
    by_layer = {p.layer_index: p for p in plan.layers}
    assert by_layer[0].shape == (24_253, 64, 576) and by_layer[0].dtype == torch.bfloat16
    assert by_layer[5].shape == (24_253, 64, 656) and by_layer[5].dtype == torch.uint8
    assert by_layer[5].quant_mode == "FP8_PER_TILE" and by_layer[60].quant_mode == "NONE"
    assert by_layer[60].skip_reason == "layer 60 in skip list"


def test_table_groups_consecutive_layers():
    cfg = CacheConfig("fp8_ds_mla", skip_layers=[0, 1, 60], block_size=64)
    table = plan_model(cfg, V3, 60 * GiB).format_table("title")
    lines = table.splitlines()
    assert lines[0] == "title"
    body = [line.split()[0] for line in lines[3:] if line and line[0].isdigit()]
    assert body == ["0-1", "2-59", "60"]
    assert "24,253" in table and "1,552,192" in table and "64,424,509,440" in table


def test_to_dict_is_json_and_complete():
    cfg = CacheConfig("fp8", skip_layers=[2], block_size=16)
    m = MLAModelConfig("t", L=64, R=16, P=32, V=32, num_heads=2, num_layers=3)
    d = json.loads(json.dumps(plan_model(cfg, m, 100_000).to_dict()))
    assert d["num_blocks"] * 16 == d["tokens_capacity"]
    assert [x["format"] for x in d["layers"]] == ["fp8", "fp8", "auto"]
    assert [x["dtype"] for x in d["layers"]] == ["uint8", "uint8", "bfloat16"]
    assert sum(x["bytes"] for x in d["layers"]) <= d["bytes_used"] <= d["budget"] == 100_000


def test_render_plan_json_has_model_and_config():
    cfg = CacheConfig("fp8_ds_mla", skip_layers=["sliding_window", 0], block_size=64)
    d = json.loads(render_plan(V3, cfg, GiB, as_json=True))
    assert d["model"]["name"] == "deepseek-v3" and d["model"]["num_layers"] == 61
    assert d["cache_config"]["skip_layers"] == ["sliding_window", 0]


def test_not_even_one_block():
    specs = resolve_model(CacheConfig("fp8_ds_mla", block_size=64), V3)
    need = 61 * 41_984
    with pytest.raises(ValueError, match=f"memory_bytes.*{need:,} bytes needed"):
        plan_pool(specs, need - 1)
    assert plan_pool(specs, need).num_blocks == 1


@pytest.mark.parametrize("memory", [0, -1, 1.5, True, "1GiB"])
def test_bad_memory(memory):
    specs = resolve_model(CacheConfig(), V3)
    with pytest.raises(ValueError, match="memory_bytes"):
        plan_pool(specs, memory)


def test_bad_layer_specs():
    a = resolve_layer(CacheConfig(block_size=16), V3, layer=0)
    b = resolve_layer(CacheConfig(block_size=32), V3, layer=1)
    with pytest.raises(ValueError, match="at least one"):
        plan_pool([], GiB)
    with pytest.raises(ValueError, match="block_size"):
        plan_pool([a, b], GiB)
    with pytest.raises(ValueError, match="duplicate"):
        plan_pool([a, a], GiB)
    with pytest.raises(ValueError, match="LayerCacheSpec"):
        plan_pool([a, "fp8"], GiB)


def test_alignment_not_a_multiple_of_the_element():
    specs = resolve_model(CacheConfig(block_size=1), MLAModelConfig(
        "t", L=3, R=0, P=4, V=4, num_heads=1, num_layers=1))
    with pytest.raises(ValueError, match="alignment"):
        plan_pool(specs, 10_000, alignment=7)  # 6-byte bf16 page -> 7, not even


def test_format_bytes():
    assert [format_bytes(n) for n in (5, 2048, 3 * 2**20, 60 * GiB, 2**41)] == [
        "5 B", "2.00 KiB", "3.00 MiB", "60.00 GiB", "2.00 TiB"]


# -- invariants ------------------------------------------------------------------

def layout_end(plan_layers, num_blocks):
    """Independent oracle: bytes a shared buffer needs for `num_blocks` blocks."""
    end = 0
    for p in plan_layers:
        end = -(-end // REGION_ALIGN) * REGION_ALIGN + num_blocks * p.page_bytes
    return end


@st.composite
def setups(draw):
    L = draw(st.integers(1, 1024))
    R = draw(st.sampled_from([0, 16, 64]))
    if draw(st.booleans()):
        L, R = 512, draw(st.sampled_from([0, 64]))  # fp8_ds_mla dims
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    n = draw(st.integers(1, 12))
    model = MLAModelConfig("h", L=L, R=R, P=8, V=8, num_heads=1, num_layers=n,
                           model_dtype=dtype, sliding_window_layers=draw(
                               st.frozensets(st.integers(0, n - 1))))
    names = ["auto", "fp8", "fp8_e5m2"] + (["fp8_ds_mla"] if (L, R) in [(512, 0), (512, 64)] else [])
    skips = draw(st.lists(st.one_of(st.integers(0, n - 1), st.just("sliding_window")), max_size=4))
    cfg = CacheConfig(draw(st.sampled_from(names)), tuple(skips), draw(st.integers(1, 128)))
    memory = draw(st.integers(1, 2**34))
    alignment = draw(st.one_of(st.none(), st.sampled_from([2, 16, 256, 4096]), st.integers(1, 5000)))
    return model, cfg, memory, alignment


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_plan_invariants(setup):
    model, cfg, memory, alignment = setup
    specs = resolve_model(cfg, model)
    pages = [s.page_bytes(alignment) for s in specs]
    assume(all(p % s.storage_dtype.itemsize == 0 for s, p in zip(specs, pages)))
    one_block = sum(-(-p // REGION_ALIGN) * REGION_ALIGN for p in pages[:-1]) + pages[-1]
    if one_block > memory:
        with pytest.raises(ValueError, match="memory_bytes"):
            plan_pool(specs, memory, alignment)
        return
    plan = plan_pool(specs, memory, alignment)
    n = plan.num_blocks
    assert n >= 1 and plan.budget == memory
    assert plan.bytes_used == layout_end(plan.layers, n) <= memory  # never over budget
    assert layout_end(plan.layers, n + 1) > memory  # maximal: one more block does not fit
    assert plan.tokens_capacity == n * cfg.block_size
    end = 0
    for s, p, page in zip(specs, plan.layers, pages):  # every layer fits, in its own region
        assert p.layer_index == s.layer_index and p.page_bytes == page
        assert page >= cfg.block_size * s.bytes_per_token
        assert p.shape == (n, cfg.block_size, s.entry_elems) and p.dtype == s.storage_dtype
        assert p.bytes == n * page
        assert p.offset >= end and p.offset % REGION_ALIGN == 0
        end = p.offset + p.bytes
        # the strided tensor's last element lies inside the region
        last = sum((d - 1) * st_ for d, st_ in zip(p.shape, p.strides)) + 1
        assert last * p.dtype.itemsize <= p.bytes
    assert end == plan.bytes_used


# -- allocation ------------------------------------------------------------------

TINY = MLAModelConfig("tiny", L=512, R=64, P=8, V=8, num_heads=1, num_layers=4)


def tiny_plan(alignment=None, memory=200_000):
    cfg = CacheConfig("fp8_ds_mla", skip_layers=[0, 3], block_size=4)
    return plan_model(cfg, TINY, memory, alignment)


def check_caches(plan, caches):
    assert len(caches) == len(plan.layers)
    for p, t in zip(plan.layers, caches):
        assert tuple(t.shape) == p.shape and t.dtype == p.dtype
        assert t.stride() == p.strides
    # Poison each layer with its own value, then check none overwrote another.
    for i, t in enumerate(caches):
        t.fill_(i + 1)
    for i, t in enumerate(caches):
        assert bool((t == i + 1).all()), f"layer {i} was overwritten"


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("alignment", [None, 4096])
def test_allocate_cpu(shared, alignment):
    plan = tiny_plan(alignment)
    caches = plan.allocate("cpu", shared=shared)
    check_caches(plan, caches)
    assert [t.dtype for t in caches] == [torch.bfloat16, torch.uint8, torch.uint8, torch.bfloat16]
    if alignment:
        assert caches[1].stride(0) == 4096 > 4 * 656  # padded page: block stride grows
        assert caches[0].stride(0) == 8192 // 2 > 4 * 576  # 4608-byte page -> 8192, in bf16 elements
    if shared:
        base = caches[0].untyped_storage().data_ptr()
        for p, t in zip(plan.layers, caches):
            assert t.untyped_storage().data_ptr() == base
            assert t.data_ptr() - base == p.offset
        assert caches[0].untyped_storage().nbytes() == plan.bytes_used


def test_allocate_meta_full_size():
    cfg = CacheConfig("fp8_ds_mla", skip_layers=[0, 1, 60], block_size=64)
    plan = plan_model(cfg, V3, 60 * GiB)
    caches = plan.allocate("meta", shared=True)
    assert caches[0].shape == (24_253, 64, 576) and caches[2].shape == (24_253, 64, 656)


@pytest.mark.cuda
@pytest.mark.parametrize("shared", [False, True])
def test_allocate_cuda(shared):
    plan = tiny_plan(256)
    caches = plan.allocate("cuda", shared=shared)
    assert all(t.is_cuda for t in caches)
    check_caches(plan, caches)
