"""Benchmark of the attention stage: every varlen_attention backend side by side,
merge_attn_states, and the machine's limits measured in the same run.

  .venv/bin/python benchmarks/bench_attention.py [--quick] [--out DIR] [--budget-s S]

- peak: a bf16 GEMM's TFLOP/s (torch.matmul, square) and a device copy's GB/s,
  measured first: every attention row's `vs_peak` is its TFLOP/s over that GEMM's.
- attention: TFLOP/s of every usable backend (triton, flex_attention,
  varlen_attn, and the torch reference where its per-request scores fit) next
  to torch SDPA (per request, no LSE: the baseline) at MLA prefill shapes:
  Dqk 192 (P 128 + R 64), Dv 128, N = 16 (TP8) and 128 heads, the causal
  new-token pass and non-causal context chunks of 4K to 64K keys. Backends get
  the keys split, as MLAPrefill passes them (k_nope a view of the up-projection,
  k_rope a column slice of the workspace): Triton reads them as they are,
  flex_attention / varlen_attn assemble them (and FA2 pads V) in a scratch
  that is reused across calls, and that cost is in their time.
- merge: achieved GB/s of every usable merge backend, next to a plain copy.

Time: --budget-s (default 10 s, 0: none) bounds the whole run, since
benchmarks/gpu_check.sh gives this step 15 s. Measurements are ordered by value
(peaks, then every backend that needs no compile, shape by shape, then
flex_attention, whose first call on CUDA compiles for an estimated
FLEX_COMPILE_S, then the merges); one that would not fit what is left is
skipped with a printed note, never a failed row. Repetitions adapt to the
call's time (at least 3).

On a GPU all backends run; on the CPU the Triton interpreter is skipped (it
measures Python, not a kernel) unless --interpreter is given. Each backend's
output is checked first (merge: against the torch backend; attention: against
SDPA; relative error <= 2e-2). Results go to DIR/bench_attention_<device>.csv
(each row as it is measured; a failure or mismatch is a row with its status and
error, and the run goes on) and .png (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

T_START = time.monotonic()

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402

from mla_ext.attention import ATTENTION, MERGE, merge_attn_states, varlen_attention  # noqa: E402
from mla_ext.attention import torch_backends  # noqa: E402
from mla_ext.attention.api import AttentionInputs, MergeInputs  # noqa: E402
from mla_ext.attention.scratch import AttentionScratch  # noqa: E402

# A guess until measured on the GPU machine: the first compiled flex_attention
# call (dynamic shapes, one bucket) on a fresh machine. Only sizes the budget check.
FLEX_COMPILE_S = 30.0
# Allowance for a backend's first call per mask kind (a Triton JIT compile, a cuDNN graph).
FIRST_CALL_S = 2.0


class Budget:
    """Seconds left of the run (--budget-s; 0 or less: unlimited)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return float("inf") if self.seconds <= 0 else self.seconds - (time.monotonic() - T_START)

    def fits(self, need_s: float, what: str) -> bool:
        if need_s <= self.left():
            return True
        print(f"  budget: skipping {what} (needs ~{need_s:.1f} s, {max(self.left(), 0):.1f} s left of "
              f"--budget-s {self.seconds:g})", flush=True)
        return False


