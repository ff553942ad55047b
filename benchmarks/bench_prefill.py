"""Per-layer prefill-with-context time (SPEC §1) for DeepSeek-V3 at TP8 (16 heads).

  .venv/bin/python benchmarks/bench_prefill.py [--quick] [--out DIR] [--context N ...]

One request with C context tokens in a paged cache (block 64) and Q new
tokens, through one `MLAPrefill` layer: fp8_ds_mla cache (and, without
--quick, a skipped layer's native bf16 cache) and DeepSeek's block-FP8
kv_b_proj (Marlin FP8 on GPUs below sm_89). Three numbers per case:

  mla_ext         `MLAPrefill.forward`, end to end (the steps from its StepClock)
  torch composed  what a user writes in plain torch with the same chunk plan:
                  index_select of the pages + dequant (bench_cache.torch_baseline),
                  F.linear with the once-dequantized bf16 weight, a manual softmax
                  with LSE per request and chunk (SDPA returns no LSE), the LSE
                  merge in torch
  roofline floor  the sum of the steps' floors, from peaks measured in the same run:
                  gather bytes (read + written) / copy bandwidth, kv_b_proj flops
                  (2*M*N*K) / bf16 GEMM throughput, attention flops
                  (2*pairs*N*(Dqk+Dv)) / the same GEMM throughput, merge bytes /
                  copy bandwidth. (Assembling k = [k_nope | k_pe] has no floor: a
                  fused kernel does not do it; its time is in mla_ext's total.)
Copy bandwidth: `dst.copy_(src)` of 256 MiB (GPU) / 64 MiB (CPU); GEMM
throughput: a bf16 cuBLAS GEMM 8192^3 (GPU) / 1024^3 (CPU).
Target (GPU, from the issue): mla_ext >= 1.5x the torch baseline and within
1.3x of the roofline sum. Both outputs are checked against each other first.

Sizes: GPU C in 8K, 32K, 128K with Q = 2K (--quick: fp8_ds_mla only, which
fits the GPU check's 2 minutes); CPU --quick: C in 1K, 4K with Q = 128.
Results: DIR/prefill_<device>.csv and .png (default benchmarks/results/); the CSV
gets each case's rows as they are measured, and a case that fails or whose two
outputs differ is a row with its status and error (the run goes on; exit status 1).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402
from bench_cache import Timer, torch_baseline as torch_gather  # noqa: E402

from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.config.models import get_model_config, MLAModelConfig  # noqa: E402
from mla_ext.config.policy import CacheConfig  # noqa: E402
from mla_ext.prefill.layer import MLAPrefill  # noqa: E402
from mla_ext.prefill.synthetic import SyntheticBatch  # noqa: E402
from mla_ext.prefill.timing import STEPS, StepClock, step_work  # noqa: E402

BLOCK = 64
HEADS = 16  # DeepSeek-V3 at TP8
FLOOR_STEPS = ("gather", "kv_b_proj", "attention", "merge")
TARGET_SPEEDUP, TARGET_ROOFLINE = 1.5, 1.3


# -- the torch-composed baseline ---------------------------------------------------

def torch_attention_lse(q, k, v, scale: float, causal: bool, max_score_bytes: int):
    """q [tq, N, D], k [tk, N, D], v [tk, N, V] -> (o [tq, N, V], lse [N, tq] fp32),
    bottom-right causal when asked; query blocks bound the fp32 score matrix."""
    tq, n, _ = q.shape
    tk = k.shape[0]
    o = torch.empty(tq, n, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(n, tq, dtype=torch.float32, device=q.device)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    step = max(1, max_score_bytes // max(1, n * tk * 4))
    for a in range(0, tq, step):
        b = min(tq, a + step)
        s = torch.matmul(q[a:b].transpose(0, 1), kh.transpose(1, 2)).float() * scale  # [N, qb, tk]
        if causal:
            qi = torch.arange(a, b, device=q.device)[:, None]
            s.masked_fill_(torch.arange(tk, device=q.device)[None, :] > qi + (tk - tq), float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(l), 0, l)[..., None]).to(v.dtype)
        o[a:b] = torch.matmul(p, vh).transpose(0, 1)
        lse[:, a:b] = l
    return o, lse


def torch_merge(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), 0, m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    s = w1 + w2
    a = (w1 / s).nan_to_num(0).t()[..., None]
    b = (w2 / s).nan_to_num(0).t()[..., None]
    return (o1.float() * a + o2.float() * b).to(o1.dtype), m + torch.log(s)


def torch_composed(layer: MLAPrefill, w: torch.Tensor, batch: SyntheticBatch, cache, meta, fmt: str,
                   clock: StepClock | None = None, max_score_bytes: int = 2 << 30):
    """The layer in plain torch (same chunk plan, same step names as MLAPrefill)."""
    m = layer.model
    N, P, R, V = m.num_heads, m.P, m.R, m.V
    tick = clock.mark if clock is not None else (lambda step: None)
    if clock is not None:
        clock.start()

    def up(x, rope):
        kv = F.linear(x, w).view(-1, N, P + V)
        tick("kv_b_proj")
        k = torch.cat([kv[..., :P], rope[:, None, :].expand(-1, N, R)], dim=-1)
        tick("keys")
        return k, kv[..., P:]

    q, T, scale = batch.q, batch.num_tokens, layer.softmax_scale
    cu = [0]
    for n in meta.query_lens:
        cu.append(cu[-1] + n)
    k, v = up(batch.kv_c_new, batch.k_pe_new)
    o_new = torch.empty(T, N, V, dtype=q.dtype, device=q.device)
    lse_new = torch.empty(N, T, dtype=torch.float32, device=q.device)
    for a, b in zip(cu, cu[1:]):
        o_new[a:b], lse_new[:, a:b] = torch_attention_lse(q[a:b], k[a:b], v[a:b], scale, True, max_score_bytes)
    tick("attention")
    acc_o = torch.zeros(T, N, V, dtype=q.dtype, device=q.device)
    acc_lse = torch.full((N, T), float("-inf"), device=q.device)
    plan = meta.plan(layer.workspace_rows, layer.chunk_alignment)
    ws = torch.empty(layer.workspace_rows, m.L + m.R, dtype=m.model_dtype, device=q.device)
    for c in plan.chunks:
        # Requests without context rows add nothing to the workspace; leave them out.
        live = [i for i, n in enumerate(c.chunk_lens) if n]
        table = meta.block_table[c.req_start:c.req_end][live]
        torch_gather(cache, table, [c.chunk_lens[i] for i in live], [c.seq_starts[i] for i in live], fmt, 1.0, ws)
        tick("gather")
        rows = c.total_rows
        ck, cv = up(ws[:rows, : m.L], ws[:rows, m.L:])
        o = torch.zeros(c.token_end - c.token_start, N, V, dtype=q.dtype, device=q.device)
        lse = torch.full((N, o.shape[0]), float("-inf"), device=q.device)
        for i in range(c.num_reqs):
            qa, qb = c.cu_seqlens_q[i], c.cu_seqlens_q[i + 1]
            ka, kb = c.cu_seq_lens[i], c.cu_seq_lens[i + 1]
            qs = slice(c.token_start + qa, c.token_start + qb)
            o[qa:qb], lse[:, qa:qb] = torch_attention_lse(q[qs], ck[ka:kb], cv[ka:kb], scale, False,
                                                          max_score_bytes)
        tick("attention")
        qs = slice(c.token_start, c.token_end)
        acc_o[qs], acc_lse[:, qs] = torch_merge(acc_o[qs], acc_lse[:, qs], o, lse)
        tick("merge")
    out, _ = torch_merge(acc_o, acc_lse, o_new, lse_new)
    tick("merge")
    return out


# -- peaks measured in the same run -----------------------------------------------------

def measure_peaks(device: str, timer: Timer) -> tuple[float, float]:
    """(copy GB/s counting read + written bytes, bf16 GEMM TFLOP/s)."""
    nbytes = (256 if device == "cuda" else 64) << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9
    del src, dst
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    gemm_tflops = 2 * n ** 3 / timer(lambda: a @ b) / 1e12
    return copy_gbs, gemm_tflops


# -- one case -----------------------------------------------------------------------------

def weight_format(device: str, w: torch.Tensor):
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    if cap is not None and cap < (8, 9):
        return W.MarlinFp8Weight.from_dense(w, torch.bfloat16)  # the only fp8 route on sm_8x
    return W.Fp8BlockWeight.from_dense(w, torch.bfloat16)


def model_config() -> MLAModelConfig:
    base = get_model_config("deepseek-v3")
    return MLAModelConfig("deepseek-v3-tp8", L=base.L, R=base.R, P=base.P, V=base.V, num_heads=HEADS,
                          num_layers=2, max_model_len=base.max_model_len)


def best_steps(fn, device: str, reps: int) -> dict[str, float]:
    best = None
    for _ in range(reps):
        clock = StepClock(device)
        fn(clock)
        t = clock.totals()
        if best is None or t["total"] < best["total"]:
            best = t
    return best


def bench_case(ctx: int, q_len: int, fmt: str, device: str, timer: Timer, peaks, reps: int,
               log: RowLog) -> list[dict]:
    """The three rows of one case (mla_ext, torch composed, roofline floor), added to
    `log`; [] when the two outputs differ (then a mismatch row is added instead)."""
    m = model_config()
    # Layer 0 is skipped (native bf16 cache) when the case asks for "auto".
    cfg = CacheConfig("fp8_ds_mla", (0,) if fmt == "auto" else (), BLOCK)
    w = torch.randn(m.num_heads * (m.P + m.V), m.L, generator=torch.Generator().manual_seed(ctx)) / math.sqrt(m.L)
    layer = MLAPrefill(m, cfg, weight_format(device, w).to(device), layer=0 if fmt == "auto" else 1,
                       max_num_seqs=1)
    batch = SyntheticBatch(m, [ctx], [q_len], BLOCK, device, seed=ctx)
    meta = batch.metadata()
    kv_c, k_pe = batch.layer_context(layer.layer_index)
    cache = batch.fill_cache(layer, kv_c, k_pe)
    del kv_c, k_pe
    w_bf16 = layer.kv_b_proj.weight_format.dequantize(torch.bfloat16).to(device)  # a user caches this
    gfmt = "bfloat16" if fmt == "auto" else fmt
    args = (batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    score_bytes = (2 << 30) if device == "cuda" else (256 << 20)

    out = layer(*args)
    ref = torch_composed(layer, w_bf16, batch, cache, meta, gfmt, max_score_bytes=score_bytes)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    if not math.isfinite(err) or err > 2e-2:
        log.fail(dict(kv_cache_dtype=fmt, context=ctx, new_tokens=q_len, impl="mla_ext", rel_err_vs_torch=err),
                 f"mla_ext and the torch baseline differ (rel err {err:.3g} > 2e-2)", "mismatch")
        return []

    ours_s = timer(lambda: layer(*args))
    base_s = timer(lambda: torch_composed(layer, w_bf16, batch, cache, meta, gfmt, max_score_bytes=score_bytes))
    ours_steps = best_steps(lambda clk: layer(*args, clock=clk), device, reps)
    base_steps = best_steps(lambda clk: torch_composed(layer, w_bf16, batch, cache, meta, gfmt, clk, score_bytes),
                            device, reps)
    copy_gbs, gemm_tflops = peaks
    work = step_work(layer, meta)
    floor = {s: work[s].amount / (copy_gbs * 1e9 if work[s].unit == "bytes" else gemm_tflops * 1e12)
             for s in FLOOR_STEPS}
    floor_s = sum(floor.values())
    common = dict(context=ctx, new_tokens=q_len, kv_cache_dtype=fmt, heads=m.num_heads,
                  kv_b_proj=layer.kv_b_proj.weight_format.name, copy_gbs=copy_gbs, gemm_tflops=gemm_tflops,
                  rel_err_vs_torch=err)

    def row(impl, total, steps):
        return dict(common, impl=impl, ms=total * 1e3, **{f"{s}_ms": steps.get(s, 0.0) * 1e3 for s in STEPS},
                    speedup_vs_torch=base_s / total, x_roofline=total / floor_s)

    return [log.add(row("mla_ext", ours_s, ours_steps)), log.add(row("torch composed", base_s, base_steps)),
            log.add(row("roofline floor", floor_s, floor))]


# -- output -------------------------------------------------------------------------------

def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["kv_cache_dtype"], r["context"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 2.4 * len(cases)), 4.8))
    colors = dict(zip(STEPS, ("tab:blue", "tab:orange", "tab:gray", "tab:green", "tab:red")))
    w = 0.8 / len(impls)
    for ci, case in enumerate(cases):
        for ii, impl in enumerate(impls):
            r = next(x for x in rows if (x["kv_cache_dtype"], x["context"]) == case and x["impl"] == impl)
            base = r["ms"]  # normalise each case to mla_ext's total, so sizes share one axis
            ref = next(x["ms"] for x in rows if (x["kv_cache_dtype"], x["context"]) == case and x["impl"] == "mla_ext")
            # Stack height = the impl's total; the steps (timed in separate runs) split it.
            parts = sum(r[f"{s}_ms"] for s in STEPS) or 1.0
            bottom = 0.0
            for s in STEPS:
                h = r[f"{s}_ms"] / parts * base / ref
                ax.bar(ci + ii * w, h, w, bottom=bottom, color=colors[s],
                       label=s if (ci, ii) == (0, 0) else None, edgecolor="black", linewidth=0.3)
                bottom += h
            ax.text(ci + ii * w, bottom, f"{impl.split()[0]}\n{base:.3g} ms", ha="center", va="bottom", fontsize=6)
    ax.set_xticks([c + 0.4 - w / 2 for c in range(len(cases))],
                  [f"{f}\nctx {c // 1024}K" for f, c in cases], fontsize=8)
    ax.set_ylabel("time / mla_ext total (steps stacked)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


FIELDS = ["kv_cache_dtype", "context", "new_tokens", "heads", "kv_b_proj", "impl", "ms"] + \
    [f"{s}_ms" for s in STEPS] + ["speedup_vs_torch", "x_roofline", "copy_gbs", "gemm_tflops", "rel_err_vs_torch"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--context", type=int, nargs="+", help="context tokens (overrides the default list)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 2048 GPU, 128 CPU)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (default 1, as bench_cache: on a shared machine a descheduled "
                         "worker thread stalls every parallel op)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    if args.context:
        contexts = args.context
    else:
        contexts = [8192, 32768, 131072] if device == "cuda" else ([1024, 4096] if args.quick else [1024, 4096, 16384])
    q_len = args.new_tokens or (2048 if device == "cuda" else 128)
    formats = ["fp8_ds_mla"] if args.quick else ["fp8_ds_mla", "auto"]
    reps = 3 if args.quick else (10 if device == "cuda" else 5)
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    stem = os.path.join(args.out, f"prefill_{device}")
    log = RowLog(stem + ".csv", FIELDS, dict(device=name, quick=args.quick))
    interrupted = False
    try:
        timer = Timer(device, reps)
        try:
            peaks = measure_peaks(device, timer)
        except Exception as exc:  # noqa: BLE001 - no roofline, but the comparison with torch still stands
            log.fail(dict(impl="peaks"), exc)
            peaks = (float("nan"), float("nan"))
        print(f"peaks measured here: copy {peaks[0]:.1f} GB/s, bf16 GEMM {peaks[1]:.2f} TFLOP/s", flush=True)

        from mla_ext.attention.api import ATTENTION

        for fmt in formats:
            for ctx in contexts:
                try:
                    # The CPU runs attention through the torch backend (the Triton
                    # interpreter measures Python, not a kernel).
                    with (ATTENTION.force("torch") if device == "cpu" else contextlib.nullcontext()):
                        case = bench_case(ctx, q_len, fmt, device, timer, peaks, reps, log)
                except Exception as exc:  # noqa: BLE001 - the next case may still run
                    log.fail(dict(kv_cache_dtype=fmt, context=ctx, new_tokens=q_len, impl="mla_ext"), exc)
                    continue
                if case:
                    ours, base, floor = case
                    print(f"  {fmt:<11} ctx {ctx:>7} new {q_len}: mla_ext {ours['ms']:9.3f} ms, torch "
                          f"{base['ms']:9.3f} ms ({ours['speedup_vs_torch']:.2f}x), roofline {floor['ms']:8.3f} ms "
                          f"({ours['x_roofline']:.2f}x of it)", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the cases measured so far", flush=True)

    rows = log.ok()
    print(f"\n{'cache':<11}{'context':>8}  {'impl':<15}{'ms':>10}" + "".join(f"{s:>11}" for s in STEPS)
          + f"{'vs torch':>10}{'x floor':>9}")
    for r in rows:
        print(f"{r['kv_cache_dtype']:<11}{r['context']:>8}  {r['impl']:<15}{r['ms']:>10.3f}"
              + "".join(f"{r[s + '_ms']:>11.3f}" for s in STEPS)
              + f"{r['speedup_vs_torch']:>9.2f}x{r['x_roofline']:>8.2f}x")
    print(f"\ntargets ({'GPU' if device == 'cuda' else 'stated for the GPU; this is a CPU run'}): "
          f">= {TARGET_SPEEDUP}x the torch baseline, <= {TARGET_ROOFLINE}x the roofline sum")
    for r in rows:
        if r["impl"] == "mla_ext":
            ok = r["speedup_vs_torch"] >= TARGET_SPEEDUP and r["x_roofline"] <= TARGET_ROOFLINE
            print(f"  {r['kv_cache_dtype']:<11} ctx {r['context']:>7}: {r['speedup_vs_torch']:.2f}x torch, "
                  f"{r['x_roofline']:.2f}x roofline -> {'met' if ok else 'NOT met'}")
    title = f"one MLA layer, DeepSeek-V3 TP8 ({HEADS} heads), {q_len} new tokens\n{name}"
    return finish(log, interrupted, lambda ok: plot(ok, stem + ".png", title))


if __name__ == "__main__":
    sys.exit(main())
