"""Benchmark of the context gather (gather_and_maybe_dequant_cache), SPEC §6.

  .venv/bin/python benchmarks/bench_cache.py [--quick] [--out DIR] [--tokens N ...]

The gather is memory-bound, so it is reported as achieved bandwidth against a
roofline measured in the same run (gpt-fast / Triton-tutorial style):
  bytes moved = cache rows read (1152 B bf16, 576 B fp8, 656 B fp8_ds_mla,
  352 B nvfp4_ds_mla per token) + bf16 rows written (1152 B per token);
  "fp8_raw" is cp_gather_cache of fp8 rows (576 B read + 576 B written, no
  dequant: the FP8-prefill / context-parallel passthrough);
  copy   = `dst.copy_(src)` of a contiguous buffer moving the same number of bytes
           (half read, half written): the practical ceiling;
  torch  = what a user writes without this library: `index_select` of each
           request's pages, slice the tokens, dequantize in torch;
  then every usable backend of the op: on a GPU "cuda_paged" and
  "triton_paged", on the CPU the C++ kernel (Triton only on a GPU: the
  interpreter measures Python, not a kernel).
Columns: GB/s, % of copy bandwidth and speed-up vs the torch baseline. Each
backend's output is checked against the torch baseline before it is timed.
MLA_EXT_PAGED_GATHER_ROUNDS=1..8 (read once per process) changes the rows per
CTA of "cuda_paged" (default 2 batches of 4 16-byte units per thread).

On a GPU: 8K, 64K and 300K context tokens, block sizes 16 and 64, timed with
CUDA events and an L2 flush before every repetition (cold cache, as in a real
prefill). On the CPU: 8K and 64K (8K with --quick). Results go to
DIR/gather_<device>.csv and DIR/gather_<device>.png (default benchmarks/results/);
the CSV gets each row as it is measured, and a backend that fails or differs from
the baseline is a row with its status and error (the run goes on; exit status 1).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_common import RowLog, finish  # noqa: E402

from mla_ext.cache import api  # noqa: E402
from mla_ext.dispatch import is_triton_backend  # noqa: E402
from mla_ext.config.formats import DsMla, Nvfp4DsMla, get_format  # noqa: E402

L, R = 512, 64
E = L + R
FORMATS = ("bfloat16", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla", "fp8_raw")
RAW = "fp8_raw"  # cp_gather_cache of fp8 rows (bytes unchanged)
NUM_REQS = 4  # the chunk is split over a few requests with unaligned starts
K_SCALE = 0.0173


# -- inputs -------------------------------------------------------------------

def _fp8_bytes(n_rows: int, n_cols: int, dtype, gen) -> torch.Tensor:
    """Realistic (finite, normal-range) fp8 bytes, made without a Python loop."""
    return (torch.randn(n_rows, n_cols, generator=gen) * 4).to(dtype).view(torch.uint8)


def make_cache(fmt: str, num_blocks: int, B: int, gen) -> torch.Tensor:
    n = num_blocks * B
    if fmt == "bfloat16":
        rows = torch.randn(n, E, generator=gen).to(torch.bfloat16)
    elif fmt == "fp8_ds_mla":
        rows = torch.empty(n, DsMla.ENTRY_BYTES, dtype=torch.uint8)
        rows[:, :L] = _fp8_bytes(n, L, torch.float8_e4m3fn, gen)
        scales = torch.exp2(torch.randint(-8, 2, (n, DsMla.NUM_TILES), generator=gen).float())
        rows[:, DsMla.SCALE_OFFSET:DsMla.ROPE_OFFSET] = scales.view(torch.uint8)
        rows[:, DsMla.ROPE_OFFSET:] = torch.randn(n, R, generator=gen).to(torch.bfloat16).view(torch.uint8)
    elif fmt == "nvfp4_ds_mla":
        rows = torch.empty(n, Nvfp4DsMla.ENTRY_BYTES, dtype=torch.uint8)
        rows[:, :Nvfp4DsMla.ROPE_OFFSET] = torch.randint(0, 256, (n, Nvfp4DsMla.ROPE_OFFSET), generator=gen,
                                                         dtype=torch.uint8)
        rows[:, Nvfp4DsMla.ROPE_OFFSET:Nvfp4DsMla.SCALE_OFFSET] = _fp8_bytes(n, R, torch.float8_e4m3fn, gen)
        rows[:, Nvfp4DsMla.SCALE_OFFSET:] = (torch.rand(n, Nvfp4DsMla.NUM_BLOCKS, generator=gen) * 4 + 0.01).to(
            torch.float8_e4m3fn).view(torch.uint8)
    else:
        rows = _fp8_bytes(n, E, get_format("fp8" if fmt == RAW else fmt).fp8_dtype, gen)
    return rows.view(num_blocks, B, -1)


def make_batch(tokens: int, B: int, gen):
    """NUM_REQS requests sharing `tokens`, unaligned starts, shuffled pages."""
    lens = [tokens // NUM_REQS] * NUM_REQS
    lens[-1] += tokens - sum(lens)
    starts = [(7 * r + 3) % B for r in range(NUM_REQS)]
    need = [-(-(s + n) // B) for s, n in zip(starts, lens)]
    width = max(need)
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((NUM_REQS, width), -1, dtype=torch.int32)
    used = 0
    for r, k in enumerate(need):
        table[r, :k] = perm[used:used + k]
        used += k
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return num_blocks, table, cu, torch.tensor(starts, dtype=torch.int32), lens, starts


_NVFP4_TABLES: dict = {}


def _nvfp4_tables(device):
    """e2m1 magnitudes and the block-scale byte positions, made once per device."""
    if device not in _NVFP4_TABLES:
        _NVFP4_TABLES[device] = (
            torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=device),
            torch.tensor([Nvfp4DsMla.scale_byte(b) for b in range(Nvfp4DsMla.NUM_BLOCKS)], device=device),
        )
    return _NVFP4_TABLES[device]


def torch_baseline(cache, table, lens, starts, fmt, k_scale, dst):
    """The gather a user writes in torch: pages by index_select, then dequant."""
    B = cache.shape[1]
    row = 0
    for r, (n, s) in enumerate(zip(lens, starts)):
        k = -(-(s + n) // B)
        rows = cache.index_select(0, table[r, :k].long()).flatten(0, 1)[s:s + n]
        if fmt in ("bfloat16", RAW):
            out = rows
        elif fmt == "nvfp4_ds_mla":
            codes = rows[:, :Nvfp4DsMla.ROPE_OFFSET]
            nib = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(n, L).long()
            values, pos = _nvfp4_tables(rows.device)
            mag = values[nib & 7]
            e2m1 = torch.where(nib >= 8, -mag, mag).view(n, Nvfp4DsMla.NUM_BLOCKS, -1)
            sc = rows[:, Nvfp4DsMla.SCALE_OFFSET:][:, pos].contiguous().view(torch.float8_e4m3fn).float()
            kv = (e2m1 * sc[:, :, None]).view(n, L)
            pe = rows[:, Nvfp4DsMla.ROPE_OFFSET:Nvfp4DsMla.SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn)
            out = torch.cat([kv, pe.float()], 1).to(torch.bfloat16)
        elif fmt == "fp8_ds_mla":
            vals = rows[:, :L].view(torch.float8_e4m3fn).float().view(n, DsMla.NUM_TILES, -1)
            sc = rows[:, DsMla.SCALE_OFFSET:DsMla.ROPE_OFFSET].contiguous().view(torch.float32)
            kv = (vals * sc[:, :, None]).view(n, L).to(torch.bfloat16)
            out = torch.cat([kv, rows[:, DsMla.ROPE_OFFSET:].contiguous().view(torch.bfloat16)], 1)
        else:
            out = (rows.view(get_format(fmt).fp8_dtype).float() * k_scale).to(torch.bfloat16)
        dst[row:row + n].copy_(out)
        row += n


# -- timing -------------------------------------------------------------------

class Timer:
    """Seconds per call, cold cache: the last-level cache is flushed before every call.

    CUDA: median of CUDA-event timings. CPU: the minimum wall time, because the
    CPU machines are shared and the minimum is the least-disturbed run.
    """

    def __init__(self, device: str, reps: int):
        self.device, self.reps = device, reps
        # Twice the last-level cache (H200 L2: 60 MB; the build machines' L3: 32 MB).
        size = (256 if device == "cuda" else 64) << 20
        self.flush = torch.empty(size, dtype=torch.uint8, device=device)

    def __call__(self, fn) -> float:
        fn()  # warm-up (and Triton compile)
        times = []
        # On the CPU short calls repeat until 0.25 s were measured (at most 8x reps), so
        # that at least one run likely escapes the other processes' time slices.
        while len(times) < self.reps or (
                self.device != "cuda" and sum(times) < 0.25 and len(times) < 8 * self.reps):
            self.flush.fill_(1)
            if self.device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times) if self.device == "cuda" else min(times)


def usable_backends(inputs, device: str) -> list[str]:
    """Usable gather backends, in the dispatcher's order."""
    return [b.name for b in api.GATHER.backends
            if not (device != "cuda" and is_triton_backend(b.name))  # the interpreter is not a benchmark
            and not b.not_supported_reasons(inputs)]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    # Both sides round an fp32 product to bf16; allow one ulp for a different rounding order.
    return torch.allclose(got.float(), want.float(), rtol=2.0**-7, atol=0, equal_nan=True)


