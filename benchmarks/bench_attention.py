"""Benchmark of the attention stage: merge_attn_states and varlen attention.

  .venv/bin/python benchmarks/bench_attention.py [--quick] [--out DIR]

- merge: achieved GB/s of every usable merge backend, next to a plain copy of
  the same output tensor in the same run (merge moves 3 o-sized tensors + 3
  LSEs, a copy moves 2 o-sized tensors; both are memory-bound).
- attention: TFLOP/s of every usable varlen_attention backend next to torch
  SDPA (per request, no LSE) on the same MLA shapes (Dqk = 192, Dv = 128),
  for the causal new-token pass and a non-causal context chunk.

On a GPU all backends run; on the CPU the Triton interpreter is skipped (it
measures Python, not a kernel) unless --interpreter is given. Results go to
DIR/bench_attention_<device>.csv and .png (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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


def bench_merge(device, dtype, shapes, reps, skip) -> list[dict]:
    rows = []
    for t, n, d in shapes:
        g = torch.Generator().manual_seed(0)
        o1 = torch.randn(t, n, d, generator=g).to(dtype).to(device)
        o2 = torch.randn(t, n, d, generator=g).to(dtype).to(device)
        l1 = torch.randn(n, t, generator=g).to(device)
        l2 = torch.randn(n, t, generator=g).to(device)
        out, out_lse = torch.empty_like(o1), torch.empty_like(l1)
        es = o1.element_size()
        merge_bytes = 3 * t * n * d * es + 3 * n * t * 4
        copy_s = timeit(lambda: out.copy_(o1), device, reps)
        copy_gbs = 2 * t * n * d * es / copy_s / 1e9
        rows.append(dict(op="copy", backend="torch.copy_", shape=f"T{t} N{n} D{d}", dtype=str(dtype)[6:],
                         ms=copy_s * 1e3, metric=copy_gbs, unit="GB/s", vs_baseline=1.0))
        for name in usable(MERGE, MergeInputs(out, out_lse, o1, l1, o2, l2), skip):
            with MERGE.force(name):
                s = timeit(lambda: merge_attn_states(o1, l1, o2, l2, out=out, out_lse=out_lse), device, reps)
            gbs = merge_bytes / s / 1e9
            rows.append(dict(op="merge", backend=name, shape=f"T{t} N{n} D{d}", dtype=str(dtype)[6:],
                             ms=s * 1e3, metric=gbs, unit="GB/s", vs_baseline=gbs / copy_gbs))
    return rows


def causal_pairs(q_len: int, k_len: int) -> int:
    """Visible (query, key) pairs under bottom-right causal masking."""
    return sum(max(0, min(k_len, i + 1 + k_len - q_len)) for i in range(q_len))


def bench_attention(device, dtype, cases, n, dqk, dv, reps, skip) -> list[dict]:
    rows = []
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
            for qq, kk, vv, m in zip(qs, ks, vs, masks):
                F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=scale)

        s = timeit(sdpa, device, reps)
        base = flops / s / 1e12
        rows.append(dict(op="attention", backend="torch.sdpa", shape=shape, dtype=str(dtype)[6:],
                         ms=s * 1e3, metric=base, unit="TFLOP/s", vs_baseline=1.0))
        x = AttentionInputs(q, k, v, cq, ck, max(q_lens), max(k_lens), scale, causal)
        for name in usable(ATTENTION, x, skip):
            with ATTENTION.force(name):
                s = timeit(lambda: varlen_attention(q, k, v, cq, ck, max(q_lens), max(k_lens), scale, causal),
                           device, reps)
            tf = flops / s / 1e12
            rows.append(dict(op="attention", backend=name, shape=shape, dtype=str(dtype)[6:],
                             ms=s * 1e3, metric=tf, unit="TFLOP/s", vs_baseline=tf / base))
    return rows


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
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
    rows = bench_merge(device, dtype, merge_shapes, reps, skip)
    rows += bench_attention(device, dtype, cases, n, 192, 128, reps, skip)

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_attention_{device}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) + ["device", "quick"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        "quick": args.quick})
    plot(rows, stem + ".png")
    print(f"{'op':<10}{'backend':<13}{'shape':<40}{'ms':>10}{'value':>12}  unit     vs base")
    for r in rows:
        print(f"{r['op']:<10}{r['backend']:<13}{r['shape']:<40}{r['ms']:>10.3f}{r['metric']:>12.3f}  "
              f"{r['unit']:<8} {r['vs_baseline']:.2f}x")
    print(f"wrote {stem}.csv and {stem}.png")


if __name__ == "__main__":
    main()
