"""kv_b_proj throughput per weight format and backend on DeepSeek-V3 shapes.

K = 512 (kv_lora_rank); N = 4,096 (16 heads x 256, TP8) and 32,768 (128 heads).
For every (N, M, format) it times each backend that can serve the input
(forced, so the M thresholds do not hide a backend; block fp8 has three side by
side: scaled_mm_block (cuBLASLt through torch._scaled_mm), triton_fp8_block and
dequant_dense) and the automatic choice ("dispatch:<backend>"), next to a cuBLAS
bf16 GEMM of the same x and a dense bf16 weight, timed in the same run.

Physical limits, measured in the same run: copy bandwidth (256 MiB copy, read +
written bytes), bf16 GEMM and fp8 GEMM (tensorwise torch._scaled_mm) TFLOP/s on
8192^3. Each row's roofline floor is max(bytes moved / copy bandwidth, flops /
the peak of its arithmetic: fp8 for the W8A8 backends, bf16 otherwise); bytes
moved = x + the weight as the backend reads it + out. `x_floor` = time / floor. The input is the row-strided
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
      choice misses the best backend, the M >= 8K ratio vs cuBLAS bf16, every
      backend side by side at M >= 8K, and the physical limits.
  DIR/dispatch_table_<device>.json (--table): the measured dispatch table
      (mla_ext.dispatch): for every (weight format, dtype, K, N, M bucket) the
      correct backends, fastest first, with their times. Copy it to
      mla_ext/dispatch_tables/<device>.json (or pass that path as --table: the
      kv_b_proj section is merged in, other ops' sections are kept) and commit
      it: KvBProj then dispatches by these measurements on that device.
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
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402

from mla_ext import dispatch as D  # noqa: E402
from mla_ext.kv_b_proj import DISPATCH, KvBProj  # noqa: E402
from mla_ext.kv_b_proj import linear as L  # noqa: E402
from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.kv_b_proj.linear import KvBProjInputs, _capability, table_bucket  # noqa: E402

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
CPU_NATIVE = ("dequant_dense", "scaled_mm_fp8", "scaled_mm_block", "marlin_w8a16")
SPLIT_LABEL = "marlin_w8a16[split={}]"  # --splits rows: the Marlin kernel with a forced split-K
FP8_COMPUTE = ("scaled_mm_block", "triton_fp8_block", "scaled_mm_fp8")  # W8A8: fp8 tensor-core peak
DENSE = "dequant_dense"
MAX_MEAN_REL = 0.06
BIG_M = 8192  # the prefill regime: the ">= 1.5x bf16 at M >= 8K" goal for native fp8
# threshold in linear.py -> (backends it gates, "max": wins up to M / "min": wins from M)
THRESHOLDS = {
    "MARLIN_MAX_M": (("marlin_w8a16",), "max"),
    "W4A16_MAX_M": (("triton_w4a16",), "max"),
    "FP8_NATIVE_MIN_M": (("scaled_mm_block", "triton_fp8_block", "scaled_mm_fp8"), "min"),
}
FIELDS = ["device", "dtype", "N", "K", "M", "format", "weight_format", "backend", "time_us", "tflops",
          "cublas_bf16_us", "ratio_vs_cublas_bf16", "floor_us", "x_floor", "mean_rel_err"]


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


def device_name(device: torch.device) -> str:
    """The name dispatch tables are filed under (mla_ext.kv_b_proj.linear._device_name)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_tag(device: torch.device) -> str:
    return D.device_slug(device_name(device))


# -- physical limits, measured in the same run --------------------------------------