# -- one configuration ----------------------------------------------------------

def bench_one(fmt: str, tokens: int, B: int, device: str, timer: Timer, gen, log: RowLog) -> None:
    """Rows for one (format, tokens, block size), appended to `log` as measured; a
    backend that fails or differs from the torch baseline is a row with its error."""
    common = dict(format=fmt, tokens=tokens, block_size=B)
    try:
        num_blocks, table, cu, starts_t, lens, starts = make_batch(tokens, B, gen)
        cache = make_cache(fmt, num_blocks, B, gen).to(device)
        table, cu, starts_t = table.to(device), cu.to(device), starts_t.to(device)
        k_scale = torch.tensor([K_SCALE], device=device)
        entry_bytes = cache.shape[2] * cache.element_size()
        if fmt == RAW:
            moved = tokens * 2 * entry_bytes  # rows read + the same bytes written
            dst = torch.empty(tokens, cache.shape[2], dtype=cache.dtype, device=device)
        else:
            moved = tokens * (entry_bytes + E * 2)  # rows read + bf16 rows written
            dst = torch.empty(tokens, E, dtype=torch.bfloat16, device=device)
        common["bytes_moved"] = moved

        half = moved // 2
        src_c, dst_c = torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device)
        src_c.fill_(3)
        copy_s = timer(lambda: dst_c.copy_(src_c))
        del src_c, dst_c
        copy_gbs = moved / copy_s / 1e9

        want = torch.empty_like(dst)
        torch_s = timer(lambda: torch_baseline(cache, table, lens, starts, fmt, K_SCALE, want))
    except Exception as exc:  # noqa: BLE001 - no baseline: one error row for the configuration
        log.fail(dict(common, backend="setup"), exc)
        return
    log.add(dict(common, backend="copy (roofline)", ms=copy_s * 1e3, gbs=copy_gbs, pct_copy=100.0,
                 speedup_vs_torch=torch_s / copy_s))
    log.add(dict(common, backend="torch index_select+dequant", ms=torch_s * 1e3, gbs=moved / torch_s / 1e9,
                 pct_copy=100 * copy_s / torch_s, speedup_vs_torch=1.0))
    raw = fmt == RAW
    inputs = api.GatherInputs(cache, dst, table, cu, NUM_REQS, None if raw else fmt, k_scale, starts_t)
    for name in usable_backends(inputs, device):
        row = dict(common, backend=name)
        try:
            with api.GATHER.force(name):
                def run():
                    if raw:
                        api.cp_gather_cache(cache, dst, table, cu, NUM_REQS, starts_t)
                    else:
                        api.gather_and_maybe_dequant_cache(cache, dst, table, cu, NUM_REQS, fmt, k_scale, starts_t)
                if dst.dtype.is_floating_point:
                    dst.fill_(float("nan"))
                else:
                    dst.fill_(0xFF)
                run()
                if not _close(dst, want):
                    bad = int((dst != want).sum()) if raw else int(
                        (~torch.isclose(dst.float(), want.float(), rtol=2.0**-7, atol=0, equal_nan=True)).sum())
                    log.fail(row, f"{name} gather differs from the torch baseline in {bad} of {dst.numel()} values",
                             "mismatch")
                    continue
                s = timer(run)
        except Exception as exc:  # noqa: BLE001
            log.fail(row, exc)
            continue
        log.add(dict(row, ms=s * 1e3, gbs=moved / s / 1e9, pct_copy=100 * copy_s / s, speedup_vs_torch=torch_s / s))


