"""Host overhead of one MLA prefill layer call: Python calls and host microseconds per call.

  .venv/bin/python benchmarks/bench_host_overhead.py [--quick] [--no-vllm] [--out FILE]

Tiny shapes on the CPU (DeepSeek's latent dims L=512, R=64; 2 heads of P=V=32; bf16; native
cache, block 16; one request with C context tokens and T new tokens; one context chunk; the
context up-projected (context_attention="up_project"), the same math as vLLM's chunk loop), so the
numbers are mostly the Python host path:

  calls  Python function calls per layer call (sys.setprofile: every Python and C call),
         counted on one call after warm-up;
  us     host microseconds per layer call, the median of --repeat calls after warm-up (on the
         CPU this includes the tiny kernels themselves).

Three columns:
  mla_ext per call   MLAPrefill.forward with every op call dispatching on its own
                     (mla_ext.prefill.backends.RESOLVE_ONCE = False: before backends were
                     resolved once per batch);
  mla_ext planned    MLAPrefill.forward as shipped: each op's backend resolved at the batch's
                     first call, reused by the later ones (the measured call is a later one);
  vLLM forward_mha   vLLM 0.33's own MLACommonImpl.forward_mha on the same shapes (its chunk
                     loop over the context, with mla_ext plugged in as its prefill backend and
                     its ops, as tests/clients/vllm_forward_mha.py runs it), in a subprocess
                     with vLLM's pure-Python tree (tests/clients/client_tree.py).
Correctness: mla_ext's planned and per-call outputs must be bitwise equal; vLLM's output is
compared with MLAPrefill's (relative Frobenius, SPEC §9 bf16 tolerance 2e-2).
The markdown table goes to --out (default benchmarks/results/host_overhead_cpu.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path[:0] = [_REPO]

from mla_ext.config.models import MLAModelConfig  # noqa: E402
from mla_ext.config.policy import CacheConfig  # noqa: E402
from mla_ext.kv_b_proj.weights import DenseWeight  # noqa: E402
from mla_ext.prefill import backends as planned  # noqa: E402
from mla_ext.prefill.layer import MLAPrefill  # noqa: E402
from mla_ext.prefill.synthetic import SyntheticBatch  # noqa: E402

BLOCK = 16
WORKSPACE_ROWS = 1024  # one context chunk for every case
# The dims of tests/clients/vllm_forward_mha.py's MODEL, so both sides run the same shapes.
MODEL = MLAModelConfig(name="tiny-deepseek", L=512, R=64, P=32, V=32, num_heads=2, num_layers=2,
                       model_dtype=torch.bfloat16, max_model_len=1024)
CASES = ((1, 32), (1, 512), (16, 32), (16, 512))  # (new tokens T, context tokens C)
QUICK_CASES = ((1, 32),)
BF16_TOL = 2e-2
NOTES = """Reading the table:
* "mla_ext per call" is the dispatch path before backends were resolved once (every op call runs
  its dispatcher: each backend's not_supported_reasons, heuristics, table lookup). Measured at
  commit 91bac4f (before this change, also before the overlap check's disjoint-storage shortcut
  in mla_ext/cache/checks.py) the same layer call made 2,437 calls (T=1) and 2,712 (T=16).
* vLLM's forward_mha runs mla_ext's ops (routed by the plugin: gather, merge, varlen attention of
  the MLA_EXT prefill backend), each dispatching per call; its split shows the calls made in vLLM's
  own code, in mla_ext's and elsewhere (torch, builtins).
* On the CPU the microseconds include the (tiny) kernels; on a GPU host the calls are what the
  CPU spends per layer call.
* Read the vLLM column with care: on a GPU, vLLM's own ops are single compiled calls, so vLLM's
  forward_mha there costs about its own calls plus torch's ("vllm" + "other", ~280) plus one call
  per op. mla_ext's planned layer call (~960) is below vLLM-with-mla_ext's-ops but still about
  3x that native count; what remains is mostly per-call input checks (shapes, dtypes, devices,
  overlap), each kept because it guards a kernel's memory.
"""


def _package(filename: str) -> str:
    for name in ("mla_ext", "vllm"):
        if f"{os.sep}{name}{os.sep}" in filename:
            return name
    return "other"


def count_calls(fn) -> tuple[int, dict]:
    """Python and C function calls made by one fn() (sys.setprofile sees both), and how many of
    them run in (Python calls) or are made from (C calls) mla_ext's, vLLM's and other code."""
    by: dict[str, int] = {}

    def prof(frame, event, arg):
        if event == "call" or event == "c_call":
            where = _package(frame.f_code.co_filename)
            by[where] = by.get(where, 0) + 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    by["other"] = by.get("other", 0) - 1  # setprofile(None) itself
    return sum(by.values()), by


def host_us(fn, repeat: int, warmup: int = 3) -> float:
    """Median wall microseconds of one fn() call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure(fn, repeat: int) -> dict:
    us = host_us(fn, repeat)
    calls, by = count_calls(fn)
    return {"calls": calls, "by": by, "us": us}


def mla_ext_case(T: int, C: int, repeat: int) -> dict:
    """Both mla_ext columns for one shape, and the bitwise check between them."""
    w = torch.randn(MODEL.num_heads * (MODEL.P + MODEL.V), MODEL.L,
                    generator=torch.Generator().manual_seed(1)) / math.sqrt(MODEL.L)
    layer = MLAPrefill(MODEL, CacheConfig("auto", (), BLOCK), DenseWeight(w.to(MODEL.model_dtype)), layer=0,
                       workspace_rows_override=WORKSPACE_ROWS, max_num_seqs=8, context_attention="up_project")
    batch = SyntheticBatch(MODEL, [C], [T], BLOCK, seed=2)
    cache = batch.fill_cache(layer, *batch.layer_context(0))
    meta = batch.metadata()
    call = lambda: layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)  # noqa: E731
    out = {}
    try:
        planned.RESOLVE_ONCE = False
        out["per_call"] = measure(call, repeat)
        want = call()
    finally:
        planned.RESOLVE_ONCE = True
    out["planned"] = measure(call, repeat)
    out["bitwise_equal"] = bool(torch.equal(call(), want))
    return out


