"""kv_b_proj throughput per weight format and backend on DeepSeek-V3 shapes.

K = 512 (kv_lora_rank); N = 4,096 (16 heads x 256, TP8) and 32,768 (128 heads);
M (context rows) from 16 to 65,536. For every (N, format, M) it times each
backend that can serve the input (forced) and the automatic choice
("dispatch"), and a cuBLAS bf16 GEMM with the same x in the same run.
The input is the row-strided workspace view x = workspace[:, :512] (row
stride 576), as in the prefill path.

Output: CSV `<out>/kv_b_proj_<device>.csv`, PNG `<out>/kv_b_proj_<device>.png`,
and on stdout the measured crossover M for each weight-only / native-fp8
backend against dequantize + 16-bit GEMM (the numbers behind MARLIN_MAX_M,
W4A16_MAX_M and FP8_NATIVE_MIN_M in mla_ext/kv_b_proj/linear.py) plus the
issue's targets.

GPU timing: CUDA events around each call, with L2 scrubbed (a 256 MiB write)
before every call so that weight-only kernels are not flattered by a weight
that stays in the 50 MB L2. Use --no-flush to see warm-L2 numbers.
CPU (--quick): a handful of shapes through the backends that run natively on
the CPU (the Triton kernels would need the interpreter and say nothing about
speed); useful only to check the script.

    python benchmarks/bench_kv_b_proj.py                 # GPU, full sweep
    python benchmarks/bench_kv_b_proj.py --quick         # CPU smoke run
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mla_ext.kv_b_proj import DISPATCH, KvBProj  # noqa: E402
from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.kv_b_proj.linear import KvBProjInputs, _capability  # noqa: E402

K = 512
E = 576
FULL_N = [4096, 32768]
FULL_M = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_N = [4096]
QUICK_M = [16, 64, 256]
WEIGHT_ONLY = ("marlin_w8a16", "triton_w4a16")
NATIVE_FP8 = ("triton_fp8_block", "scaled_mm_fp8")
CPU_NATIVE = ("dequant_dense", "scaled_mm_fp8", "marlin_w8a16")


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


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    timer = Timer(device, not args.no_flush)
    tag = device_tag(device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in args.N:
        w = (torch.randn(n, K, generator=gen) * 0.05).to(dt)
        w_dev = w.to(device)
        for recipe in args.formats:
            try:
                fmt = W.quantize(recipe, w, dt).to(device)
            except (ValueError, RuntimeError) as exc:
                print(f"skip {recipe} N={n}: {exc}")
                continue
            layer = KvBProj(fmt)
            for m in args.M:
                ws = torch.randn(m, E, generator=gen).to(dt).to(device)
                x = ws[:, :K]
                t_ref = timer(lambda: x @ w_dev.t())
                flop = 2.0 * m * n * K
                cands = [(b, b) for b in usable_backends(layer, x)]
                chosen = layer.backend_for(m)
                cands.append(("dispatch", None))
                for label, forced in cands:
                    with DISPATCH.force(forced):
                        t = timer(lambda: layer(x))
                    rows.append(dict(device=tag, dtype=args.dtype, N=n, K=K, M=m, format=recipe,
                                     backend=label if forced else f"dispatch:{chosen}",
                                     time_us=_sig(t * 1e6), tflops=_sig(flop / t / 1e12),
                                     cublas_bf16_us=_sig(t_ref * 1e6), ratio_vs_cublas_bf16=_sig(t_ref / t)))
                    r = rows[-1]
                    print(f"N={n:6d} M={m:6d} {recipe:16s} {r['backend']:28s} {r['time_us']:10.1f} us "
                          f"{r['tflops']:8.2f} TFLOP/s  x{r['ratio_vs_cublas_bf16']:.2f} vs bf16")
    return rows


def crossovers(rows: list[dict]) -> list[str]:
    """For each weight-only / native-fp8 backend: where it stops (or starts) beating dequant_dense."""
    out = []
    keys = sorted({(r["N"], r["format"]) for r in rows})
    for n, fmt in keys:
        sel = [r for r in rows if r["N"] == n and r["format"] == fmt]
        dense = {r["M"]: r["time_us"] for r in sel if r["backend"] == "dequant_dense"}
        for b in sorted({r["backend"] for r in sel} & set(WEIGHT_ONLY + NATIVE_FP8)):
            t = {r["M"]: r["time_us"] for r in sel if r["backend"] == b}
            wins = [m for m in sorted(t) if m in dense and t[m] < dense[m]]
            loses = [m for m in sorted(t) if m in dense and t[m] >= dense[m]]
            if b in WEIGHT_ONLY:
                last_win = max([m for m in wins if not any(lm < m for lm in loses)], default=None)
                out.append(f"N={n} {fmt}: {b} beats dequant_dense up to M={last_win} "
                           f"(wins at {wins}, loses at {loses}) -> threshold *_MAX_M = {last_win}")
            else:
                first = min(wins, default=None)
                out.append(f"N={n} {fmt}: {b} beats dequant_dense from M={first} "
                           f"(loses at {loses}) -> FP8_NATIVE_MIN_M = {first}")
    return out


def targets(rows: list[dict]) -> list[str]:
    out = []
    for (n, fmt, m) in sorted({(r["N"], r["format"], r["M"]) for r in rows}):
        sel = {r["backend"].split(":")[0]: r for r in rows if (r["N"], r["format"], r["M"]) == (n, fmt, m)}
        best = [sel[b]["time_us"] for b in ("dequant_dense",) + NATIVE_FP8 if b in sel]
        if "dispatch" in sel and best and sel["dispatch"]["time_us"] > 1.05 * min(best):
            out.append(f"MISS dispatch N={n} {fmt} M={m}: {sel['dispatch']['time_us']} us > 1.05 x {min(best)} us")
        if "marlin_w8a16" in sel and m <= 16:
            r = sel["marlin_w8a16"]["ratio_vs_cublas_bf16"]
            out.append(f"{'ok  ' if r >= 1.6 else 'MISS'} marlin N={n} {fmt} M={m}: x{r} vs bf16 (target >= 1.6)")
        if "triton_fp8_block" in sel and m >= 8192:
            r = sel["triton_fp8_block"]["ratio_vs_cublas_bf16"]
            out.append(f"{'ok  ' if r >= 1.5 else 'MISS'} fp8 block N={n} M={m}: x{r} vs bf16 (target >= 1.5)")
    return out or ["no target applies to the shapes measured"]


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sweep (CPU smoke run)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--N", type=int, nargs="+")
    p.add_argument("--M", type=int, nargs="+")
    p.add_argument("--formats", nargs="+", default=sorted(W.RECIPES), choices=sorted(W.RECIPES))
    p.add_argument("--no-flush", action="store_true", help="do not scrub L2 between calls")
    args = p.parse_args(argv)
    args.N = args.N or (QUICK_N if args.quick else FULL_N)
    args.M = args.M or (QUICK_M if args.quick else FULL_M)
    rows = run(args)
    os.makedirs(args.out, exist_ok=True)
    tag = rows[0]["device"] if rows else "none"
    csv_path = os.path.join(args.out, f"kv_b_proj_{tag}.csv")
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    plot(rows, os.path.join(args.out, f"kv_b_proj_{tag}.png"))
    print("\ncrossover M (fill mla_ext/kv_b_proj/linear.py thresholds from these):")
    print("\n".join("  " + s for s in crossovers(rows)))
    print("targets (GPU targets from the issue):")
    if tag == "cpu":
        print("  not evaluated: CPU timings on shared cores say nothing about the GPU targets")
    else:
        print("\n".join("  " + s for s in targets(rows)))
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    main()