# -- output ---------------------------------------------------------------------

def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = sorted({r["block_size"] for r in rows})
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(1, len(blocks), figsize=(7 * len(blocks), 4.8), squeeze=False)
    for ax, B in zip(axes[0], blocks):
        groups = list(dict.fromkeys((r["format"], r["tokens"]) for r in rows if r["block_size"] == B))
        w = 0.8 / len(backends)
        for i, be in enumerate(backends):
            vals = [next((r["gbs"] for r in rows if r["block_size"] == B and r["backend"] == be
                          and (r["format"], r["tokens"]) == g), 0.0) for g in groups]
            ax.bar([x + i * w for x in range(len(groups))], vals, w, label=be,
                   color="lightgray" if be.startswith("copy") else None)
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(groups))],
                      [f"{f}\n{t // 1024}K" for f, t in groups], fontsize=7)
        ax.set_ylabel("GB/s (bytes read + written)")
        ax.set_title(f"{title}, block size {B}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--tokens", type=int, nargs="+", help="context tokens (overrides the default list)")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--reps", type=int, help="repetitions per timing (default 3 with --quick, else 20 GPU / 7 CPU)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (default 1: on a shared machine a descheduled worker thread "
                         "stalls every parallel op at its barrier)")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(args.threads)
    try:
        return run(args, device)
    finally:
        torch.set_num_threads(threads)


