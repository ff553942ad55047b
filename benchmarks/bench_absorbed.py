"""Context attention two ways, side by side: up-projection vs latent space (absorbed).

  .venv/bin/python benchmarks/bench_absorbed.py [--quick] [--out DIR] [--table PATH]
      [--formats F ...] [--context C ...] [--new-tokens T ...] [--reps N]

One DeepSeek-V3 layer at TP8 (16 heads; L 512, R 64, P = V = 128; block-FP8
kv_b_proj, Marlin FP8 below sm_89), one request with C context tokens in a
paged cache (block 64) and T new tokens, through `MLAPrefill.forward` twice:
context_attention="up_project" (gather -> kv_b_proj -> head-space attention)
and "absorbed" (latent-space attention straight from the paged cache). Both
share the weights, the cache and the new-token work, so their difference is the
context path. The two outputs are compared first (relative Frobenius <= 2e-2;
a mismatch is a row with status "mismatch").

Sizes: GPU T in 1, 8, 64, 256, 1024, 4096 x C in 32K, 128K, 4K (in that order:
the most telling first), cache formats fp8_ds_mla, auto (a bf16 cache) and
nvfp4_ds_mla; --quick: fp8_ds_mla only, 3 repetitions (what
benchmarks/gpu_check.sh runs). CPU: T in 1, 8, 64, 256 x C in 512, 2K,
fp8_ds_mla (checks the script; the CPU runs the torch paths).

Rates, measured in the same run, first (C = 32K, T = 256 on the GPU; 2K and 64
on the CPU): a 256 MiB copy (bytes/s counting read + written), one tiny op
(launch), the layer's kv_b_proj GEMM, head-space varlen attention over the
up-projected rows; latent attention per cache format, on its first setup.

Report (stdout and DIR/absorbed_crossovers_<device>.txt), per (format, C): the
measured crossover in new tokens (log-interpolated between the last T where
absorbed is faster and the first where it is not) beside the cost model's
prediction (mla_ext/prefill/context_cost.py) with the rates the layer uses now
(a committed table or the stated defaults) and with the rates just measured.

Output (DIR = --out, default benchmarks/results/): DIR/absorbed_<device>.csv,
one row per measurement as it is measured (status, error); the crossover
report; DIR/dispatch_table_<device>.json (--table to choose): the measured
rates and per-case times as the "context_attention" section of a dispatch
table. Copy that section into mla_ext/dispatch_tables/<device>.json (or pass
that path as --table) and commit it: MLAPrefill's cost model then prices
with them on that device. Interrupted (SIGINT): reports the rows measured so far.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402
from bench_cache import Timer  # noqa: E402

from mla_ext import dispatch as D  # noqa: E402
from mla_ext.attention import triton_latent as TL  # noqa: E402
from mla_ext.attention.api import varlen_attention  # noqa: E402
from mla_ext.config.formats import get_format  # noqa: E402
from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.kv_b_proj.linear import KvBProj  # noqa: E402
from mla_ext.config.models import MLAModelConfig, get_model_config  # noqa: E402
from mla_ext.config.policy import CacheConfig  # noqa: E402
from mla_ext.attention import latent as A  # noqa: E402
from mla_ext.prefill import context_cost as AC  # noqa: E402
from mla_ext.prefill.context import CONTEXT_ATTENTION_MODES  # noqa: E402
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata  # noqa: E402
from mla_ext.prefill.synthetic import SyntheticBatch  # noqa: E402
from mla_ext.prefill.timing import StepClock  # noqa: E402

BLOCK = 64
HEADS = 16  # DeepSeek-V3 at TP8
GPU_T = [1, 8, 64, 256, 1024, 4096]
GPU_C = [32768, 131072, 4096]
CPU_T = [1, 8, 64, 256]
CPU_C = [512, 2048]
STEP_NAMES = ("gather", "kv_b_proj", "attention", "merge")
FIELDS = ["kv_cache_dtype", "context", "new_tokens", "heads", "path", "ms"] + [f"{s}_ms" for s in STEP_NAMES] + \
    ["ratio_abs_over_up", "chunk_rows", "model_abs_ms", "model_up_ms", "rel_err"]


def model_config() -> MLAModelConfig:
    base = get_model_config("deepseek-v3")
    return MLAModelConfig("deepseek-v3-tp8", L=base.L, R=base.R, P=base.P, V=base.V, num_heads=HEADS,
                          num_layers=2, max_model_len=base.max_model_len)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def kv_b_proj(m: MLAModelConfig, device: str) -> KvBProj:
    w = torch.randn(m.num_heads * (m.P + m.V), m.L, generator=torch.Generator().manual_seed(0)) / math.sqrt(m.L)
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    fmt = (W.MarlinFp8Weight.from_dense(w, torch.bfloat16) if cap is not None and cap < (8, 9)
           else W.Fp8BlockWeight.from_dense(w, torch.bfloat16))
    return KvBProj(fmt.to(device))


def rel_fro(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


class Setup:
    """The two layers (one kv_b_proj), and a filled cache of C tokens, for one format."""

    def __init__(self, m, proj, fmt: str, C: int, device: str):
        cfg = CacheConfig(fmt, (), BLOCK)
        self.layers = {path: MLAPrefill(m, cfg, proj, layer=0, max_num_seqs=1, context_attention=path)
                       for path in ("up_project", "absorbed")}
        layer = self.layers["absorbed"]
        self.m, self.fmt, self.C, self.device = m, fmt, C, device
        self.batch0 = SyntheticBatch(m, [C], [1], BLOCK, device, seed=C)
        kv_c, k_pe = self.batch0.layer_context(0)
        self.k_scale = None
        if layer.spec.format.scale_kind.name == "PER_TENSOR":
            amax = max(float(kv_c.float().abs().max()), float(k_pe.float().abs().max()))
            self.k_scale = torch.tensor([amax / 448.0], dtype=torch.float32, device=device)
        self.cache = self.batch0.fill_cache(layer, kv_c, k_pe, self.k_scale)
        del kv_c, k_pe

    def inputs(self, T: int):
        b = SyntheticBatch(self.m, [self.C], [T], BLOCK, self.device, seed=self.C + T)
        meta = PrefillMetadata(self.batch0.block_table, [self.C], [T], self.k_scale, block_size=BLOCK)
        return (b.q, b.kv_c_new, b.k_pe_new, self.cache, meta)


def steps_of(layer, args, device: str) -> dict:
    clock = StepClock(device)
    layer(*args, clock=clock)
    t = clock.totals()
    return {f"{s}_ms": t.get(s, 0.0) * 1e3 for s in STEP_NAMES}


def bench_case(setup: Setup, T: int, timer: Timer, rates_now: AC.Rates, log: RowLog) -> list[dict]:
    args = setup.inputs(T)
    outs = {p: lay(*args) for p, lay in setup.layers.items()}
    err = rel_fro(outs["absorbed"], outs["up_project"])
    common = dict(kv_cache_dtype=setup.fmt, context=setup.C, new_tokens=T, heads=setup.m.num_heads, rel_err=err)
    if not math.isfinite(err) or err > 2e-2:
        log.fail(dict(common, path="both"), f"absorbed and up_project differ (rel err {err:.3g} > 2e-2)", "mismatch")
        return []
    layer = setup.layers["absorbed"]
    W_rows = layer.workspace_rows
    chunk = min(setup.C, W_rows)
    n_chunks = -(-setup.C // W_rows)
    up_c, ab_c = AC.path_costs(layer.context_attention.dims, [chunk], [T], rates_now,
                               absorbed_gathers=layer.context_attention.gathers(torch.device(setup.device)))
    ms = {p: timer(lambda p=p: setup.layers[p](*args)) * 1e3 for p in ("up_project", "absorbed")}
    rows = []
    for p in ("up_project", "absorbed"):
        rows.append(log.add(dict(common, path=p, ms=ms[p], **steps_of(setup.layers[p], args, setup.device),
                                 ratio_abs_over_up=ms["absorbed"] / ms["up_project"], chunk_rows=chunk,
                                 model_abs_ms=ab_c.seconds * 1e3 * n_chunks, model_up_ms=up_c.seconds * 1e3 * n_chunks)))
    return rows


# -- rates measured in this run -------------------------------------------------------------

RATE_C = {"cuda": 32768, "cpu": 2048}  # context rows the rates are measured on
RATE_T = {"cuda": 256, "cpu": 64}  # query rows


def _attempt(out: dict, name: str, fn, log: RowLog, **row) -> None:
    try:
        out[name] = fn()
        print(f"  rate {name}: {out[name]:.4g}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the other rates still count
        log.fail(dict(row, path=f"rate:{name}"), exc)


def measure_common_rates(m, proj, device: str, timer: Timer, log: RowLog) -> dict:
    """bytes_per_s, launch_s, gemm_flops and attention_flops from single calls (first,
    so that a run cut short by its time cap still has them)."""
    out: dict = {}
    C, T = RATE_C[device], RATE_T[device]
    N, L, R, P, V = m.num_heads, m.L, m.R, m.P, m.V
    dt = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(5)
    nbytes = (256 if device == "cuda" else 64) << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _attempt(out, "bytes_per_s", lambda: 2 * nbytes / timer(lambda: dst.copy_(src)), log)
    del src, dst
    one = torch.zeros(1, device=device)
    _attempt(out, "launch_s", lambda: timer(lambda: one.add_(1)), log)
    x = torch.randn(C, L + R, generator=gen, device=device).to(dt)[:, :L]  # the workspace view
    _attempt(out, "gemm_flops", lambda: 2 * C * L * N * (P + V) / timer(lambda: proj(x)), log)
    kv = proj(x).view(C, N, P + V)
    k_pe = torch.randn(C, R, generator=gen, device=device).to(dt)
    q = torch.randn(T, N, P + R, generator=gen, device=device).to(dt)
    cq = torch.tensor([0, T], dtype=torch.int32, device=device)
    ck = torch.tensor([0, C], dtype=torch.int32, device=device)
    _attempt(out, "attention_flops", lambda: 2 * T * C * N * (P + R + V) / timer(
        lambda: varlen_attention(q, kv[..., :P], kv[..., P:], cq, ck, T, C, 0.1, False, k_rope=k_pe)), log)
    return out


def measure_latent_rate(m, setup: "Setup", timer: Timer, log: RowLog, out: dict) -> None:
    """The latent kernel's FLOP/s on this format's cache (its first min(C, RATE_C) tokens)
    into out["latent_flops_by_format"] (and out["latent_flops"]: fp8_ds_mla's, else the best)."""
    device = setup.device
    C, T = min(RATE_C[device], setup.C), RATE_T[device]
    N, L, R = m.num_heads, m.L, m.R
    gen = torch.Generator(device=device).manual_seed(6)
    q_lat = (torch.randn(N, T, L, generator=gen, device=device) / math.sqrt(L)).to(torch.bfloat16)
    q_pe = torch.randn(T, N, R, generator=gen, device=device).to(torch.bfloat16)
    cq = torch.tensor([0, T], dtype=torch.int32, device=device)
    ck = torch.tensor([0, C], dtype=torch.int32, device=device)
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    scale = setup.k_scale if setup.k_scale is not None else torch.ones(1, device=device)
    name = get_format(setup.fmt).name
    by_fmt = out.setdefault("latent_flops_by_format", {})
    _attempt(by_fmt, name, lambda: 2 * T * C * N * (2 * L + R) / timer(
        lambda: A.latent_context_attention(q_lat, q_pe, setup.cache, setup.fmt, setup.batch0.block_table, cq, ck,
                                           starts, scale, 0.1, q_offsets=[0, T], ctx_offsets=[0, C])),
             log, kv_cache_dtype=setup.fmt)
    if name in by_fmt and torch.device(device).type == "cuda":  # the tile it ran with (issue 19: say what it costs)
        out.setdefault("latent_tile_by_format", {})[name] = TL.launch_config(
            T * N, torch.bfloat16, torch.device(device), TL.cache_mode(setup.fmt), N)
    if by_fmt:
        out["latent_flops"] = by_fmt.get("fp8_ds_mla", max(by_fmt.values()))
    else:
        out.pop("latent_flops_by_format")


# -- report -----------------------------------------------------------------------------------

def measured_crossover(rows: list[dict]) -> tuple[float, str]:
    """(T, how) from one (format, C)'s absorbed rows sorted by T: log-interpolated where
    absorbed / up_project crosses 1; 0 when up_project already wins at the smallest
    T, inf when absorbed still wins at the largest."""
    pts = sorted((r["new_tokens"], r["ratio_abs_over_up"]) for r in rows if r["path"] == "absorbed")
    if not pts:
        return math.nan, "no rows"
    if pts[0][1] >= 1:
        return 0.0, f"up_project already faster at T={pts[0][0]}"
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if r1 >= 1:
            a, b = math.log(r0), math.log(r1)
            f = (0 - a) / (b - a) if b != a else 0.0
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0))), f"absorbed faster at {t0}, not at {t1}"
    return math.inf, f"absorbed still faster at T={pts[-1][0]}"