def measure_limits(device: torch.device, timer: "Timer") -> dict:
    """{copy_gbs, bf16_tflops, fp8_tflops}; a limit that cannot be measured is NaN
    (and its error is in "errors")."""
    gpu = device.type == "cuda"
    out = {"copy_gbs": float("nan"), "bf16_tflops": float("nan"), "fp8_tflops": float("nan"), "errors": []}
    try:
        nbytes = (256 if gpu else 16) << 20
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        out["copy_gbs"] = 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9
        del src, dst
    except Exception as exc:  # noqa: BLE001 - a missing limit is reported, the run goes on
        out["errors"].append(f"copy: {exc}")
    n = 8192 if gpu else 512
    try:
        a = torch.randn(n, n, device=device).to(torch.bfloat16)
        b = torch.randn(n, n, device=device).to(torch.bfloat16)
        out["bf16_tflops"] = 2 * n ** 3 / timer(lambda: a @ b) / 1e12
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out["fp8_tflops"] = 2 * n ** 3 / timer(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e12
    except Exception as exc:  # noqa: BLE001
        out["errors"].append(f"gemm: {' '.join(str(exc).split())[:200]}")
    return out


def limits_line(lim: dict) -> str:
    text = (f"physical limits measured in this run: copy {lim['copy_gbs']:.4g} GB/s, "
            f"bf16 GEMM {lim['bf16_tflops']:.4g} TFLOP/s, fp8 GEMM {lim['fp8_tflops']:.4g} TFLOP/s")
    return text + (f" ({'; '.join(lim['errors'])})" if lim.get("errors") else "")


def weight_bytes(fmt) -> int:
    """Bytes of the stored weight tensors of a format (one level into packed objects)."""
    total = 0
    for v in vars(fmt).values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif hasattr(v, "__dict__") and not isinstance(v, (torch.dtype, torch.device)):
            total += sum(t.numel() * t.element_size() for t in vars(v).values() if isinstance(t, torch.Tensor))
    return total


def floor_seconds(backend: str, layer: KvBProj, m: int, elt: int, lim: dict) -> float:
    """The row's roofline floor: max(bytes / copy bandwidth, flops / peak)."""
    n, k = layer.N, layer.K
    w = n * k * elt if backend == DENSE else weight_bytes(layer.weight_format)
    mem = (m * k * elt + w + m * n * elt) / (lim["copy_gbs"] * 1e9)
    peak = lim["fp8_tflops"] if backend in FP8_COMPUTE else lim["bf16_tflops"]
    comp = 2.0 * m * n * k / (peak * 1e12)
    return max(mem, comp)


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


def run(args, log: RowLog, limits: dict) -> None:
    device = torch.device(args.device)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    elt = torch.tensor([], dtype=dt).element_size()
    timer = Timer(device, not args.no_flush)
    limits.update(measure_limits(device, timer))
    print(limits_line(limits), flush=True)
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
                row0 = dict(base, N=n, M=m, format=recipe, weight_format=layer.weight_format.name,
                            cublas_bf16_us=_sig(t_ref * 1e6))
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
                    fl = floor_seconds(forced or chosen, layer, m, elt, limits)
                    r = log.add(dict(row, time_us=_sig(t * 1e6), tflops=_sig(flop / t / 1e12),
                                     ratio_vs_cublas_bf16=_sig(t_ref / t), floor_us=_sig(fl * 1e6),
                                     x_floor=_sig(t / fl), mean_rel_err=_sig(err)))
                    print(f"N={n:6d} M={m:6d} {recipe:16s} {label:28s} {r['time_us']:10.1f} us "
                          f"{r['tflops']:8.2f} TFLOP/s  x{r['ratio_vs_cublas_bf16']:.2f} vs bf16  "
                          f"{r['x_floor']:.2f}x floor", flush=True)
                if args.splits and "marlin_w8a16" in cands:
                    _split_rows(args, layer, x, ref, row0, t_ref, flop, elt, limits, timer, log)
                del ref


def _split_rows(args, layer, x, ref, row0, t_ref, flop, elt, limits, timer, log) -> None:
    """--splits: the Marlin kernel with each forced split-K (rows SPLIT_LABEL), to
    check the automatic split against its neighbours. Not backends: the dispatch
    table and the misses ignore them."""
    from mla_ext.kv_b_proj.marlin import marlin_fp8_gemm

    packed = layer.weight_format.packed
    for s in args.splits:
        row = dict(row0, backend=SPLIT_LABEL.format(s))
        try:
            def call():
                return marlin_fp8_gemm(x, packed, out_dtype=layer.params_dtype, split_k=s)

            err = mean_rel_err(call(), ref)
            if not err <= MAX_MEAN_REL:
                log.fail(dict(row, mean_rel_err=_sig(err)), f"mean|out - ref| / mean|ref| = {err:.3g}", "mismatch")
                continue
            t = timer(call)
        except Exception as exc:  # noqa: BLE001
            log.fail(row, exc)
            continue
        fl = floor_seconds("marlin_w8a16", layer, x.shape[0], elt, limits)
        log.add(dict(row, time_us=_sig(t * 1e6), tflops=_sig(flop / t / 1e12), ratio_vs_cublas_bf16=_sig(t_ref / t),
                     floor_us=_sig(fl * 1e6), x_floor=_sig(t / fl), mean_rel_err=_sig(err)))


def _is_backend(label: str) -> bool:
    """A row of a registered backend (forced), not dispatch:* or a --splits variant."""
    return not label.startswith("dispatch:") and "[" not in label


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
        forced = [r for r in sel if _is_backend(r["backend"])]
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


def marlin_plans(rows: list[dict], sm_count: int = 0) -> list[str]:
    """Per (N, format, M) where marlin_w8a16 was measured: its time and speed vs cuBLAS
    bf16, its plan (CTA tile, split-K on `sm_count` SMs) and the fastest --splits row if any."""
    from mla_ext.kv_b_proj.marlin import plan_gemm

    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for n, fmt, m in sorted({(r["N"], r["format"], r["M"]) for r in ok}):
        sel = {r["backend"]: r for r in ok if (r["N"], r["format"], r["M"]) == (n, fmt, m)}
        r = sel.get("marlin_w8a16")
        if r is None:
            continue
        p = plan_gemm(m, n, r.get("K", K), 128 if fmt.endswith("g128") else -1, sm_count)
        line = (f"N={n} M={m} {fmt}: marlin_w8a16 {r['time_us']:.4g} us (x{r['ratio_vs_cublas_bf16']} vs cuBLAS "
                f"bf16); tile {16 * p.mb}x{32 * p.ws}, split {p.split} on {sm_count or 'no'} SMs")
        splits = {b: x["time_us"] for b, x in sel.items() if b.startswith("marlin_w8a16[")}
        if splits:
            best = min(splits, key=splits.get)
            line += f"; fastest forced split {best} {splits[best]:.4g} us"
        out.append(line)
    return out


def side_by_side(rows: list[dict], min_m: int = BIG_M) -> list[str]:
    """At M >= min_m: every backend of each (N, format, M) on one line, fastest first:
    time, speed vs cuBLAS bf16 and multiple of the roofline floor."""
    ok = [r for r in rows if r["status"] == "ok" and not r["backend"].startswith("dispatch:")]
    out = []
    for n, fmt, m in sorted({(r["N"], r["format"], r["M"]) for r in ok if r["M"] >= min_m}):
        sel = sorted((r for r in ok if (r["N"], r["format"], r["M"]) == (n, fmt, m)), key=lambda r: r["time_us"])
        cells = [f"{r['backend']} {r['time_us']:.4g} us x{r.get('ratio_vs_cublas_bf16', float('nan')):.2f}"
                 + (f" ({r['x_floor']:.2f}x floor)" if isinstance(r.get("x_floor"), float) else "") for r in sel]
        out.append(f"N={n} M={m} {fmt}: " + " | ".join(cells) + f" | cuBLAS bf16 {sel[0].get('cublas_bf16_us')} us")
    return out


def table_entries(rows: list[dict], dtype: torch.dtype) -> dict:
    """{bucket: {"order", "us", "recipes", "M", "cublas_bf16_us"}} from the correct rows: per
    (weight format, dtype, K, N, M bucket) the backends fastest first. Recipes sharing a
    weight format (fp8 per-tensor / per-channel) count with their slowest time; several
    measured M in one bucket: the largest."""
    ok = [r for r in rows if r["status"] == "ok" and _is_backend(r["backend"])
          and r.get("weight_format") and isinstance(r.get("time_us"), float)]
    groups: dict[str, dict] = {}
    for r in ok:
        key = table_bucket(r["weight_format"], dtype, dtype, r["K"], r["N"], r["M"])
        g = groups.setdefault(key, {"M": r["M"], "us": {}, "recipes": set(), "cublas_bf16_us": r.get("cublas_bf16_us")})
        if r["M"] < g["M"]:
            continue
        if r["M"] > g["M"]:
            g.update(M=r["M"], us={}, recipes=set(), cublas_bf16_us=r.get("cublas_bf16_us"))
        g["us"][r["backend"]] = max(g["us"].get(r["backend"], 0.0), r["time_us"])
        g["recipes"].add(r["format"])
    entries = {}
    for key, g in sorted(groups.items()):
        order = sorted(g["us"], key=lambda b: g["us"][b])
        entries[key] = {"order": order, "us": {b: g["us"][b] for b in order}, "recipes": sorted(g["recipes"]),
                        "M": g["M"], "cublas_bf16_us": g["cublas_bf16_us"]}
    return entries


def write_table(rows: list[dict], args, path: str) -> str:
    """Merge the measured entries into the table at `path`; one line for the report."""
    device = torch.device(args.device)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    entries = table_entries(rows, dt)
    if not entries:
        return f"dispatch table: no correct rows, {path} not written"
    import triton

    source = (f"benchmarks/bench_kv_b_proj.py ({'sweep' if args.sweep else 'run'}, N={args.N}, M={args.M}, "
              f"{args.dtype}{', no L2 flush' if args.no_flush else ''}) on {device_name(device)}, "
              f"torch {torch.__version__}, triton {triton.__version__}, {time.strftime('%Y-%m-%d')}")
    D.write_table_entries(path, device_name(device), L.OP, entries, source)
    return f"dispatch table: {len(entries)} entries for {device_name(device)} -> {path}"


def report(rows: list[dict], is_gpu: bool, max_misses: int = 20, limits: dict | None = None,
           sm_count: int = 0) -> list[str]:
    lines = []
    if limits:
        lines.append(limits_line(limits))
    lines.append("crossover M (fill mla_ext/kv_b_proj/linear.py thresholds from these):")
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
        lines.append("every backend side by side at M >= 8K (fastest first; x = speed vs cuBLAS bf16):")
        lines += ["  " + s for s in (side_by_side(rows) or ["no row at M >= 8192"])]
    else:
        lines.append("  not evaluated: CPU timings on shared cores say nothing about the GPU goals")
    lines.append("the Marlin kernel's plan per shape:")
    lines += ["  " + s for s in (marlin_plans(rows, sm_count) or ["no marlin_w8a16 row measured"])]
    if not is_gpu:
        lines.append("  (CPU: the Marlin rows are the packed-layout reference, timings say nothing about the GPU)")
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
    p.add_argument("--table", help="dispatch table to write/merge (default DIR/dispatch_table_<device>.json)")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time the Marlin kernel with each of these forced split-K values")
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
    limits: dict = {}
    try:
        run(args, log, limits)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the rows measured so far", flush=True)
    except Exception as exc:  # noqa: BLE001 - report what was measured before the failure
        log.fail(dict(device=tag, backend="run"), exc)
    sms = torch.cuda.get_device_properties(torch.device(args.device)).multi_processor_count if gpu else 0
    lines = report(log.rows, gpu, limits=limits, sm_count=sms)
    try:
        lines.append(write_table(log.rows, args, args.table or os.path.join(args.out, f"dispatch_table_{tag}.json")))
    except Exception as exc:  # noqa: BLE001 - the CSV and the report matter more
        lines.append(f"dispatch table: not written ({type(exc).__name__}: {exc})")
    with open(os.path.join(args.out, f"kv_b_proj_crossovers_{tag}.txt"), "w") as f:
        f.write(f"kv_b_proj crossovers on {tag} (N={args.N}, M={args.M}"
                f"{', INTERRUPTED' if interrupted else ''})\n" + "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return finish(log, interrupted, lambda ok: plot(ok, stem + ".png"))


if __name__ == "__main__":
    sys.exit(main())
