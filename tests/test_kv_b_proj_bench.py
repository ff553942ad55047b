"""The kv_b_proj benchmark script runs end to end on the CPU (tiny shapes) and
writes its CSV and PNG; the real numbers come from a GPU run."""
import csv
import importlib.util
import os

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_kv_b_proj_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_kv_b_proj", os.path.join(ROOT, "benchmarks", "bench_kv_b_proj.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cpu", "--N", "144", "--M", "4", "--formats", "dense", "fp8_per_channel",
                "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "kv_b_proj_cpu.csv")))
    got = {(r["format"], r["backend"]) for r in rows}
    assert ("dense", "dequant_dense") in got and ("dense", "dispatch:dequant_dense") in got
    assert ("fp8_per_channel", "scaled_mm_fp8") in got
    assert all(float(r["tflops"]) > 0 and float(r["ratio_vs_cublas_bf16"]) > 0 for r in rows)
    assert (tmp_path / "kv_b_proj_cpu.png").stat().st_size > 0
    assert "crossover M" in capsys.readouterr().out