# -- vLLM's forward_mha, in a subprocess with vLLM's tree on the path ---------------------------

def vllm_child(out_path: str, cases, repeat: int) -> None:
    """Runs tests/clients/vllm_forward_mha.run_case per shape with TritonMLAImpl.forward_mha wrapped:
    the wrapper measures the call (vLLM's code, its own chunk loop) and then runs it for the case."""
    sys.path.insert(0, os.path.join(_REPO, "tests"))
    from clients import vllm_forward_mha as V  # patches vLLM's platform to the CPU at import
    from mla_ext.vllm.absorbed_context import CONTEXT_ENV

    os.environ[CONTEXT_ENV] = "vllm"  # vLLM's own up-projecting chunk loop
    impl_cls = V.TritonMLAImpl
    real = impl_cls.forward_mha
    stats: list[dict] = []

    def measured(self, *args, **kwargs):
        stats.append(measure(lambda: real(self, *args, **kwargs), repeat))
        return real(self, *args, **kwargs)

    impl_cls.forward_mha = measured
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = V.setup_vllm(tmp)
        with V.set_current_vllm_config(config):
            backend_cls = V.get_mla_prefill_backend(config)
        for T, C in cases:
            stats.clear()
            rec = V.run_case(config, backend_cls, "auto", MODEL.model_dtype, (f"T{T}_C{C}", [C], [T], WORKSPACE_ROWS),
                             seed=3)
            results.append({"T": T, "C": C, **stats[0], "rel_vs_mla_prefill": rec["rel_vs_mla_prefill"],
                            "all_written": rec["all_written"], "chunks": rec["chunks"]})
    with open(out_path, "w") as f:
        json.dump(results, f)


