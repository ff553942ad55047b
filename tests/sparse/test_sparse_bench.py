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
