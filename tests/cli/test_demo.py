"""`python -m mla_ext demo` at its --tiny size, and the per-step timing helpers.

The demo's prefill runs a 4-layer DeepSeek-shaped stack (layers 0 and 3
skipped: native bf16 cache; 1 and 2 fp8_ds_mla; block-FP8, Marlin FP8 and
NVFP4 kv_b_proj weights) and checks every layer against the one-shot oracle;
then one real-model step: a tiny random transformers DeepSeek-V3 layer through
mla_ext beside transformers' own forward (skipped, saying why, without transformers).
"""
import importlib.util
import json
import sys

import pytest

import torch

from mla_ext import demo
from mla_ext.demo import run_demo
from mla_ext.config.models import MLAModelConfig
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.synthetic import SyntheticBatch
from mla_ext.prefill.timing import StepClock, step_work

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_tiny_demo_checks_every_layer(capsys):
    assert run_demo(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "24,253" in out  # the DeepSeek-V3 cache plan comes first
    for i in range(4):
        assert f"layer {i}: kv_cache_dtype=" in out
    assert out.count("kv_cache_dtype=auto (skipped") == 2 and out.count("kv_cache_dtype=fp8_ds_mla, quant_mode") == 2
    for fmt in ("fp8_block", "marlin_fp8", "nvfp4", "656 B/token", "1152 B/token", "input dtype torch.bfloat16"):
        assert fmt in out
    for step in ("gather", "kv_b_proj", "attention", "merge", "GB/s", "TFLOP/s"):
        assert step in out
    assert out.count("(tolerance 1e-02) ok") == 4 and "all 4 layers ok" in out
    if HAS_TRANSFORMERS:
        assert "Real model: transformers" in out and "DeepseekV3Attention" in out
        assert "transformers' module.scaling 0.16563" in out and "softmax scale 0.16563" in out
        assert "cache fp8_ds_mla, kv_b_proj marlin_fp8" in out and out.rstrip().endswith("real-model step ok")
    else:
        assert "Real model (transformers DeepSeek-V3 layer): skipped: transformers cannot be imported" in out


def test_tiny_demo_json_and_failure_exit_code(capsys, monkeypatch):
    assert run_demo(["--tiny", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_blocks"] == 24_253
    p = doc["prefill"]
    assert p["ok"] and [r["kv_cache_dtype"] for r in p["layers"]] == ["auto", "fp8_ds_mla", "fp8_ds_mla", "auto"]
    for r in p["layers"]:
        assert 0 < r["rel_err"] <= 1e-2 and r["chunks"] >= 2
        assert all(s["seconds"] > 0 for s in r["steps"].values())
    real = doc["real_model"]
    if HAS_TRANSFORMERS:
        # The config-derived scale is transformers' own (DeepSeek-V3 yarn), not the bare one.
        assert real["ok"] and real["softmax_scale"] == pytest.approx(real["module_scaling"], rel=1e-12)
        assert real["softmax_scale"] > 1.8 * real["base_scale"]
        assert 0 < real["vs_transformers"] <= 2e-2 and 0 < real["vs_fp64"] <= 2e-2
        assert real["kv_cache_dtype"] == "fp8_ds_mla" and real["chunks"] >= 2
    else:
        assert "skipped" in real
    # A layer, or the real-model step, outside its tolerance makes the demo fail.
    monkeypatch.setattr(demo, "TOLERANCE", 1e-9)
    monkeypatch.setattr(demo, "REAL_TOLERANCE", 1e-9)
    assert run_demo(["--tiny"]) == 1
    out = capsys.readouterr().out
    assert "FAILED layers: [0, 1, 2, 3]" in out
    assert ("FAILED: the real-model step" in out) == HAS_TRANSFORMERS


def test_real_model_step_without_transformers_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    r = demo.run_transformers_step(demo.SIZES["tiny"], torch.device("cpu"), 0)
    assert r == {"skipped": r["skipped"]} and "transformers cannot be imported (ModuleNotFoundError" in r["skipped"]
    assert demo.format_transformers_step(r).startswith(
        "Real model (transformers DeepSeek-V3 layer): skipped: transformers cannot be imported")


def test_step_work_counts_and_clock():
    m = MLAModelConfig("t", L=512, R=64, P=32, V=16, num_heads=2, num_layers=2, max_model_len=256)
    from mla_ext.kv_b_proj.weights import DenseWeight

    layer = MLAPrefill(m, CacheConfig("fp8_ds_mla", (), 16), DenseWeight.from_dense(torch.randn(96, 512)),
                       layer=1, workspace_rows_override=32)
    batch = SyntheticBatch(m, [40, 0, 7], [3, 1, 2], 16)
    meta = batch.metadata()
    work = step_work(layer, meta)
    assert work["gather"].amount == 47 * (656 + 576 * 2)
    assert work["kv_b_proj"].amount == 2 * (6 + 47) * 96 * 512
    # causal pairs 6 + 1 + 3, context pairs 3*40 + 2*7, Dqk + Dv = 96 + 16
    assert work["attention"].amount == 2 * (10 + 134) * 2 * 112
    chunks = meta.plan(layer.workspace_rows, layer.chunk_alignment).chunks
    assert work["merge"].amount == (sum(c.token_end - c.token_start for c in chunks) + 6) * 2 * 3 * (16 * 2 + 4)
    clock = StepClock("cpu")
    kv_c, k_pe = batch.layer_context(1)
    cache = batch.fill_cache(layer, kv_c, k_pe)
    out = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, clock=clock)
    t = clock.totals()
    assert set(t) == {"gather", "kv_b_proj", "keys", "attention", "merge", "total"}
    assert abs(t["total"] - sum(v for k, v in t.items() if k != "total")) < 1e-9
    # The clock does not change the result.
    assert torch.equal(out, layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta))


@pytest.mark.parametrize("args,match", [
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "cuda:64"], "argument --device: 'cuda:64': this machine has"),
    (["--check-queries", "-1"], "argument --check-queries: expected an integer >= 1, got '-1'"),
    (["--check-queries", "0"], "argument --check-queries: expected an integer >= 1, got '0'"),
])
def test_bad_demo_arguments_are_usage_errors_not_tracebacks(args, match, capsys):
    with pytest.raises(SystemExit) as e:
        run_demo(["--tiny", *args])
    assert e.value.code == 2
    assert match in capsys.readouterr().err