def timeit(fn, device: str, reps: int, warmup: int = 2, max_s: float = 1.0) -> float:
    """Median seconds per call: `reps` calls, fewer (at least 3) when they would
    take more than `max_s`."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = max(3, min(reps, int(max_s / max(one, 1e-6))))
    times = []
    if device == "cuda":
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def usable(dispatcher, inputs, skip: set[str]) -> list[str]:
    return [b.name for b in dispatcher.backends if b.name not in skip and not b.not_supported_reasons(inputs)]


MAX_REL_ERR = 2e-2  # bf16 outputs against a reference computed from the same inputs
MAX_REFERENCE_SCORE_BYTES = 4 << 30  # the torch backend materialises [N, q, k] fp32 scores per request


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def measure(log: RowLog, row: dict, check, timed, amount: float, baseline: float | None,
            peak: float | None = None) -> float | None:
    """check() -> relative error against the reference; timed() is what is timed
    (seconds per call); `amount` bytes or flops per call; `peak` the measured
    limit in the row's unit (vs_peak). A failure or a mismatch is a row with its
    message (None returned); else the seconds per call."""
    try:
        err = check()
        if not err <= MAX_REL_ERR:
            log.fail(row, f"relative error {err:.3g} > {MAX_REL_ERR} against the reference", "mismatch")
            return None
        s = timed()
    except Exception as exc:  # noqa: BLE001 - the next backend or shape may still run
        log.fail(row, exc)
        return None
    metric = amount / s / (1e9 if row["unit"] == "GB/s" else 1e12)
    log.add(dict(row, ms=s * 1e3, metric=metric, vs_baseline=metric / baseline if baseline else 1.0,
                 vs_peak=metric / peak if peak else ""))
    return s


def bench_peaks(device, dtype, gemm_n, copy_elems, reps, budget: Budget, log: RowLog) -> dict:
    """The limits attention and merge are held to: a square GEMM's TFLOP/s in the
    benchmark dtype, and a device copy's GB/s (read + write)."""
    peaks = {}
    g = torch.Generator().manual_seed(0)
    try:
        a = torch.randn(gemm_n, gemm_n, generator=g).to(dtype).to(device)
        b = torch.randn(gemm_n, gemm_n, generator=g).to(dtype).to(device)
        s = timeit(lambda: a @ b, device, reps, max_s=min(1.0, max(budget.left() / 10, 0.1)))
        peaks["TFLOP/s"] = 2 * gemm_n ** 3 / s / 1e12
        log.add(dict(op="peak", backend="torch.matmul", shape=f"GEMM {gemm_n}x{gemm_n}x{gemm_n}", dtype=str(dtype)[6:],
                     ms=s * 1e3, metric=peaks["TFLOP/s"], unit="TFLOP/s", vs_baseline=1.0, vs_peak=1.0))
        del a, b
        x = torch.empty(copy_elems, dtype=dtype, device=device).normal_()
        y = torch.empty_like(x)
        s = timeit(lambda: y.copy_(x), device, reps, max_s=0.3)
        peaks["GB/s"] = 2 * x.numel() * x.element_size() / s / 1e9
        log.add(dict(op="peak", backend="torch.copy_", shape=f"copy {x.numel() * x.element_size() >> 20} MiB",
                     dtype=str(dtype)[6:], ms=s * 1e3, metric=peaks["GB/s"], unit="GB/s", vs_baseline=1.0,
                     vs_peak=1.0))
    except Exception as exc:  # noqa: BLE001 - the attention rows still run, without vs_peak
        log.fail(dict(op="peak", backend="torch"), exc)
    return peaks


def bench_merge(device, dtype, shapes, reps, skip, log: RowLog, budget: Budget | None = None,
                peak_gbs: float | None = None) -> None:
    for t, n, d in shapes:
        if budget is not None and not budget.fits(0.5, f"merge T{t} N{n} D{d}"):
            continue
        g = torch.Generator().manual_seed(0)
        o1 = torch.randn(t, n, d, generator=g).to(dtype).to(device)
        o2 = torch.randn(t, n, d, generator=g).to(dtype).to(device)
        l1 = torch.randn(n, t, generator=g).to(device)
        l2 = torch.randn(n, t, generator=g).to(device)
        out, out_lse = torch.empty_like(o1), torch.empty_like(l1)
        es = o1.element_size()
        merge_bytes = 3 * t * n * d * es + 3 * n * t * 4
        common = dict(shape=f"T{t} N{n} D{d}", dtype=str(dtype)[6:], unit="GB/s")
        try:
            with MERGE.force("torch"):
                want, _ = merge_attn_states(o1, l1, o2, l2)
            copy_s = timeit(lambda: out.copy_(o1), device, reps)
        except Exception as exc:  # noqa: BLE001
            log.fail(dict(common, op="copy", backend="torch.copy_"), exc)
            continue
        copy_gbs = 2 * t * n * d * es / copy_s / 1e9
        log.add(dict(common, op="copy", backend="torch.copy_", ms=copy_s * 1e3, metric=copy_gbs, vs_baseline=1.0,
                     vs_peak=copy_gbs / peak_gbs if peak_gbs else ""))
        for name in usable(MERGE, MergeInputs(out, out_lse, o1, l1, o2, l2), skip):
            def call(name=name):
                with MERGE.force(name):
                    merge_attn_states(o1, l1, o2, l2, out=out, out_lse=out_lse)

            def check(call=call):
                out.fill_(float("nan"))
                call()
                return rel_err(out, want)

            measure(log, dict(common, op="merge", backend=name), check,
                    lambda call=call: timeit(call, device, reps, max_s=0.3), merge_bytes, copy_gbs, peak_gbs)


