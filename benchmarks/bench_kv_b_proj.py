"""kv_b_proj throughput per weight format and backend on DeepSeek-V3 shapes.

K = 512 (kv_lora_rank); N = 4,096 (16 heads x 256, TP8) and 32,768 (128 heads).
For every (N, M, format) it times each backend that can serve the input
(forced, so the M thresholds do not hide a backend) and the automatic choice
("dispatch:<backend>"), next to a cuBLAS bf16 GEMM of the same x and a
dense bf16 weight, timed in the same run. The input is the row-strided
workspace view x = workspace[:, :512] (row stride 576), as in the prefill path.
Every output is checked first against x @ dequantized weight in fp32
(mean|out - ref| / mean|ref| < 0.06: the weight-only tolerance of SPEC §9
plus room for the W8A8 paths' own activation quantization).

Sizes:
  --sweep   M doubling from 1 to 16,384 at N = 4,096 and 32,768, every format
            (GPU); N = 256, M in 1..64 on the CPU (checks the script only).
            This places the dispatch thresholds.
  default   M from 16 to 65,536 (GPU); --quick: N = 4,096, M in {16, 64, 256}.

Output (DIR = --out, default benchmarks/results/):
  DIR/kv_b_proj_<device>.csv         one row per measurement, written as it is
                                     measured; a failed or mismatching one is a
                                     row with status and error (the run goes on)
  DIR/kv_b_proj_<device>.png         speed vs cuBLAS bf16 per format/backend
  DIR/kv_b_proj_crossovers_<device>.txt and stdout: from whatever rows exist,
      the measured crossover M for MARLIN_MAX_M, W4A16_MAX_M and
      FP8_NATIVE_MIN_M (mla_ext/kv_b_proj/linear.py), where the automatic
      choice misses the best backend, and the M >= 8K ratio vs cuBLAS bf16.
Interrupted (SIGINT, e.g. `timeout -s INT`): reports the rows measured so far.

GPU timing: CUDA events around each call, with L2 scrubbed (a 256 MiB write)
before every call so that weight-only kernels are not flattered by a weight
that stays in the 50 MB L2. Use --no-flush to see warm-L2 numbers.
CPU: only the backends that run natively there (the Triton kernels would need
the interpreter and say nothing about speed); useful only to check the script.

    python benchmarks/bench_kv_b_proj.py --sweep         # GPU: thresholds
    python benchmarks/bench_kv_b_proj.py --quick         # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402

from mla_ext.kv_b_proj import DISPATCH, KvBProj  # noqa: E402
from mla_ext.kv_b_proj import linear as L  # noqa: E402
from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.kv_b_proj.linear import KvBProjInputs, _capability  # noqa: E402

K = 512
E = 576
FULL_N = [4096, 32768]
FULL_M = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_N = [4096]
QUICK_M = [16, 64, 256]
SWEEP_N = [4096, 32768]
SWEEP_M = [1 << i for i in range(15)]  # 1 .. 16,384
CPU_SWEEP_N = [256]
CPU_SWEEP_M = [1, 4, 16, 64]
CPU_NATIVE = ("dequant_dense", "scaled_mm_fp8", "marlin_w8a16")
DENSE = "dequant_dense"
MAX_MEAN_REL = 0.06
BIG_M = 8192  # the prefill regime: the ">= 1.5x bf16 at M >= 8K" goal for native fp8
# threshold in linear.py -> (backends it gates, "max": wins up to M / "min": wins from M)
THRESHOLDS = {
    "MARLIN_MAX_M": (("marlin_w8a16",), "max"),
    "W4A16_MAX_M": (("triton_w4a16",), "max"),
    "FP8_NATIVE_MIN_M": (("triton_fp8_block", "scaled_mm_fp8"), "min"),
}
FIELDS = ["device", "dtype", "N", "K", "M", "format", "backend", "time_us", "tflops", "cublas_bf16_us",
          "ratio_vs_cublas_bf16", "mean_rel_err"]


class Timer:
    def __init__(self, device: torch.device, flush: bool):
        self.device = device
        self.scrub = torch.empty(256 << 20, dtype=torch.uint8, device=device) if (flush and device.type == "cuda") else None

    def __call__(self, fn, min_iters: int = 5, budget_s: float = 0.2) -> float:
        """Median seconds per call."""
        fn()  # warm-up: compiles Triton kernels, builds the dequantized cache
        if self.device.type != "cuda":
            times = []
            t_end = time.perf_counter() + budget_s
            while len(times) < 2 or (len(times) < min_iters and time.perf_counter() < t_end):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]
        torch.cuda.synchronize()
        times = []
        for _ in range(max(min_iters, 10)):
            if self.scrub is not None:
                self.scrub.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return sorted(times)[len(times) // 2]


def _sig(v: float) -> float:
    return float(f"{v:.4g}")


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def usable_backends(layer: KvBProj, x: torch.Tensor) -> list[str]:
    names = []
    for b in DISPATCH.backends:
        if x.device.type == "cpu" and b.name not in CPU_NATIVE:
            continue
        with DISPATCH.force(b.name):
            inp = KvBProjInputs(layer, x.shape[0], x.device, _capability(x.device), x.dtype, x)
            if not b.not_supported_reasons(inp):
                names.append(b.name)
    return names


def mean_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not bool(torch.isfinite(y).all()):
        return float("nan")
    return float((y - ref).abs().mean() / ref.abs().mean().clamp(min=1e-30))


def _layers(args, n: int, dt: torch.dtype, device, log: RowLog, base: dict):
    """{format: (layer on device, fp32 dequantized weight on device)}; a format
    that fails to quantize or move is an error row."""
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, K, generator=gen) * 0.05).to(dt)
    out = {}
    for recipe in args.formats:
        try:
            fmt = W.quantize(recipe, w, dt)
            out[recipe] = (KvBProj(fmt.to(device)), fmt.dequantize(torch.float32).to(device))
        except Exception as exc:  # noqa: BLE001 - a format that cannot be built is a row, not the end
            log.fail(dict(base, N=n, format=recipe, backend="quantize"), exc)
    return w.to(device), out


def run(args, log: RowLog) -> None:
    device = torch.device(args.device)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    timer = Timer(device, not args.no_flush)
    base = dict(device=device_tag(device), dtype=args.dtype, K=K)
    gen = torch.Generator().manual_seed(0)
    for n in args.N:
        w_dev, layers = _layers(args, n, dt, device, log, base)
        for m in args.M:
            ws = torch.randn(m, E, generator=gen).to(dt).to(device)
            x = ws[:, :K]
            flop = 2.0 * m * n * K
            try:
                t_ref = timer(lambda: x @ w_dev.t())
            except Exception as exc:  # noqa: BLE001
                log.fail(dict(base, N=n, M=m, format="dense", backend="cublas_bf16"), exc)
                t_ref = float("nan")
            for recipe, (layer, w32) in layers.items():
                row0 = dict(base, N=n, M=m, format=recipe, cublas_bf16_us=_sig(t_ref * 1e6))
                try:
                    ref = x.float() @ w32.t()
                    cands = usable_backends(layer, x) + [None]
                    chosen = layer.backend_for(m)
                except Exception as exc:  # noqa: BLE001
                    log.fail(dict(row0, backend="setup"), exc)
                    continue
                for forced in cands:
                    label = forced or f"dispatch:{chosen}"
                    row = dict(row0, backend=label)
                    try:
                        with DISPATCH.force(forced):
                            err = mean_rel_err(layer(x), ref)
                            if not err <= MAX_MEAN_REL:
                                log.fail(dict(row, mean_rel_err=_sig(err)),
                                         f"mean|out - ref| / mean|ref| = {err:.3g} > {MAX_MEAN_REL}", "mismatch")
                                continue
                            t = timer(lambda: layer(x))
                    except Exception as exc:  # noqa: BLE001 - e.g. a torch build whose _scaled_mm refuses the scales
                        log.fail(row, exc)
                        continue
                    r = log.add(dict(row, time_us=_sig(t * 1e6), tflops=_sig(flop / t / 1e12),
                                     ratio_vs_cublas_bf16=_sig(t_ref / t), mean_rel_err=_sig(err)))
                    print(f"N={n:6d} M={m:6d} {recipe:16s} {label:28s} {r['time_us']:10.1f} us "
                          f"{r['tflops']:8.2f} TFLOP/s  x{r['ratio_vs_cublas_bf16']:.2f} vs bf16", flush=True)
                del ref


# -- reading the rows -----------------------------------------------------------

def _times(rows: list[dict], n: int, fmt: str, backend: str) -> dict[int, float]:
    return {r["M"]: r["time_us"] for r in rows
            if r["N"] == n and r["format"] == fmt and r["backend"] == backend and r["status"] == "ok"}


def crossover(t: dict[int, float], dense: dict[int, float], kind: str):
    """(threshold, wins, loses) for one backend against dequant_dense at the Ms
    both have. kind "max": the largest M up to which it wins at every measured M
    (0: it loses at the smallest one); "min": the smallest M from which it wins
    at every larger measured M (None: it loses at the largest one)."""
    ms = sorted(m for m in t if m in dense)
    wins = [m for m in ms if t[m] < dense[m]]
    loses = [m for m in ms if m not in wins]
    if not ms:
        return None, wins, loses
    if kind == "max":
        return max([m for m in wins if not any(lm < m for lm in loses)], default=0), wins, loses
    return min([m for m in wins if not any(lm > m for lm in loses)], default=None), wins, loses


def crossovers(rows: list[dict]) -> list[str]:
    """One line per (threshold, N, format) measured and the value each threshold should take."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for name, (backends, kind) in THRESHOLDS.items():
        current = getattr(L, name)
        found = []
        for n, fmt in sorted({(r["N"], r["format"]) for r in ok}):
            dense = _times(ok, n, fmt, DENSE)
            for b in backends:
                t = _times(ok, n, fmt, b)
                if not t:
                    continue
                if not dense:
                    out.append(f"{name}: N={n} {fmt}: {b} measured, {DENSE} has no row to compare with")
                    continue
                thr, wins, loses = crossover(t, dense, kind)
                found.append(thr)
                if thr in (0, None):
                    verb = "loses to dequant_dense at the " + ("smallest M" if kind == "max" else "largest M")
                else:
                    verb = f"beats dequant_dense {'up to' if kind == 'max' else 'from'} M={thr}"
                out.append(f"{name}: N={n} {fmt}: {b} {verb} (wins at {wins}, loses at {loses})")
        if not found:
            out.append(f"{name} = {current} (unchanged): no row measured for {'/'.join(backends)}")
        elif kind == "max":
            out.append(f"{name} = {min(found)} measured (now {current}): the smallest crossover over N and formats")
        else:
            worst = None if None in found else max(found)
            out.append(f"{name} = {worst if worst is not None else 'never (native fp8 loses at the largest M)'} "
                       f"measured (now {current}): the largest crossover over N and formats")
    return out