def run_vllm(cases, repeat: int) -> tuple[list[dict] | None, str]:
    """vLLM's numbers per case, or None and why not."""
    sys.path.insert(0, os.path.join(_REPO, "tests"))
    try:
        from clients.client_tree import ClientUnavailable, ensure

        tree = ensure("vllm")
    except (ImportError, ClientUnavailable) as exc:
        return None, f"vLLM 0.33's tree is unavailable: {exc}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), _REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vllm.json")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--vllm-child", out,
                               "--cases", json.dumps(cases), "--repeat", str(repeat),
                               "--threads", str(torch.get_num_threads())],
                              capture_output=True, text=True, env=env, cwd=_REPO, timeout=900)
        if proc.returncode != 0 or not os.path.exists(out):
            return None, f"the vLLM run failed: {proc.stderr[-600:]}"
        with open(out) as f:
            return json.load(f), ""


# -- report -----------------------------------------------------------------------------------------

def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), Python {platform.python_version()}")


def table(rows: list[dict], vllm: list[dict] | None, why: str) -> str:
    head = ("| T new | C context | mla_ext per call: calls | us | mla_ext planned: calls | us "
            "| vLLM forward_mha: calls | us | planned vs vLLM calls | checks |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    by_shape = {(v["T"], v["C"]): v for v in (vllm or [])}
    for r in rows:
        v = by_shape.get((r["T"], r["C"]))
        pc, pl = r["per_call"], r["planned"]
        checks = "planned == per call (bitwise)" if r["bitwise_equal"] else "**planned != per call**"
        if v is None:
            vcols, ratio = "n/a | n/a", "n/a"
        else:
            split = ", ".join(f"{k} {v['by'].get(k, 0)}" for k in ("vllm", "mla_ext", "other"))
            vcols = f"{v['calls']} ({split}) | {v['us']:.0f}"
            ratio = f"{pl['calls'] / v['calls']:.2f}x"
            ok = v["all_written"] and v["rel_vs_mla_prefill"] <= BF16_TOL
            checks += f"; vLLM vs MLAPrefill rel {v['rel_vs_mla_prefill']:.1e}" + ("" if ok else " **FAIL**")
        lines.append(f"| {r['T']} | {r['C']} | {pc['calls']} | {pc['us']:.0f} | {pl['calls']} | {pl['us']:.0f} "
                     f"| {vcols} | {ratio} | {checks} |")
    if vllm is None:
        lines.append(f"\nvLLM column: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one shape, few repeats")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's forward_mha column")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(_HERE, "results", "host_overhead_cpu.md"))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: two threads on a shared 2-core host spin-wait for "
                         "tens of ms per tiny op, which would hide the host path)")
    ap.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    repeat = args.repeat or (5 if args.quick else 200)
    torch.set_num_threads(args.threads)
    if args.vllm_child:
        vllm_child(args.vllm_child, [tuple(c) for c in json.loads(args.cases)], repeat)
        return 0
    cases = QUICK_CASES if args.quick else CASES
    rows = [{"T": T, "C": C, **mla_ext_case(T, C, repeat)} for T, C in cases]
    vllm, why = (None, "skipped (--no-vllm)") if args.no_vllm else run_vllm([list(c) for c in cases], repeat)
    text = (f"# Host overhead per MLA prefill layer call (CPU)\n\nMachine: {machine()}; a host shared "
            "with other jobs (the microseconds are noisy: compare the call counts).\n"
            f"Shapes: L=512, R=64, {MODEL.num_heads} heads of P=V=32, bf16, native cache (block {BLOCK}), "
            "one request, one context chunk, context up-projected (as vLLM's loop); median of "
            f"{repeat} calls after warm-up; calls counted by sys.setprofile (Python and C calls) on one "
            "call. Produced by benchmarks/bench_host_overhead.py.\n\n" + table(rows, vllm, why) + "\n\n" + NOTES)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    ok = all(r["bitwise_equal"] for r in rows) and all(
        v["all_written"] and v["rel_vs_mla_prefill"] <= BF16_TOL for v in (vllm or []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
