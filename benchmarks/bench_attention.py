"""Benchmark of the attention stage: merge_attn_states and varlen attention.

  .venv/bin/python benchmarks/bench_attention.py [--quick] [--out DIR]

- merge: achieved GB/s of every usable merge backend, next to a plain copy of
  the same output tensor in the same run (merge moves 3 o-sized tensors + 3
  LSEs, a copy moves 2 o-sized tensors; both are memory-bound).
- attention: TFLOP/s of every usable varlen_attention backend next to torch
  SDPA (per request, no LSE) on the same MLA shapes (Dqk = 192, Dv = 128),
  for the causal new-token pass and a non-causal context chunk.

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

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402

from mla_ext.attention import ATTENTION, MERGE, merge_attn_states, varlen_attention  # noqa: E402
from mla_ext.attention.api import AttentionInputs, MergeInputs  # noqa: E402


def timeit(fn, device: str, reps: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
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


def measure(log: RowLog, row: dict, check, timed, amount: float, baseline: float | None) -> None:
    """check() -> relative error against the reference; timed() is what is timed
    (seconds per call); `amount` bytes or flops per call. A failure or a mismatch
    is a row with its message."""
    try:
        err = check()
        if not err <= MAX_REL_ERR:
            log.fail(row, f"relative error {err:.3g} > {MAX_REL_ERR} against the reference", "mismatch")
            return
        s = timed()
    except Exception as exc:  # noqa: BLE001 - the next backend or shape may still run
        log.fail(row, exc)
        return
    metric = amount / s / (1e9 if row["unit"] == "GB/s" else 1e12)
    log.add(dict(row, ms=s * 1e3, metric=metric, vs_baseline=metric / baseline if baseline else 1.0))


def bench_merge(device, dtype, shapes, reps, skip, log: RowLog) -> None:
    for t, n, d in shapes:
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
        log.add(dict(common, op="copy", backend="torch.copy_", ms=copy_s * 1e3, metric=copy_gbs, vs_baseline=1.0))
        for name in usable(MERGE, MergeInputs(out, out_lse, o1, l1, o2, l2), skip):
            def call(name=name):
                with MERGE.force(name):
                    merge_attn_states(o1, l1, o2, l2, out=out, out_lse=out_lse)

            def check(call=call):
                out.fill_(float("nan"))
                call()
                return rel_err(out, want)

            measure(log, dict(common, op="merge", backend=name), check, lambda call=call: timeit(call, device, reps),
                    merge_bytes, copy_gbs)


def causal_pairs(q_len: int, k_len: int) -> int:
    """Visible (query, key) pairs under bottom-right causal masking."""
    return sum(max(0, min(k_len, i + 1 + k_len - q_len)) for i in range(q_len))


def bench_attention(device, dtype, cases, n, dqk, dv, reps, skip, log: RowLog) -> None:
    for label, q_lens, k_lens, causal in cases:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(sum(q_lens), n, dqk, generator=g).to(dtype).to(device)
        k = torch.randn(sum(k_lens), n, dqk, generator=g).to(dtype).to(device)
        v = torch.randn(sum(k_lens), n, dv, generator=g).to(dtype).to(device)
        cq = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        pairs = sum(causal_pairs(a, b) if causal else a * b for a, b in zip(q_lens, k_lens))
        flops = 2 * n * pairs * (dqk + dv)
        scale = dqk ** -0.5
        shape = f"{label} N{n} qk{dqk} v{dv}"

        qs = [q[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(cq[:-1].tolist(), cq[1:].tolist())]
        ks = [k[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(ck[:-1].tolist(), ck[1:].tolist())]
        vs = [v[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(ck[:-1].tolist(), ck[1:].tolist())]
        masks = [torch.ones(a, b, dtype=torch.bool, device=device).tril(b - a) if causal else None
                 for a, b in zip(q_lens, k_lens)]

        def sdpa():
            return [F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=scale)
                    for qq, kk, vv, m in zip(qs, ks, vs, masks)]

        common = dict(op="attention", shape=shape, dtype=str(dtype)[6:], unit="TFLOP/s")
        try:
            want = torch.cat([o[0].transpose(0, 1) for o in sdpa()])  # [T, N, Dv], the reference
            s = timeit(sdpa, device, reps)
        except Exception as exc:  # noqa: BLE001
            log.fail(dict(common, backend="torch.sdpa"), exc)
            continue
        base = flops / s / 1e12
        log.add(dict(common, backend="torch.sdpa", ms=s * 1e3, metric=base, vs_baseline=1.0))
        x = AttentionInputs(q, k, v, cq, ck, max(q_lens), max(k_lens), scale, causal)
        for name in usable(ATTENTION, x, skip):
            score_bytes = n * max(q_lens) * max(k_lens) * 4
            if name == "torch" and score_bytes > MAX_REFERENCE_SCORE_BYTES:
                print(f"  {shape}: not timing the torch reference backend ({score_bytes / 2**30:.0f} GiB of fp32 "
                      "scores per request)", flush=True)
                continue

            def call(name=name):
                with ATTENTION.force(name):
                    return varlen_attention(q, k, v, cq, ck, max(q_lens), max(k_lens), scale, causal)

            measure(log, dict(common, backend=name), lambda call=call: rel_err(call()[0], want),
                    lambda call=call: timeit(call, device, reps), flops, base)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, ops, unit in ((axes[0], ("copy", "merge"), "GB/s"), (axes[1], ("attention",), "TFLOP/s")):
        sel = [r for r in rows if r["op"] in ops]
        labels = [f"{r['shape']}\n{r['op'] if r['op'] == 'copy' else r['backend']}" for r in sel]
        ax.bar(range(len(sel)), [r["metric"] for r in sel],
               color=["gray" if r["vs_baseline"] == 1.0 else "tab:blue" for r in sel])
        ax.set_xticks(range(len(sel)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(("merge vs copy" if unit == "GB/s" else "varlen attention vs SDPA (gray: baseline)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--interpreter", action="store_true", help="also time Triton under the CPU interpreter")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    skip = set() if (device == "cuda" or args.interpreter) else {"triton"}
    dtype = torch.bfloat16
    reps = 5 if args.quick else 20
    if device == "cuda":
        merge_shapes = [(8192, 128, 128)] if args.quick else [(4096, 128, 128), (16384, 128, 128), (65536, 16, 128)]
        n = 16 if args.quick else 128
        cases = [("new causal 4x1024", [1024] * 4, [1024] * 4, True),
                 ("ctx chunk 4x(256q,8192k)", [256] * 4, [8192] * 4, False)]
        if not args.quick:
            cases.append(("ctx chunk 1x(4096q,32768k)", [4096], [32768], False))
    else:
        merge_shapes = [(2048, 16, 128)] if args.quick else [(2048, 16, 128), (8192, 16, 128)]
        n = 4 if args.quick else 16
        cases = [("new causal 2x128", [128] * 2, [128] * 2, True),
                 ("ctx chunk 2x(32q,1024k)", [32] * 2, [1024] * 2, False)]
    stem = os.path.join(args.out, f"bench_attention_{device}")
    log = RowLog(stem + ".csv", ["op", "backend", "shape", "dtype", "ms", "metric", "unit", "vs_baseline"],
                 dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", quick=args.quick))
    interrupted = False
    try:
        bench_merge(device, dtype, merge_shapes, reps, skip, log)
        bench_attention(device, dtype, cases, n, 192, 128, reps, skip, log)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the rows measured so far", flush=True)
    except Exception as exc:  # noqa: BLE001
        log.fail(dict(op="run"), exc)
    print(f"{'op':<10}{'backend':<13}{'shape':<40}{'ms':>10}{'value':>12}  unit     vs base")
    for r in log.ok():
        print(f"{r['op']:<10}{r['backend']:<13}{r['shape']:<40}{r['ms']:>10.3f}{r['metric']:>12.3f}  "
              f"{r['unit']:<8} {r['vs_baseline']:.2f}x")
    return finish(log, interrupted, lambda rows: plot(rows, stem + ".png"))


if __name__ == "__main__":
    sys.exit(main())
