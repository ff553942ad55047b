"""benchmarks/bench_cache.py runs end to end on the CPU (tiny sizes), checks every
backend against the torch baseline and writes its CSV and PNG, keeping a failing or
wrong backend as a row; real numbers come from `benchmarks/bench_cache.py` itself
(CPU) or a GPU run."""
import csv

import pytest
import torch
from helpers.benchmarks import load_benchmark

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_cache")


def test_bench_cache_cpu_smoke(bench, tmp_path, capsys):
    threads = torch.get_num_threads()
    rc = bench.main(["--quick", "--tokens", "200", "--formats", "fp8", "fp8_ds_mla", "--out", str(tmp_path)])
    assert rc == 0
    assert torch.get_num_threads() == threads  # the benchmark restores the thread count
    rows = list(csv.DictReader(open(tmp_path / "gather_cpu.csv")))
    assert all(r["status"] == "ok" and r["reps"] == "3" for r in rows)
    got = {(r["format"], r["block_size"], r["backend"]) for r in rows}
    for fmt in ("fp8", "fp8_ds_mla"):
        for B in ("16", "64"):
            for be in ("copy (roofline)", "torch index_select+dequant", "cpu"):
                assert (fmt, B, be) in got
    assert all(float(r["gbs"]) > 0 and float(r["speedup_vs_torch"]) > 0 for r in rows)
    assert (tmp_path / "gather_cpu.png").stat().st_size > 0
    assert "% copy" in capsys.readouterr().out


def test_a_wrong_or_failing_backend_is_a_row_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    """A backend that writes wrong values is a mismatch row, one that raises an
    error row; the other backends and configurations are still measured."""
    def wrong(inp):
        inp.dst.zero_()

    def boom(inp):
        raise RuntimeError("no kernel image is available for execution on the device")

    fake = {"cpu": wrong, "torch": boom}
    extra = [type(b)("torch", b.reasons, boom) for b in bench.api.GATHER.backends if b.name == "cpu"]
    backends = [type(b)(b.name, b.reasons, fake.get(b.name, b.run)) for b in bench.api.GATHER.backends]
    monkeypatch.setattr(bench.api.GATHER, "_backends", backends + extra)
    rc = bench.main(["--quick", "--reps", "1", "--tokens", "64", "--formats", "fp8", "--out", str(tmp_path)])
    assert rc == 1
    rows = list(csv.DictReader(open(tmp_path / "gather_cpu.csv")))
    by = {(r["block_size"], r["backend"]): r for r in rows}
    for B in ("16", "64"):
        assert by[(B, "cpu")]["status"] == "mismatch" and "differs from the torch baseline" in by[(B, "cpu")]["error"]
        assert by[(B, "torch")]["status"] == "error" and "RuntimeError: no kernel image" in by[(B, "torch")]["error"]
        assert by[(B, "torch index_select+dequant")]["status"] == "ok"