def dispatch_misses(rows: list[dict]) -> list[str]:
    """Where the automatic choice is more than 5% slower than the best backend measured."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for n, fmt, m in sorted({(r["N"], r["format"], r["M"]) for r in ok}):
        sel = [r for r in ok if (r["N"], r["format"], r["M"]) == (n, fmt, m)]
        disp = [r for r in sel if r["backend"].startswith("dispatch:")]
        forced = [r for r in sel if not r["backend"].startswith("dispatch:")]
        if disp and forced:
            best = min(forced, key=lambda r: r["time_us"])
            if disp[0]["time_us"] > 1.05 * best["time_us"]:
                out.append(f"MISS dispatch N={n} {fmt} M={m}: {disp[0]['backend']} {disp[0]['time_us']} us > "
                           f"1.05 x {best['backend']} {best['time_us']} us")
    return out


def big_m(rows: list[dict]) -> list[str]:
    """At M >= 8K (prefill): the automatic choice and the best backend vs cuBLAS bf16;
    native fp8 (fp8_block, fp8_per_*) is to reach 1.5x there; weight-only formats at M <= 16
    (Marlin) 1.6x."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for n, fmt, m in sorted({(r["N"], r["format"], r["M"]) for r in ok}):
        sel = [r for r in ok if (r["N"], r["format"], r["M"]) == (n, fmt, m)]
        disp = [r for r in sel if r["backend"].startswith("dispatch:")]
        if m >= BIG_M and disp:
            best = max(sel, key=lambda r: r["ratio_vs_cublas_bf16"])
            d = disp[0]
            goal = ""
            if fmt.startswith("fp8"):
                goal = f" [{'ok' if d['ratio_vs_cublas_bf16'] >= 1.5 else 'MISS'}: goal >= 1.5x]"
            out.append(f"M>=8K N={n} M={m} {fmt}: {d['backend']} x{d['ratio_vs_cublas_bf16']} vs cuBLAS bf16, "
                       f"best {best['backend']} x{best['ratio_vs_cublas_bf16']}{goal}")
        marlin = [r for r in sel if r["backend"] == "marlin_w8a16"]
        if m <= 16 and marlin:
            r = marlin[0]["ratio_vs_cublas_bf16"]
            out.append(f"{'ok  ' if r >= 1.6 else 'MISS'} marlin N={n} {fmt} M={m}: x{r} vs bf16 (goal >= 1.6)")
    return out


