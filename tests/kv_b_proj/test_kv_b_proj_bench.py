"""The kv_b_proj benchmark script runs end to end on the CPU (tiny shapes), writes
its CSV row by row, keeps going past a failing or wrong backend, and reports the
dispatch thresholds' crossovers from whatever rows exist; the real numbers come
from a GPU run (benchmarks/gpu_check.sh)."""
import csv
import json
import re

import pytest
import torch
from helpers.benchmarks import load_benchmark

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_kv_b_proj")


def _rows(path):
    return list(csv.DictReader(open(path)))


def _replace_backend(monkeypatch, bench, name, run, reasons=None):
    backends = [type(b)(name, reasons or b.reasons, run) if b.name == name else b for b in bench.DISPATCH.backends]
    monkeypatch.setattr(bench.DISPATCH, "_backends", backends)


def _cpu_scaled_mm(bench) -> bool:
    """Whether this torch's CPU _scaled_mm serves per-channel fp8 (torch 2.11's takes
    per-tensor scales only, and the backend says so)."""
    layer = bench.KvBProj(bench.W.quantize("fp8_per_channel", torch.randn(128, bench.K) * 0.05, torch.bfloat16))
    return "scaled_mm_fp8" in bench.usable_backends(layer, torch.zeros(4, bench.K, dtype=torch.bfloat16))


