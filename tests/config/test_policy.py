"""Per-layer KV-cache policy (SPEC §3): every branch and every error."""
import dataclasses

import numpy as np
import pytest
import torch

from mla_ext.config.formats import QuantMode, get_format
from mla_ext.config.models import MLAModelConfig, get_model_config
from mla_ext.config.policy import (
    CacheConfig,
    LayerCacheSpec,
    layer_index_from_prefix,
    parse_skip_entry,
    resolve_layer,
    resolve_model,
)

V3 = get_model_config("deepseek-v3")
# A small model with windowed layers 1 and 3 (for the `sliding_window` entry).
SWA = MLAModelConfig("swa", L=512, R=64, P=128, V=128, num_heads=4, num_layers=5,
                     sliding_window_layers={1, 3})


# -- CacheConfig -------------------------------------------------------------

def test_defaults():
    c = CacheConfig()
    assert (c.kv_cache_dtype, c.skip_layers, c.block_size, c.calculate_kv_scales) == (
        "auto", (), 16, False)


@pytest.mark.parametrize("entry,expect", [
    (0, 0), (12, 12), ("12", 12), ("007", 7), (np.int64(3), 3),
    ("sliding_window", "sliding_window"),
])
def test_good_skip_entries(entry, expect):
    assert parse_skip_entry(entry) == expect
    assert CacheConfig(skip_layers=[entry]).skip_layers == (expect,)


@pytest.mark.parametrize("entry", [
    True, False, -1, 1.5, 2.0, "1.5", "abc", "", "-1", " 12", "12 ", "+3", "١٢", None,
    "SLIDING_WINDOW", b"1",
])
def test_bad_skip_entries_name_the_entry(entry):
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers") as e:
        CacheConfig("fp8", skip_layers=[0, entry])
    assert repr(entry) in str(e.value)


@pytest.mark.parametrize("skip", ["0", 0, None])
def test_skip_layers_must_be_a_list(skip):
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers"):
        CacheConfig("fp8", skip_layers=skip)


def test_skip_entries_normalised_and_deduplicated():
    c = CacheConfig("fp8", skip_layers=["1", 1, "sliding_window", 0, "sliding_window"])
    assert c.skip_layers == (1, "sliding_window", 0)
    assert c.skip_indices == {0, 1} and c.skips_sliding_window


@pytest.mark.parametrize("dtype", ["fp9", "FP8", "", None, 8])
def test_unknown_kv_cache_dtype(dtype):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(dtype)


@pytest.mark.parametrize("b", [0, -16, 1.0, True, "16"])
def test_bad_block_size(b):
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=b)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_bad_calculate_kv_scales(flag):
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        CacheConfig(calculate_kv_scales=flag)


def test_cache_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().kv_cache_dtype = "fp8"


# -- layer index from a module prefix ------------------------------------------

@pytest.mark.parametrize("prefix,index", [
    ("model.layers.12.self_attn.attn", 12),
    ("model.layers.0.self_attn", 0),
    ("layers.60", 60),
    ("language_model.model.layers.3.self_attn.mla_attn", 3),
])
def test_prefix_index(prefix, index):
    assert layer_index_from_prefix(prefix) == index


@pytest.mark.parametrize("prefix", [
    "model.self_attn", "", "model.layers.1.mlp.experts.7", "model.layers.x1.attn",
    "model.layers.-1.attn",
])
def test_bad_prefix_names_it(prefix):
    with pytest.raises(ValueError) as e:
        layer_index_from_prefix(prefix)
    assert repr(prefix) in str(e.value)


def test_prefix_must_be_str():
    with pytest.raises(ValueError, match="prefix"):
        layer_index_from_prefix(12)


# -- resolution ------------------------------------------------------------------

def test_needs_layer_or_prefix():
    with pytest.raises(ValueError, match="layer index"):
        resolve_layer(CacheConfig(), V3)


def test_layer_and_prefix_must_agree():
    s = resolve_layer(CacheConfig(), V3, layer=5, prefix="model.layers.5.self_attn.attn")
    assert s.layer_index == 5
    with pytest.raises(ValueError, match="disagrees"):
        resolve_layer(CacheConfig(), V3, layer=4, prefix="model.layers.5.self_attn.attn")


@pytest.mark.parametrize("layer", [True, 1.0, "3"])
def test_layer_must_be_int(layer):
    with pytest.raises(ValueError, match="layer"):
        resolve_layer(CacheConfig(), V3, layer=layer)


@pytest.mark.parametrize("kw", [dict(layer=61), dict(layer=-1),
                                dict(prefix="model.layers.61.self_attn.attn")])