def causal_pairs(q_len: int, k_len: int) -> int:
    """Visible (query, key) pairs under bottom-right causal masking."""
    return sum(max(0, min(k_len, i + 1 + k_len - q_len)) for i in range(q_len))


class AttentionCase:
    """One MLA attention call: q, split keys (k_nope view of the up-projection,
    k_rope a column slice of the workspace), v, offsets; SDPA's answer."""

    def __init__(self, label, q_lens, k_lens, causal, n, p, r, dv, dtype, device):
        self.label, self.q_lens, self.k_lens, self.causal = label, q_lens, k_lens, causal
        g = torch.Generator(device=device).manual_seed(0)
        tq, tk = sum(q_lens), sum(k_lens)
        self.q = torch.randn(tq, n, p + r, generator=g, device=device, dtype=dtype)
        kv = torch.randn(tk, n, p + dv, generator=g, device=device, dtype=dtype)
        ws = torch.randn(tk, 16 + r, generator=g, device=device, dtype=dtype)
        self.k_nope, self.v, self.k_rope = kv[..., :p], kv[..., p:], ws[:, 16:]
        self.cq = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        # The new-token pass passes one offsets tensor for both (as MLAPrefill does).
        self.ck = self.cq if (causal and q_lens == k_lens) else torch.tensor(
            [0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        pairs = sum(causal_pairs(a, b) if causal else a * b for a, b in zip(q_lens, k_lens))
        self.flops = 2 * n * pairs * (p + r + dv)
        self.scale = (p + r) ** -0.5
        self.shape = f"{label} N{n} qk{p}+{r} v{dv}"
        self.max_q, self.max_k = max(q_lens), max(k_lens)
        self.score_bytes = n * self.max_q * self.max_k * 4
        self.scratch = AttentionScratch()
        self.bucket = ATTENTION.table_key(self.inputs())[1][0]  # the dispatch table's key of this call
        self.us: dict[str, float] = {}  # correct backends' times
        self.complete = True  # False once a usable backend was skipped (budget): no table entry

    def sdpa_parts(self):
        keys = torch.cat([self.k_nope, self.k_rope[:, None, :].expand(-1, self.q.shape[1], -1)], dim=-1)
        cq, ck = self.cq.tolist(), self.ck.tolist()
        qs = [self.q[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(cq[:-1], cq[1:])]
        ks = [keys[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(ck[:-1], ck[1:])]
        vs = [self.v[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(ck[:-1], ck[1:])]
        masks = [torch.ones(a, b, dtype=torch.bool, device=self.q.device).tril(b - a) if self.causal else None
                 for a, b in zip(self.q_lens, self.k_lens)]
        return qs, ks, vs, masks

    def inputs(self):
        return AttentionInputs(self.q, self.k_nope, self.v, self.cq, self.ck, self.max_q, self.max_k,
                               self.scale, self.causal, self.k_rope[:, None, :].expand(-1, self.q.shape[1], -1),
                               self.scratch)

    def call(self, backend):
        with ATTENTION.force(backend):
            return varlen_attention(self.q, self.k_nope, self.v, self.cq, self.ck, self.max_q, self.max_k,
                                    self.scale, self.causal, k_rope=self.k_rope, scratch=self.scratch)


def bench_attention(device, dtype, cases, reps, skip, log: RowLog, budget: Budget, peak: float | None) -> list:
    """cases: (label, q_lens, k_lens, causal, n). Per case: SDPA, then every usable
    backend but flex_attention; then flex_attention over the cases (its first
    CUDA call compiles). Returns the measured AttentionCases."""
    dims = (128, 64, 128)  # P, R, V: DeepSeek's 192 / 128
    done, used = [], set()  # done: (case, row fields); used: (backend, causal) already called
    for label, q_lens, k_lens, causal, n in cases:
        if not budget.fits(1.0, f"attention {label} N{n}"):
            continue
        try:
            c = AttentionCase(label, q_lens, k_lens, causal, n, *dims, dtype, device)
        except Exception as exc:  # noqa: BLE001
            log.fail(dict(op="attention", backend="setup", shape=f"{label} N{n}"), exc)
            continue
        common = dict(op="attention", shape=c.shape, dtype=str(dtype)[6:], unit="TFLOP/s")
        try:
            qs, ks, vs, masks = c.sdpa_parts()

            def sdpa():
                return [F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=c.scale)
                        for qq, kk, vv, m in zip(qs, ks, vs, masks)]

            want = torch.cat([o[0].transpose(0, 1) for o in sdpa()])  # [T, N, Dv], the reference
            base_s = timeit(sdpa, device, reps, max_s=min(1.0, budget.left() / 20))
        except Exception as exc:  # noqa: BLE001
            log.fail(dict(common, backend="torch.sdpa"), exc)
            continue
        c.base = c.flops / base_s / 1e12
        c.want, c.base_s = want, base_s
        del qs, ks, vs, sdpa
        log.add(dict(common, backend="torch.sdpa", ms=base_s * 1e3, metric=c.base, vs_baseline=1.0,
                     vs_peak=c.base / peak if peak else ""))
        for b in ATTENTION.backends:
            why = b.not_supported_reasons(c.inputs()) if b.name not in skip else []
            if why:
                print(f"  {c.shape}: {b.name} cannot run: {'; '.join(why)}", flush=True)
        for name in usable(ATTENTION, c.inputs(), skip | {"flex_attention"}):
            if name == "torch" and c.score_bytes > MAX_REFERENCE_SCORE_BYTES:
                print(f"  {c.shape}: not timing the torch reference backend ({c.score_bytes / 2**30:.0f} GiB "
                      "of fp32 scores per request)", flush=True)
                continue
            first = 0.0 if (name, causal) in used or device != "cuda" else FIRST_CALL_S
            if not budget.fits(8 * base_s + 0.3 + first, f"{name} at {c.shape}"):
                c.complete = False
                continue
            used.add((name, causal))
            t = measure(log, dict(common, backend=name), lambda name=name: rel_err(c.call(name)[0], c.want),
                        lambda name=name: timeit(lambda: c.call(name), device, reps,
                                                 max_s=min(1.0, budget.left() / 20)),
                        c.flops, c.base, peak)
            if t is not None:
                c.us[name] = t * 1e6
        done.append((c, common))
    for c, common in done:
        x = c.inputs()
        why = ATTENTION.get("flex_attention").not_supported_reasons(x)
        if "flex_attention" in skip or why:
            continue  # its reasons were printed with the case
        compiled = device != "cuda" or any(bk[:3] == (x.q.device, x.q.dtype, x.q.shape[1])
                                           for bk in torch_backends.flex_compiled_buckets())
        need = 8 * c.base_s + 0.3 + (0 if compiled else FLEX_COMPILE_S)
        if not budget.fits(need, f"flex_attention at {c.shape}" + ("" if compiled else " (first call compiles)")):
            c.complete = False
            continue
        t = measure(log, dict(common, backend="flex_attention"),
                    lambda c=c: rel_err(c.call("flex_attention")[0], c.want),
                    lambda c=c: timeit(lambda: c.call("flex_attention"), device, reps,
                                       max_s=min(1.0, budget.left() / 20)),
                    c.flops, c.base, peak)
        if t is not None:
            c.us["flex_attention"] = t * 1e6
    return [c for c, _ in done]


def table_entries(cases) -> dict:
    """Dispatch-table entries ({bucket: {"order", "us", ...}}) of the cases where every
    usable backend was measured (a budget skip leaves its bucket out: an order
    without the skipped backend could pick a slower one); failed or mismatching
    backends are not in the order."""
    entries = {}
    for c in cases:
        if not c.complete or not c.us:
            continue
        order = sorted(c.us, key=c.us.get)
        entries[c.bucket] = {"order": order, "us": {b: round(c.us[b], 2) for b in order},
                             "sdpa_us": round(c.base_s * 1e6, 2), "shape": c.shape}
    return entries


def write_table(cases, device: str, path: str) -> str:
    from mla_ext import dispatch as D

    entries = table_entries(cases)
    if not entries:
        return f"dispatch table: no complete case, {path} not written"
    name = torch.cuda.get_device_name() if device == "cuda" else device
    source = (f"benchmarks/bench_attention.py on {name}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')} (split keys as MLAPrefill passes them, times in us)")
    D.write_table_entries(path, name, "attention", entries, source)
    return f"dispatch table: {len(entries)} attention entries for {name} -> {path}"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, ops, unit in ((axes[0], ("peak", "copy", "merge"), "GB/s"), (axes[1], ("peak", "attention"), "TFLOP/s")):
        sel = [r for r in rows if r["op"] in ops and r["unit"] == unit]
        labels = [f"{r['shape']}\n{r['op'] if r['op'] == 'copy' else r['backend']}" for r in sel]
        ax.bar(range(len(sel)), [r["metric"] for r in sel],
               color=["gray" if r["vs_baseline"] == 1.0 else "tab:blue" for r in sel])
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(("merge vs copy" if unit == "GB/s" else "varlen attention vs SDPA and a bf16 GEMM (gray)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--interpreter", action="store_true", help="also time Triton under the CPU interpreter")
    ap.add_argument("--table", help="dispatch table to write/merge the attention entries into "
                                    "(default DIR/dispatch_table_<device>.json, next to bench_kv_b_proj's)")
    ap.add_argument("--budget-s", type=float, default=10.0,
                    help="wall-clock budget of the measurements in seconds, from the start (default 10: "
                         "gpu_check.sh gives this step 15 s, the plot and start-up included; 0: unlimited)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    skip = set() if (device == "cuda" or args.interpreter) else {"triton"}
    dtype = torch.bfloat16
    reps = 5 if args.quick else 20
    budget = Budget(args.budget_s)
    if device == "cuda":
        merge_shapes = [(8192, 128, 128)] if args.quick else [(16384, 128, 128), (65536, 16, 128)]
        gemm_n, copy_elems = 8192, 1 << 28
        # (label, q_lens, k_lens, causal, heads): the new-token pass, then context
        # chunks of 4K, 16K and 64K keys; TP8 (16 heads) and TP1 (128 heads).
        # In order of value (the budget may stop the run before the end).
        cases = [("new causal 4x1024", [1024] * 4, [1024] * 4, True, 128),
                 ("ctx 64K keys 1x(2048q,65536k)", [2048], [65536], False, 128),
                 ("ctx 4K keys 4x(256q,1024k)", [256] * 4, [1024] * 4, False, 128)]
        if args.quick:
            cases = [("new causal 4x1024", [1024] * 4, [1024] * 4, True, 16),
                     ("ctx 16K keys 2x(1024q,8192k)", [1024] * 2, [8192] * 2, False, 16)]
        else:
            cases += [("ctx 16K keys 2x(1024q,8192k)", [1024] * 2, [8192] * 2, False, 16),
                      ("ctx 64K keys 1x(2048q,65536k)", [2048], [65536], False, 16),
                      ("ctx 16K keys 2x(1024q,8192k)", [1024] * 2, [8192] * 2, False, 128)]
    else:
        merge_shapes = [(2048, 16, 128)] if args.quick else [(2048, 16, 128), (8192, 16, 128)]
        gemm_n, copy_elems = 256 if args.quick else 512, 1 << 22
        n = 4 if args.quick else 16
        cases = [("new causal 2x128", [128] * 2, [128] * 2, True, n),
                 ("ctx chunk 2x(32q,1024k)", [32] * 2, [1024] * 2, False, n)]
    stem = os.path.join(args.out, f"bench_attention_{device}")
    log = RowLog(stem + ".csv", ["op", "backend", "shape", "dtype", "ms", "metric", "unit", "vs_baseline", "vs_peak"],
                 dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", quick=args.quick))
    interrupted = False
    measured = []
    try:
        peaks = bench_peaks(device, dtype, gemm_n, copy_elems, reps, budget, log)
        measured = bench_attention(device, dtype, cases, reps, skip, log, budget, peaks.get("TFLOP/s"))
        bench_merge(device, dtype, merge_shapes, reps, skip, log, budget, peaks.get("GB/s"))
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the rows measured so far", flush=True)
    except Exception as exc:  # noqa: BLE001
        log.fail(dict(op="run"), exc)
    print(f"{'op':<10}{'backend':<17}{'shape':<44}{'ms':>10}{'value':>11}  unit     vs base  vs peak")
    for r in log.ok():
        vp = f"{r['vs_peak']:.2f}" if isinstance(r.get("vs_peak"), float) else ""
        print(f"{r['op']:<10}{r['backend']:<17}{r['shape']:<44}{r['ms']:>10.3f}{r['metric']:>11.3f}  "
              f"{r['unit']:<8} {r['vs_baseline']:.2f}x  {vp}")
    print(f"wall {time.monotonic() - T_START:.1f} s (budget {args.budget_s:g} s)")
    try:
        from mla_ext.dispatch import device_slug

        slug = device_slug(torch.cuda.get_device_name() if device == "cuda" else device)
        print(write_table(measured, device, args.table or os.path.join(args.out, f"dispatch_table_{slug}.json")))
    except Exception as exc:  # noqa: BLE001 - the CSV matters more
        print(f"dispatch table: not written ({type(exc).__name__}: {exc})")
    return finish(log, interrupted, lambda rows: plot(rows, stem + ".png"))


if __name__ == "__main__":
    sys.exit(main())
