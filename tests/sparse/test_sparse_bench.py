"""benchmarks/bench_sparse.py runs at tiny CPU sizes and writes its rows."""
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_sparse_writes_rows(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_sparse

    rc = bench_sparse.main(["--out", str(tmp_path), "--context", "200", "--new-tokens", "8", "--topk", "32",
                            "--reps", "1"])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "sparse_cpu.csv")))
    assert [r["path"] for r in rows] == ["dense", "sparse", "sparse.indexer", "sparse.attention"]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)


def test_bench_vllm_sparse_writes_checked_rows(tmp_path):
    """benchmarks/bench_vllm_sparse.py (gpu_check's sparse decode + prefill step) at its quick CPU sizes:
    every row measured and within the bf16 bound of its reference, top-k sets equal."""
    from helpers.benchmarks import load_benchmark

    bench = load_benchmark("bench_vllm_sparse", "bench_vllm_sparse_smoke")
    assert bench.main(["--quick", "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "vllm_sparse_cpu.csv")))
    assert [r["op"] for r in rows] == ["attention.decode", "attention.prefill"] * 2 + [
        "indexer.mqa_logits", "indexer.top_k_per_row_prefill", "indexer.paged_mqa_logits",
        "indexer.top_k_per_row_decode"]
    assert all(r["status"] == "ok" for r in rows)
    assert all(float(r["rel_err"]) <= 1e-2 for r in rows if r["rel_err"])
    assert all(r["sets_equal"] == "True" for r in rows if r["op"].startswith("indexer.top_k"))
