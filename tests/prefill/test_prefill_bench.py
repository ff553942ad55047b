"""The prefill benchmark's torch-composed baseline computes the same layer as
MLAPrefill (several chunks, a request without context, both cache kinds), so
its speed-up numbers compare like with like; a failing or mismatching case is a
row of the CSV and the run goes on."""
import csv
import math

import pytest
import torch

from mla_ext.attention.api import ATTENTION
from mla_ext.kv_b_proj.weights import Fp8BlockWeight
from mla_ext.config.models import MLAModelConfig
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.synthetic import SyntheticBatch
from helpers.numeric import rel_fro
from helpers.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_prefill")


@pytest.mark.parametrize("skip", [(), (1,)])
def test_torch_composed_baseline_equals_layer(bench, skip):
    m = MLAModelConfig("t", L=512, R=64, P=32, V=16, num_heads=2, num_layers=2, max_model_len=256)
    w = torch.randn(m.num_heads * (m.P + m.V), m.L, generator=torch.Generator().manual_seed(3)) / math.sqrt(m.L)
    layer = MLAPrefill(m, CacheConfig("fp8_ds_mla", skip, 16), Fp8BlockWeight.from_dense(w, torch.bfloat16),
                       layer=1, workspace_rows_override=32)
    batch = SyntheticBatch(m, [50, 0, 9], [4, 2, 3], 16, seed=5)
    meta = batch.metadata()
    kv_c, k_pe = batch.layer_context(1)
    cache = batch.fill_cache(layer, kv_c, k_pe)
    with ATTENTION.force("torch"):
        want = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    fmt = "bfloat16" if skip else "fp8_ds_mla"
    # A tiny score budget forces the query-blocked path too.
    got = bench.torch_composed(layer, layer.kv_b_proj.weight_format.dequantize(torch.bfloat16), batch, cache, meta,
                               fmt, max_score_bytes=64)
    assert meta.plan(layer.workspace_rows, layer.chunk_alignment).num_chunks >= 2
    err = rel_fro(got, want)
    assert err < 1e-2 and not torch.isnan(got).any()


def test_failing_and_mismatching_cases_are_rows(bench, tmp_path, monkeypatch):
    real = bench.bench_case

    def case(ctx, *a, **k):
        if ctx == 96:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(ctx, *a, **k)

    monkeypatch.setattr(bench, "bench_case", case)
    monkeypatch.setattr(bench, "measure_peaks", lambda device, timer: (10.0, 0.1))
    rc = bench.main(["--quick", "--context", "96", "64", "--new-tokens", "8", "--out", str(tmp_path)])
    assert rc == 1
    rows = list(csv.DictReader(open(tmp_path / "prefill_cpu.csv")))
    assert [(r["context"], r["impl"], r["status"]) for r in rows] == [
        ("96", "mla_ext", "error"), ("64", "mla_ext", "ok"), ("64", "torch composed", "ok"),
        ("64", "roofline floor", "ok")]
    assert "RuntimeError: CUDA error: an illegal memory access" in rows[0]["error"]

    monkeypatch.setattr(bench, "torch_composed", lambda *a, **k: torch.zeros(8, 16, 128, dtype=torch.bfloat16))
    rc = bench.main(["--quick", "--context", "64", "--new-tokens", "8", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "prefill_cpu.csv")))
    assert rc == 1 and [(r["impl"], r["status"]) for r in rows] == [("mla_ext", "mismatch")]
    assert "differ (rel err" in rows[0]["error"]