FIELDS = ["format", "tokens", "block_size", "backend", "ms", "gbs", "pct_copy", "speedup_vs_torch", "bytes_moved"]


def run(args, device: str) -> int:
    if args.tokens:
        sizes = args.tokens
    elif device == "cuda":
        sizes = [8192, 65536] if args.quick else [8192, 65536, 300_000]
    else:
        sizes = [8192] if args.quick else [8192, 65536]
    reps = args.reps or (3 if args.quick else (20 if device == "cuda" else 7))
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    stem = os.path.join(args.out, f"gather_{device}")
    log = RowLog(stem + ".csv", FIELDS, dict(device=name, quick=args.quick, reps=reps))
    interrupted = False
    try:
        timer = Timer(device, reps)
        gen = torch.Generator().manual_seed(0)
        for B in (16, 64):
            for fmt in args.formats:
                for t in sizes:
                    bench_one(fmt, t, B, device, timer, gen, log)
                    r = log.rows[-1]
                    print(f"  {fmt:<13} T={t:<7} B={B:<3} {r['backend']:<28} "
                          f"{r.get('gbs', float('nan')):8.2f} GB/s  {r['status']}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: reporting the rows measured so far", flush=True)
    except Exception as exc:  # noqa: BLE001
        log.fail(dict(backend="run"), exc)

    ok = log.ok()
    print(f"\n{'format':<13}{'tokens':>8}{'B':>4}  {'backend':<28}{'ms':>9}{'GB/s':>9}{'% copy':>8}{'vs torch':>9}")
    for r in ok:
        print(f"{r['format']:<13}{r['tokens']:>8}{r['block_size']:>4}  {r['backend']:<28}{r['ms']:>9.3f}"
              f"{r['gbs']:>9.2f}{r['pct_copy']:>7.0f}%{r['speedup_vs_torch']:>8.2f}x")
    return finish(log, interrupted, lambda rows: plot(rows, stem + ".png", f"gather on {name}"))


if __name__ == "__main__":
    sys.exit(main())