def test_bench_kv_b_proj_cpu_smoke(bench, tmp_path, capsys):
    rc = bench.main(["--device", "cpu", "--N", "144", "--M", "4", "--formats", "dense", "fp8_per_channel",
                     "--out", str(tmp_path)])
    assert rc == 0
    rows = _rows(tmp_path / "kv_b_proj_cpu.csv")
    got = {(r["format"], r["backend"]) for r in rows}
    assert ("dense", "dequant_dense") in got and ("dense", "dispatch:dequant_dense") in got
    assert (("fp8_per_channel", "scaled_mm_fp8") in got) == _cpu_scaled_mm(bench)
    assert all(r["status"] == "ok" and r["error"] == "" for r in rows)
    assert all(float(r["tflops"]) > 0 and float(r["ratio_vs_cublas_bf16"]) > 0 for r in rows)
    assert all(float(r["mean_rel_err"]) < bench.MAX_MEAN_REL for r in rows)
    assert all(float(r["floor_us"]) > 0 and float(r["x_floor"]) > 0 for r in rows)  # physical limits, same run
    assert {r["weight_format"] for r in rows} == {"dense", "fp8"}
    assert (tmp_path / "kv_b_proj_cpu.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "crossover M" in out and "physical limits measured in this run: copy" in out
    table = json.load(open(tmp_path / "dispatch_table_cpu.json"))
    assert table["device"] == "cpu" and "dense/bfloat16/x=bfloat16/K=512/N=144/M=4" in table["ops"]["kv_b_proj"]["entries"]


def test_a_run_writes_the_dispatch_table_the_dispatcher_reads(bench, tmp_path, monkeypatch):
    """The measured rows become mla_ext.dispatch table entries (correct rows only,
    fastest first); pointed at that table, KvBProj names the entry in explain()."""
    from mla_ext import dispatch as D

    table = tmp_path / "tables" / "cpu.json"
    D.write_table_entries(str(table), "cpu", "attention", {"k": {"order": ["torch"]}})  # another op's section
    rc = bench.main(["--device", "cpu", "--N", "128", "--M", "4", "16", "--formats", "dense", "fp8_block",
                     "fp8_per_tensor", "fp8_per_channel", "--out", str(tmp_path), "--table", str(table)])
    assert rc == 0
    data = json.load(open(table))
    assert data["ops"]["attention"]["entries"] == {"k": {"order": ["torch"]}}
    entries = data["ops"]["kv_b_proj"]["entries"]
    key = "fp8_block/bfloat16/x=bfloat16/K=512/N=128/M=16"
    assert entries[key]["order"][0] == "dequant_dense" and "dispatch:dequant_dense" not in entries[key]["us"]
    fp8 = entries["fp8/bfloat16/x=bfloat16/K=512/N=128/M=4"]  # per-tensor and per-channel share the format
    assert fp8["recipes"] == ["fp8_per_channel", "fp8_per_tensor"]
    assert fp8["order"] == sorted(fp8["us"], key=fp8["us"].get)
    assert "bench_kv_b_proj.py" in data["ops"]["kv_b_proj"]["source"]
    monkeypatch.setenv(D.TABLES_ENV, str(table.parent))
    D.clear_table_cache()
    try:
        layer = bench.KvBProj(bench.W.quantize("fp8_block", torch.randn(128, bench.K) * 0.05, torch.bfloat16))
        text = layer.explain(16)
        assert f"measured fastest usable backend: dispatch table {table} [kv_b_proj] '{key}'" in text
        assert "uses 'dequant_dense'" in text
    finally:
        D.clear_table_cache()


def test_side_by_side_lists_every_backend_fastest_first(bench):
    rows = [dict(_row(4096, "fp8_block", b, 8192, us, ratio=r), x_floor=f, cublas_bf16_us=100.0)
            for b, us, r, f in (("triton_fp8_block", 90.0, 1.1, 2.0), ("scaled_mm_block", 55.0, 1.8, 1.2),
                                ("dequant_dense", 101.0, 0.99, 2.2), ("dispatch:scaled_mm_block", 56.0, 1.8, 1.2))]
    lines = bench.side_by_side(rows)
    assert lines == ["N=4096 M=8192 fp8_block: scaled_mm_block 55 us x1.80 (1.20x floor) | triton_fp8_block 90 us "
                     "x1.10 (2.00x floor) | dequant_dense 101 us x0.99 (2.20x floor) | cuBLAS bf16 100.0 us"]
    assert "every backend side by side" in "\n".join(bench.report(rows, is_gpu=True))


def test_sweep_on_the_cpu_reports_every_threshold(bench, tmp_path, capsys):
    rc = bench.main(["--sweep", "--device", "cpu", "--M", "1", "16",
                     "--formats", "dense", "marlin_fp8", "fp8_per_tensor", "--out", str(tmp_path)])
    assert rc == 0
    rows = _rows(tmp_path / "kv_b_proj_cpu.csv")
    assert {int(r["N"]) for r in rows} == set(bench.CPU_SWEEP_N)
    assert {int(r["M"]) for r in rows} == {1, 16}
    assert ("marlin_fp8", "marlin_w8a16") in {(r["format"], r["backend"]) for r in rows}
    text = (tmp_path / "kv_b_proj_crossovers_cpu.txt").read_text()
    for name in ("MARLIN_MAX_M", "W4A16_MAX_M", "FP8_NATIVE_MIN_M"):
        assert name in text
    assert re.search(r"MARLIN_MAX_M: N=256 marlin_fp8: marlin_w8a16 (beats|loses to) dequant_dense", text)
    assert "W4A16_MAX_M = 64 (unchanged): no row measured" in text  # Triton is not timed on the CPU
    assert "MARLIN_MAX_M" in capsys.readouterr().out


def test_a_failing_or_wrong_backend_is_a_row_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    def boom(inp):
        raise RuntimeError("scaled_mm: only per-tensor scales on this build")

    def wrong(inp):
        return torch.zeros(inp.x.shape[0], inp.layer.N, dtype=inp.layer.params_dtype)

    # Served whatever this torch's CPU _scaled_mm can do: the error comes from the run.
    _replace_backend(monkeypatch, bench, "scaled_mm_fp8", boom,
                     reasons=lambda inp: bench.L._format_reason(inp, bench.W.Fp8Weight))
    _replace_backend(monkeypatch, bench, "marlin_w8a16", wrong)
    rc = bench.main(["--device", "cpu", "--N", "128", "--M", "2", "8", "--formats", "fp8_per_channel", "marlin_fp8",
                     "--out", str(tmp_path)])
    assert rc == 1
    rows = _rows(tmp_path / "kv_b_proj_cpu.csv")
    by = {(r["format"], r["backend"], r["M"]): r for r in rows}
    for m in ("2", "8"):
        err = by[("fp8_per_channel", "scaled_mm_fp8", m)]
        assert err["status"] == "error" and "RuntimeError: scaled_mm: only per-tensor" in err["error"]
        bad = by[("marlin_fp8", "marlin_w8a16", m)]
        assert bad["status"] == "mismatch" and "mean|out - ref|" in bad["error"] and bad["time_us"] == ""
        # The other backends of both formats were still measured.
        assert by[("fp8_per_channel", "dequant_dense", m)]["status"] == "ok"
        assert by[("marlin_fp8", "dispatch:dequant_dense", m)]["status"] == "ok"
        # The fake scaled_mm_fp8 states no reason, so the automatic choice takes it too.
        assert by[("fp8_per_channel", "dispatch:scaled_mm_fp8", m)]["status"] == "error"
    text = (tmp_path / "kv_b_proj_crossovers_cpu.txt").read_text()
    assert "6 failed" in text and "MARLIN_MAX_M = 128 (unchanged)" in text


def test_interrupted_run_keeps_its_rows_and_reports_them(bench, tmp_path, monkeypatch):
    calls = []
    real = bench.Timer.__call__

    def timer(self, fn, *a, **k):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(self, fn, *a, **k)

    monkeypatch.setattr(bench.Timer, "__call__", timer)
    rc = bench.main(["--device", "cpu", "--N", "128", "--M", "2", "8", "--formats", "dense", "marlin_fp8",
                     "--out", str(tmp_path)])
    assert rc == 130
    rows = _rows(tmp_path / "kv_b_proj_cpu.csv")
    assert 0 < len(rows) < 10 and all(r["status"] == "ok" for r in rows)
    assert "INTERRUPTED" in (tmp_path / "kv_b_proj_crossovers_cpu.txt").read_text()


def _row(n, fmt, backend, m, us, ratio=1.0, status="ok"):
    return dict(N=n, format=fmt, backend=backend, M=m, time_us=us, ratio_vs_cublas_bf16=ratio, status=status)


def test_crossovers_from_rows(bench):
    rows = []
    for m, marlin, dense in ((1, 5, 10), (16, 8, 10), (64, 12, 10), (256, 9, 10)):
        rows += [_row(4096, "marlin_fp8", "marlin_w8a16", m, marlin), _row(4096, "marlin_fp8", "dequant_dense", m, dense)]
    for m, fp8, dense in ((1, 20, 10), (64, 9, 10), (512, 11, 10), (8192, 5, 10), (16384, 5, 10)):
        rows += [_row(4096, "fp8_block", "triton_fp8_block", m, fp8, ratio=10 / fp8),
                 _row(4096, "fp8_block", "dequant_dense", m, dense),
                 _row(4096, "fp8_block", "dispatch:triton_fp8_block", m, fp8 * 1.1, ratio=10 / fp8 / 1.1)]
    rows.append(_row(4096, "nvfp4", "triton_w4a16", 1, 1, status="error"))  # failed rows are ignored
    text = "\n".join(bench.report(rows, is_gpu=True))
    assert "MARLIN_MAX_M = 16 measured" in text  # wins at 1 and 16, loses at 64: a win at 256 does not count
    assert "FP8_NATIVE_MIN_M = 8192 measured" in text  # loses at 512, wins from 8192 on
    assert "W4A16_MAX_M = 64 (unchanged)" in text
    assert "MISS dispatch N=4096 fp8_block M=8192" in text
    assert "M>=8K N=4096 M=16384 fp8_block: dispatch:triton_fp8_block x1.818" in text and "[ok: goal >= 1.5x]" in text
    assert bench.crossover({1: 1.0, 2: 3.0}, {1: 2.0, 2: 2.0}, "min") == (None, [1], [2])
    assert bench.crossover({1: 3.0}, {1: 2.0}, "max") == (0, [], [1])
