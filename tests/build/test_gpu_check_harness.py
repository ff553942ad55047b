"""benchmarks/gpu_check.sh fits a lent GPU machine (SPEC §11): one command of at
most 600 s, at most 8 files back from OUTDIR, none deeper than OUTDIR/a/b.

The script's plan mode (`--plan`) walks the same steps as a real run without
running them, on a simulated clock where every step takes its whole limit plus
the kill grace and the re-packing (the worst case), and prints the files OUTDIR
holds after each step. These tests hold that plan to the machine's limits, so a
step or an output file added later cannot break them unnoticed; and they run the
real script for its cheap steps (no GPU here: the CPU-side dry run).
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
COMMAND_LIMIT_S = 600      # one command on the lent machine
DEADLINE_LIMIT_S = 560     # the script's default deadline must leave room for start-up and transfer
MAX_FILES = 8              # files that come back from OUTDIR
MAX_DEPTH = 2              # OUTDIR/a/b at most


def plan(mode: str = "gpu", **env) -> list[dict]:
    """The plan's lines as dicts (PLAN k=v k=v ...)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full_env.update(env)
    res = subprocess.run(["bash", str(SCRIPT), "--plan", mode], capture_output=True, text=True, env=full_env,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    lines = []
    for ln in res.stdout.splitlines():
        assert ln.startswith("PLAN "), f"plan mode printed a non-plan line: {ln!r}"
        lines.append(dict(kv.split("=", 1) for kv in ln.split()[1:]))
    return lines


def _head(lines):
    head = lines[0]
    return {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in head.items()}


def cuda_test_files() -> list[str]:
    return sorted(p.stem for p in (ROOT / "tests").rglob("test_*.py") if re.search(r"mark\.cuda", p.read_text()))


def check_limits(lines: list[dict]) -> None:
    head = _head(lines)
    deadline, grace, pack = head["deadline"], head["kill_grace"], head["pack"]
    assert head["margin"] >= grace + pack, "the margin must cover the kill grace and the re-packing"
    for ln in lines[1:]:
        if "out_after" in ln:
            files = ln["files"].split(",")
            assert len(files) == len(set(files)), f"two published files share a name: {files}"
            assert len(files) + head["transient"] <= MAX_FILES, f"after {ln['out_after']}: {files}"
            for f in files:
                parts = Path(f).parts
                assert 1 <= len(parts) <= MAX_DEPTH and ".." not in parts and not f.startswith("/"), f
        elif "group" in ln and "step" not in ln:  # a parallel group as a whole
            if int(ln["limit"]) > 0:
                assert int(ln["start"]) + int(ln["limit"]) + grace + pack <= deadline, ln
        elif "step" in ln and ln["skipped"] == "0":
            start, limit, cap = int(ln["start"]), int(ln["limit"]), int(ln["cap"])
            assert 0 < limit <= cap and limit >= int(ln["min"]), ln
            assert start + limit + grace + pack <= deadline, f"{ln['step']} can run past the deadline"
        elif "end" in ln:
            assert int(ln["end"]) <= deadline


def test_default_deadline_fits_one_command():
    head = _head(plan())
    assert head["deadline"] <= DEADLINE_LIMIT_S < COMMAND_LIMIT_S
    assert head["max_out_files"] == MAX_FILES


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
@pytest.mark.parametrize("deadline", [None, "60", "200", "300", "540"])
def test_worst_case_plan_keeps_every_limit(mode, deadline):
    """Every step taking its whole limit, at any deadline: nothing runs past it,
    OUTDIR never holds more than 8 files, nothing deeper than two levels."""
    env = {"GPU_CHECK_PLAN_ASSUME": "cap"}
    if deadline:
        env["GPU_CHECK_DEADLINE"] = deadline
    check_limits(plan(mode, **env))


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_plan_runs_every_step_and_publishes_the_results(mode):
    lines = plan(mode, GPU_CHECK_PLAN_ASSUME="zero")
    check_limits(lines)
    steps = [ln["step"] for ln in lines if "step" in ln]
    assert all(ln["skipped"] == "0" for ln in lines if "step" in ln)
    want = ["facts", "build", "info"]
    if mode == "gpu":
        cuda = [s for s in steps if s.startswith("cuda.")]
        assert sorted(cuda) == ["cuda." + f for f in cuda_test_files()]  # every CUDA test file, once
        assert cuda[0] == "cuda.test_cache_ops"
        memcheck = [s for s in steps if s.startswith("memcheck.")]
        assert memcheck == ["memcheck.test_cache_ops", "memcheck.test_cache_fp8", "memcheck.test_attention_merge",
                            "memcheck.test_kv_b_proj_marlin"]
        want += cuda + memcheck + ["racecheck"]
    want += ["demo", "bench_kv_b_proj", "bench_prefill", "bench_absorbed", "bench_cache", "bench_attention",
             "bench_sparse", "bench_vllm_sparse"]
    assert steps == want
    final = [ln for ln in lines if "out_after" in ln][-1]["files"].split(",")
    assert set(final) == {"gpu_check.tar.gz", "summary.md", "kv_b_proj_crossovers.txt", "kv_b_proj.csv",
                          "prefill.csv", "gather.csv", "attention.csv"}


def test_value_order_when_time_runs_short():
    """Worst case at the default deadline: the facts and the build come first and
    are never the steps that are skipped."""
    lines = plan("gpu", GPU_CHECK_PLAN_ASSUME="cap")
    first = [ln for ln in lines if "step" in ln][:3]
    assert [ln["step"] for ln in first] == ["facts", "build", "info"]
    assert all(ln["skipped"] == "0" for ln in first)


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_caps_fit_the_default_deadline_so_every_step_runs_in_the_worst_case(mode):
    """The sum of the planned caps (each with its kill grace and packing) fits the
    default deadline: even if every step runs to its cap, none is skipped."""
    lines = plan(mode, GPU_CHECK_PLAN_ASSUME="cap")
    check_limits(lines)
    head = _head(lines)
    groups = [ln for ln in lines if ("step" in ln and "." not in ln["step"])
              or ("group" in ln and "step" not in ln)]
    spent = sum(int(ln["cap"]) + head["kill_grace"] + head["pack"] for ln in groups)
    assert spent <= head["deadline"] - head["margin"], f"caps need {spent}s of {head['deadline']}s"
    skipped = [ln["step"] for ln in lines if "step" in ln and ln["skipped"] != "0"]
    assert skipped == [], f"worst case at the default deadline skips {skipped}"


def test_every_command_of_the_run_goes_through_step_or_pool():
    """A command added to the run section without `step` would escape the
    deadline, the logs and the packing."""
    text = SCRIPT.read_text()
    run = text[text.index("# -- the run ---"):]
    for ln in run.splitlines():
        s = ln.strip()
        if ('"$py"' in s or "bench_" in s or "pytest" in s) and not s.startswith("#"):
            assert s.startswith(("step ", "pool ")), f"not under step/pool: {s}"


# -- real runs of the script (no GPU here: the CPU-side dry run) ---------------------

def run_script(tmp_path: Path, extra_path: str | None = None, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full_env.update(PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"), TMPDIR=str(tmp_path), **env)
    if extra_path:
        full_env["PATH"] = extra_path + os.pathsep + full_env["PATH"]
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=full_env,
                         timeout=240)
    return res, out


def check_outdir(out: Path) -> list[str]:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= MAX_FILES
    assert all(len(p.relative_to(out).parts) <= MAX_DEPTH for p in out.rglob("*"))
    assert not any(p.name.endswith(".part") for p in files)
    return sorted(p.name for p in files)


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


@pytest.mark.skipif(_cuda_visible(), reason="the dry run is the no-GPU path")
def test_dry_run_of_the_cheap_steps(tmp_path):
    res, out = run_script(tmp_path, GPU_CHECK_ONLY="facts,info")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert check_outdir(out) == ["gpu_check.tar.gz", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert "mode: cpu" in summary
    assert re.search(r"\| facts \| ok \|", summary) and re.search(r"\| info \| ok \|", summary)
    assert "| build | SKIPPED | 0 | 0 | not in GPU_CHECK_ONLY |" in summary
    assert "| cuda | SKIPPED | 0 | 0 | no GPU |" in summary
    assert "which ninja:" in summary and "torch " in summary  # the machine facts
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu_check/logs/facts.log", "gpu_check/logs/info.log", "gpu_check/summary.md"} <= names
    assert "| step | status |" in res.stdout  # the digest on stdout ends with the summary


@pytest.mark.skipif(_cuda_visible(), reason="the dry run is the no-GPU path")
def test_steps_that_do_not_fit_the_deadline_are_skipped_with_a_note(tmp_path):
    res, out = run_script(tmp_path, GPU_CHECK_DEADLINE="12", GPU_CHECK_ONLY="facts,info,demo")
    assert res.returncode == 0, res.stdout[-3000:]
    summary = (out / "summary.md").read_text()
    for name in ("facts", "info", "demo"):
        assert re.search(rf"\| {name} \| SKIPPED \| 0 \| -?\d+ \| only -?\d+s left of the deadline/group cap; "
                         rf"needs \d+s \|", summary), summary
    assert check_outdir(out) == ["gpu_check.tar.gz", "summary.md"]


@pytest.mark.skipif(_cuda_visible(), reason="needs a machine where torch cannot use CUDA")
def test_a_gpu_that_torch_cannot_use_stops_the_run(tmp_path):
    """nvidia-smi lists a GPU, torch cannot initialise CUDA: stop with torch's error,
    never fall back to the CPU dry run on a GPU machine."""
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)
    res, out = run_script(tmp_path, extra_path=str(fake))
    assert res.returncode == 2
    assert "torch cannot initialise CUDA" in res.stdout
    assert "CPU-side dry run" not in res.stdout and "== build" not in res.stdout
    summary = (out / "summary.md").read_text()
    assert "| cuda_init | FAIL |" in summary
    assert check_outdir(out) == ["gpu_check.tar.gz", "summary.md"]


def test_rows_reach_the_csv_as_they_are_measured(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_common import RowLog, finish
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    log = RowLog(str(tmp_path / "x.csv"), ["a", "t"], {"device": "cpu"})
    log.add({"a": 1, "t": 0.123456})
    try:
        raise ValueError("bad\nvalue")
    except ValueError as exc:
        log.fail({"a": 2}, exc)
    rows = list(csv.DictReader(open(tmp_path / "x.csv")))  # before close: already on disk
    assert [(r["a"], r["t"], r["device"], r["status"]) for r in rows] == [("1", "0.1235", "cpu", "ok"),
                                                                          ("2", "", "cpu", "error")]
    assert rows[1]["error"].startswith("ValueError: bad value [test_gpu_check_harness.py:")
    assert finish(log, interrupted=False) == 1
    assert finish(RowLog(str(tmp_path / "y.csv"), ["a"]), interrupted=True) == 130