def report(rows: list[dict], is_gpu: bool, max_misses: int = 20) -> list[str]:
    lines = ["crossover M (fill mla_ext/kv_b_proj/linear.py thresholds from these):"]
    lines += ["  " + s for s in crossovers(rows)]
    lines.append("automatic choice vs the best backend (> 5% slower):")
    misses = dispatch_misses(rows)
    if not is_gpu:
        lines.append(f"  not evaluated on the CPU ({len(misses)} noisy misses)")
    else:
        lines += ["  " + s for s in (misses[:max_misses] or ["none"])]
        if len(misses) > max_misses:
            lines.append(f"  ... and {len(misses) - max_misses} more (compare dispatch:* rows in the CSV)")
    lines.append("M >= 8K vs cuBLAS bf16, and the small-M Marlin goal:")
    if is_gpu:
        lines += ["  " + s for s in (big_m(rows) or ["no row at M >= 8192 or M <= 16"])]
    else:
        lines.append("  not evaluated: CPU timings on shared cores say nothing about the GPU goals")
    bad = [r for r in rows if r["status"] != "ok"]
    lines.append(f"rows: {len(rows)} measured, {len(bad)} failed (status/error columns of the CSV)")
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(1, len(ns), figsize=(8 * len(ns), 6), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for key in sorted({(r["format"], r["backend"]) for r in rows if r["N"] == n}):
            pts = sorted((r["M"], r["ratio_vs_cublas_bf16"]) for r in rows if r["N"] == n
                         and (r["format"], r["backend"]) == key)
            style = "-" if key[1].startswith("dispatch") else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=f"{key[0]} / {key[1]}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("speed vs cuBLAS bf16 (same run)")
        ax.set_title(f"kv_b_proj K={K}, N={n} ({rows[0]['device']})")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sweep (CPU smoke run)")
    size.add_argument("--sweep", action="store_true", help="M = 1..16384 at N = 4096, 32768: the thresholds")
    p.add_argument("--out", default=os.path.join(_HERE, "results"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--N", type=int, nargs="+")
    p.add_argument("--M", type=int, nargs="+")
    p.add_argument("--formats", nargs="+", default=sorted(W.RECIPES), choices=sorted(W.RECIPES))
    p.add_argument("--no-flush", action="store_true", help="do not scrub L2 between calls")
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    if args.sweep:
        default_n, default_m = (SWEEP_N, SWEEP_M) if gpu else (CPU_SWEEP_N, CPU_SWEEP_M)
    else:
        default_n, default_m = (QUICK_N, QUICK_M) if args.quick else (FULL_N, FULL_M)
    args.N, args.M = args.N or default_n, args.M or default_m

    tag = device_tag(torch.device(args.device))
    stem = os.path.join(args.out, f"kv_b_proj_{tag}")
    log = RowLog(stem + ".csv", FIELDS)
    interrupted = False
    try:
        run(args, log)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the rows measured so far", flush=True)
    except Exception as exc:  # noqa: BLE001 - report what was measured before the failure
        log.fail(dict(device=tag, backend="run"), exc)
    lines = report(log.rows, gpu)
    with open(os.path.join(args.out, f"kv_b_proj_crossovers_{tag}.txt"), "w") as f:
        f.write(f"kv_b_proj crossovers on {tag} (N={args.N}, M={args.M}"
                f"{', INTERRUPTED' if interrupted else ''})\n" + "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return finish(log, interrupted, lambda ok: plot(ok, stem + ".png"))


if __name__ == "__main__":
    sys.exit(main())