def _size(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def report(rows: list[dict], setups: dict, rates_now: AC.Rates, measured: dict) -> tuple[list[str], list[str]]:
    """(detail lines, one summary line per format)."""
    lines = [f"rates in use ({rates_now.describe()})"]
    meas = None
    if all(k in measured for k in AC.RATE_KEYS):
        meas = AC.Rates(*(measured[k] for k in AC.RATE_KEYS), source="measured in this run",
                        latent_by_format=tuple(sorted(measured.get("latent_flops_by_format", {}).items())))
        lines.append(f"rates measured now: {meas.describe()}")
    else:
        lines.append(f"rates measured now: incomplete ({sorted(measured)})")
    for fmt, tile in sorted(measured.get("latent_tile_by_format", {}).items()):
        flops = measured.get("latent_flops_by_format", {}).get(fmt, math.nan)
        gemm = measured.get("gemm_flops", math.nan)
        lines.append(f"latent kernel {fmt}: tile (BLOCK_M, BLOCK_N, warps, stages) = {tuple(tile)}, "
                     f"{flops / 1e12:.1f} TFLOP/s = {flops / gemm:.0%} of the kv_b_proj GEMM rate measured in this run")
    ok = [r for r in rows if r.get("status") == "ok"]
    summaries = []
    for fmt, s in setups.items():
        summary = []
        for C in sorted({r["context"] for r in ok if r["kv_cache_dtype"] == fmt}):
            mine = [r for r in ok if r["kv_cache_dtype"] == fmt and r["context"] == C]
            x, how = measured_crossover(mine)
            layer = s.layers["absorbed"]  # the format's dims; C only sets the chunk below
            d = layer.context_attention.dims
            gathers = layer.context_attention.gathers(torch.device(s.device))
            chunk = min(C, layer.workspace_rows)
            pred_now = AC.crossover_new_tokens(d, chunk, rates_now, absorbed_gathers=gathers)
            pred_meas = AC.crossover_new_tokens(d, chunk, meas, absorbed_gathers=gathers) if meas else math.nan
            lines.append(f"{fmt} C={C}: measured crossover {x:.4g} new tokens ({how}); predicted {pred_now:.4g} "
                         f"with the rates in use, {pred_meas:.4g} with the rates measured now "
                         f"(FLOP count alone {AC.flop_crossover(d.L, d.P, d.V):.1f})")
            summary.append(f"C={_size(C)} measured {x:.3g} / predicted {pred_now:.3g} (now-measured rates "
                           f"{pred_meas:.3g})")
        if summary:
            summaries.append(f"crossover {fmt}: " + "; ".join(summary))
    return lines, summaries


def write_table(rows: list[dict], measured: dict, device: str, path: str) -> str:
    ok = [r for r in rows if r.get("status") == "ok" and r["path"] in CONTEXT_ATTENTION_MODES]
    if not all(k in measured for k in AC.RATE_KEYS):
        return f"dispatch table: rates incomplete ({sorted(measured)}), {path} not written"
    entries = {}
    for r in ok:
        key = f"{r['kv_cache_dtype']}/N={r['heads']}/C={r['context']}/T={r['new_tokens']}"
        e = entries.setdefault(key, {"us": {}})
        e["us"][r["path"]] = round(r["ms"] * 1e3, 3)
    for e in entries.values():
        e["order"] = sorted(e["us"], key=e["us"].get)
    name = device_name(device)
    AC.write_rates(path, name, measured, entries,
                   source=f"benchmarks/bench_absorbed.py on {name}, torch {torch.__version__}")
    return f"dispatch table: context_attention rates and {len(entries)} cases for {name} -> {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fp8_ds_mla only, 3 repetitions (CPU: small sizes)")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--table", help="dispatch table to write/merge (default DIR/dispatch_table_<device>.json)")
    ap.add_argument("--formats", nargs="+", help="cache formats (default fp8_ds_mla auto nvfp4_ds_mla)")
    ap.add_argument("--context", type=int, nargs="+", help="context tokens C")
    ap.add_argument("--new-tokens", type=int, nargs="+", help="new tokens T")
    ap.add_argument("--reps", type=int, help="timed repetitions per case")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1, as the other benchmarks)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    formats = args.formats or (["fp8_ds_mla"] if args.quick or device == "cpu" else ["fp8_ds_mla", "auto",
                                                                                       "nvfp4_ds_mla"])
    contexts = args.context or (GPU_C if device == "cuda" else CPU_C)
    news = args.new_tokens or (GPU_T if device == "cuda" else CPU_T)
    reps = args.reps or (3 if args.quick or device == "cpu" else 10)
    tag = D.device_slug(device_name(device))
    stem = os.path.join(args.out, f"absorbed_{device}")
    log = RowLog(stem + ".csv", FIELDS, dict(device=device_name(device), quick=args.quick))
    m = model_config()
    interrupted = False
    setups: dict = {}
    measured: dict = {}
    rates_now = AC.rates_for(device)
    print(f"one layer {m.name}: N={m.num_heads}, L={m.L}, R={m.R}, P={m.P}, V={m.V}; formats {formats}, "
          f"C {contexts}, T {news}; {rates_now.describe()}", flush=True)
    from mla_ext.attention.api import ATTENTION

    try:
        timer = Timer(device, reps)
        proj = kv_b_proj(m, device)
        # The CPU runs head-space attention through the torch backend (as bench_prefill).
        with (ATTENTION.force("torch") if device == "cpu" else contextlib.nullcontext()):
            measured = measure_common_rates(m, proj, device, timer, log)
            for fmt in formats:
                for C in contexts:
                    try:
                        setup = Setup(m, proj, fmt, C, device)
                    except Exception as exc:  # noqa: BLE001 - the next size may still run
                        log.fail(dict(kv_cache_dtype=fmt, context=C, path="setup"), exc)
                        continue
                    if fmt not in setups:
                        setups[fmt] = setup  # the report reads the format's dims from it
                        measure_latent_rate(m, setup, timer, log, measured)
                    for T in news:
                        try:
                            case = bench_case(setup, T, timer, rates_now, log)
                        except Exception as exc:  # noqa: BLE001 - the next case may still run
                            log.fail(dict(kv_cache_dtype=fmt, context=C, new_tokens=T, path="both"), exc)
                            continue
                        if case:
                            up, ab = case
                            print(f"  {fmt:<12} C {C:>6} T {T:>5}: up_project {up['ms']:9.3f} ms, absorbed "
                                  f"{ab['ms']:9.3f} ms ({ab['ratio_abs_over_up']:.2f}x; model "
                                  f"{ab['model_abs_ms'] / ab['model_up_ms']:.2f}x)", flush=True)
                    if setups.get(fmt) is not setup:
                        del setup
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the rows measured so far", flush=True)
    lines, summaries = report(log.rows, setups, rates_now, measured)
    try:
        lines.append(write_table(log.rows, measured, device,
                                 args.table or os.path.join(args.out, f"dispatch_table_{tag}.json")))
    except Exception as exc:  # noqa: BLE001 - the CSV and the report matter more
        lines.append(f"dispatch table: not written ({type(exc).__name__}: {exc})")
    os.makedirs(args.out, exist_ok=True)
    lines += summaries  # last: the log tail gpu_check prints
    with open(os.path.join(args.out, f"absorbed_crossovers_{tag}.txt"), "w") as f:
        f.write(f"absorbed vs up_project on {device_name(device)}{', INTERRUPTED' if interrupted else ''}\n"
                + "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    return finish(log, interrupted)


if __name__ == "__main__":
    sys.exit(main())