def test_layer_out_of_range(kw):
    with pytest.raises(ValueError, match="out of range"):
        resolve_layer(CacheConfig(), V3, **kw)


def test_skip_index_out_of_range_is_a_config_error():
    cfg = CacheConfig("fp8", skip_layers=[0, 61, 99])
    # Even resolving a layer that is not in the list fails: the list itself is wrong.
    for call in (lambda: resolve_layer(cfg, V3, layer=5), lambda: resolve_model(cfg, V3)):
        with pytest.raises(ValueError, match=r"kv_cache_dtype_skip_layers.*\[61, 99\]"):
            call()


def test_skipped_layer_is_native():
    cfg = CacheConfig("fp8_ds_mla", skip_layers=["0", 60], block_size=64,
                      calculate_kv_scales=True)
    for layer in (0, 60):
        s = resolve_layer(cfg, V3, layer=layer)
        assert s.skipped and s.skip_reason == f"layer {layer} in skip list"
        assert s.kv_cache_dtype == "auto" and s.format is get_format("auto")
        assert s.requested_format == "fp8_ds_mla"
        assert s.quant_mode == QuantMode.NONE and not s.is_quantized
        assert s.calculate_kv_scales is False
        assert s.storage_dtype == s.workspace_dtype == torch.bfloat16
        assert s.entry_elems == 576 and s.bytes_per_token == 1152


def test_quantized_layer_is_ds_mla():
    cfg = CacheConfig("fp8_ds_mla", skip_layers=[0], block_size=64, calculate_kv_scales=True)
    s = resolve_layer(cfg, V3, prefix="model.layers.1.self_attn.attn")
    assert not s.skipped and s.skip_reason is None
    assert s.quant_mode == QuantMode.FP8_PER_TILE
    assert s.storage_dtype == torch.uint8 and s.entry_elems == 656 and s.bytes_per_token == 656
    assert s.workspace_dtype == torch.bfloat16  # the gather dequantizes into the model dtype
    assert s.calculate_kv_scales is False  # tile scales live in the row, no K scale


@pytest.mark.parametrize("name,fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                      ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("calc", [False, True])
def test_per_tensor_fp8_layer(name, fp8, calc):
    s = resolve_layer(CacheConfig(name, calculate_kv_scales=calc), V3, layer=3)
    assert s.quant_mode == QuantMode.FP8_PER_TENSOR and s.format.fp8_dtype == fp8
    assert s.storage_dtype == torch.uint8 and s.entry_elems == 576 and s.bytes_per_token == 576
    assert s.calculate_kv_scales is calc


def test_sliding_window_entry():
    cfg = CacheConfig("fp8", skip_layers=["sliding_window", 4], calculate_kv_scales=True)
    specs = resolve_model(cfg, SWA)
    assert [s.skip_reason for s in specs] == [
        None, "sliding_window", None, "sliding_window", "layer 4 in skip list"]
    assert [s.kv_cache_dtype for s in specs] == ["fp8", "auto", "fp8", "auto", "auto"]
    assert [s.calculate_kv_scales for s in specs] == [True, False, True, False, False]


def test_sliding_window_entry_without_windowed_layers_skips_nothing():
    specs = resolve_model(CacheConfig("fp8", skip_layers=["sliding_window"]), V3)
    assert not any(s.skipped for s in specs)


def test_without_sliding_window_entry_windowed_layers_are_quantized():
    specs = resolve_model(CacheConfig("fp8"), SWA)
    assert all(s.quant_mode == QuantMode.FP8_PER_TENSOR for s in specs)


def test_ds_mla_needs_512_64_and_names_the_layer():
    m = MLAModelConfig("small", L=256, R=64, P=64, V=64, num_heads=2, num_layers=3)
    with pytest.raises(ValueError, match=r"layer 0 of small.*L=512") as e:
        resolve_model(CacheConfig("fp8_ds_mla"), m)
    assert "fp8_ds_mla" in str(e.value)
    # Skipping every layer leaves nothing in fp8_ds_mla: fine.
    assert len(resolve_model(CacheConfig("fp8_ds_mla", skip_layers=[0, 1, 2]), m)) == 3
    with pytest.raises(ValueError, match="layer 2 of small"):
        resolve_model(CacheConfig("fp8_ds_mla", skip_layers=[0, 1]), m)


def test_ds_mla_with_rope_zero():
    m = MLAModelConfig("norope", L=512, R=0, P=64, V=64, num_heads=2, num_layers=2)
    s = resolve_layer(CacheConfig("fp8_ds_mla"), m, layer=0)
    assert s.entry_elems == 656 and s.bytes_per_token == 656
    native = resolve_layer(CacheConfig("fp8_ds_mla", skip_layers=[1]), m, layer=1)
    assert native.entry_elems == 512 and native.bytes_per_token == 1024


@pytest.mark.parametrize("model_dtype,name,ok", [
    (torch.bfloat16, "bfloat16", True), (torch.bfloat16, "bf16", True),
    (torch.bfloat16, "float16", False), (torch.float16, "float16", True),
    (torch.float16, "half", True), (torch.float16, "bfloat16", False),
    (torch.float32, "bfloat16", False), (torch.float32, "auto", True),
])
def test_explicit_native_dtype_must_be_the_model_dtype(model_dtype, name, ok):
    m = dataclasses.replace(V3, model_dtype=model_dtype)
    if ok:
        s = resolve_layer(CacheConfig(name), m, layer=0)
        assert s.storage_dtype == s.workspace_dtype == model_dtype
        assert s.bytes_per_token == 576 * model_dtype.itemsize
    else:
        with pytest.raises(ValueError, match="native cache must hold the model dtype"):
            resolve_layer(CacheConfig(name), m, layer=0)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32])
