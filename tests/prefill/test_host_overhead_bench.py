"""The host-overhead benchmark runs (--quick, without vLLM): its table has the shape's row, the
planned path's output is bitwise the per-call path's, and it makes fewer Python calls per layer
call than every op dispatching on its own."""
from helpers.benchmarks import load_benchmark


def _bench():
    return load_benchmark("bench_host_overhead")


def test_quick_run_writes_the_table(tmp_path):
    bench = _bench()
    out = tmp_path / "host.md"
    assert bench.main(["--quick", "--no-vllm", "--repeat", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 1 | 32 |" in text and "planned == per call (bitwise)" in text and "skipped (--no-vllm)" in text


def test_planned_path_makes_fewer_calls():
    row = _bench().mla_ext_case(1, 32, repeat=1)
    assert row["bitwise_equal"]
    assert row["planned"]["calls"] < row["per_call"]["calls"]
