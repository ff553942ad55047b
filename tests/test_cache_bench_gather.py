"""benchmarks/bench_gather.py runs end to end on the CPU (tiny sizes), checks every
backend against the torch baseline and writes its CSV and PNG; real numbers come
from `benchmarks/bench_gather.py` itself (CPU) or a GPU run."""
import csv
import importlib.util
import os

import pytest
import torch

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_gather_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_gather", os.path.join(ROOT, "benchmarks", "bench_gather.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    bench.main(["--quick", "--tokens", "200", "--formats", "fp8", "fp8_ds_mla", "--out", str(tmp_path)])
    assert torch.get_num_threads() == threads  # the benchmark restores the thread count
    rows = list(csv.DictReader(open(tmp_path / "gather_cpu.csv")))
    got = {(r["format"], r["block_size"], r["backend"]) for r in rows}
    for fmt in ("fp8", "fp8_ds_mla"):
        for B in ("16", "64"):
            for be in ("copy (roofline)", "torch index_select+dequant", "cpu"):
                assert (fmt, B, be) in got
    assert all(float(r["gbs"]) > 0 and float(r["speedup_vs_torch"]) > 0 for r in rows)
    assert (tmp_path / "gather_cpu.png").stat().st_size > 0
    assert "% copy" in capsys.readouterr().out