def test_workspace_is_model_dtype_for_quantized_layers(model_dtype):
    m = dataclasses.replace(V3, model_dtype=model_dtype)
    for name in ("fp8", "fp8_e5m2", "fp8_ds_mla"):
        s = resolve_layer(CacheConfig(name), m, layer=0)
        assert s.storage_dtype == torch.uint8 and s.workspace_dtype == model_dtype


def test_resolve_model_is_per_layer_and_immutable():
    specs = resolve_model(CacheConfig("fp8_ds_mla", skip_layers=[0, 1, 60], block_size=64), V3)
    assert [s.layer_index for s in specs] == list(range(61))
    assert [s.kv_cache_dtype for s in specs] == ["auto"] * 2 + ["fp8_ds_mla"] * 58 + ["auto"]
    assert all(s.block_size == 64 for s in specs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        specs[5].quant_mode = QuantMode.NONE


# -- a spec cannot be inconsistent -------------------------------------------------

@pytest.mark.parametrize("change,match", [
    # upstream #48378: a quantized fp8_ds_mla layer left at quant mode NONE
    (dict(quant_mode=QuantMode.NONE), "quant_mode"),
    (dict(entry_elems=576), "entry_elems"),
    (dict(bytes_per_token=576), "bytes_per_token"),
    (dict(storage_dtype=torch.bfloat16), "storage_dtype"),
    (dict(workspace_dtype=torch.uint8), "workspace_dtype"),
    (dict(skipped=True, skip_reason="x"), "skipped layer"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales"),
    (dict(skip_reason="layer 2 in skip list"), "skip_reason"),
])
def test_inconsistent_spec_is_rejected(change, match):
    s = resolve_layer(CacheConfig("fp8_ds_mla"), V3, layer=2)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(s, **change)


def test_skipped_spec_cannot_compute_scales():
    s = resolve_layer(CacheConfig("fp8", skip_layers=[2]), V3, layer=2)
    with pytest.raises(ValueError, match="skipped layer"):
        dataclasses.replace(s, calculate_kv_scales=True)
    with pytest.raises(ValueError, match="skip_reason"):
        dataclasses.replace(s, skip_reason=None)


def test_spec_rejects_foreign_native_dtype():
    s = resolve_layer(CacheConfig("bfloat16"), V3, layer=0)
    with pytest.raises(ValueError, match="native cache"):
        LayerCacheSpec(**{**dataclasses.asdict(s), "format": s.format,
                          "model_dtype": torch.float16, "workspace_dtype": torch.float16})


# -- page bytes and shapes -------------------------------------------------------

@pytest.mark.parametrize("alignment,expect", [(None, 41984), (1, 41984), (256, 41984),
                                              (4096, 45056), (1000, 42000)])
def test_page_bytes_alignment(alignment, expect):
    s = resolve_layer(CacheConfig("fp8_ds_mla", block_size=64), V3, layer=2)
    assert s.page_bytes(alignment) == expect


@pytest.mark.parametrize("alignment", [0, -4, 1.5, True])
def test_page_bytes_bad_alignment(alignment):
    s = resolve_layer(CacheConfig("fp8", block_size=64), V3, layer=2)
    with pytest.raises(ValueError, match="alignment"):
        s.page_bytes(alignment)


def test_cache_shape():
    cfg = CacheConfig("fp8_ds_mla", skip_layers=[0], block_size=16)
    assert resolve_layer(cfg, V3, layer=0).cache_shape(10) == (10, 16, 576)
    assert resolve_layer(cfg, V3, layer=1).cache_shape(10) == (10, 16, 656)
