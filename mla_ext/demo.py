"""The worked example: `python -m mla_ext demo` (`make demo`).

1. The KV-cache plan of DeepSeek-V3 with fp8_ds_mla layers and the first two
   and the last layer kept in bf16 (the skip-layer setup that upstream engines
   refuse because 656- and 1152-byte pages do not divide), in 60 GiB.
2. A DeepSeek-V3-shaped prefill with context through a stack of MLA layers
   with a realistic mixed configuration: the first and the last layer skipped
   (native bf16 cache), fp8_ds_mla elsewhere; block-FP8 kv_b_proj weights (on a
   GPU below sm_89 the Marlin FP8 path, the only fp8 route there; on the CPU
   one Marlin and one NVFP4 layer besides, to show the mix). Every layer
   prints its resolved plan, is checked against the one-shot dense oracle fed
   with what its cache holds, and reports the time of each step with the
   achieved GB/s or TFLOP/s.
3. One real-model step: a tiny random transformers DeepSeek-V3 attention layer
   (q LoRA, DeepSeek-V3's yarn rope scaling, L=512, R=64) served by mla_ext
   (mla_ext.integrations.transformers_deepseek: dims, softmax scale and dtype from
   the layer's config; fp8_ds_mla cache; Marlin FP8 kv_b_proj) beside transformers'
   own forward of the same layer, in bf16 and in float64; the relative errors are
   printed. Skipped, saying why, when transformers cannot be imported.

Sizes: --full (the default when CUDA is available) is DeepSeek-V3 at TP8
(16 heads), 6 layers, contexts of 32K/16K/8K/8K and 2K new tokens; the
oracle then checks the first --check-queries new tokens of every request
(exact: new tokens see only earlier ones). --reduced (the CPU default) keeps
L=512, R=64, P=128, V=128 with 4 heads, 5 layers and contexts of a few
hundred tokens, chunked through a small workspace; --tiny is smaller still
(for tests). Exit code 1 if any layer fails its check.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass

import torch

from mla_ext._args import int_flag, one_line_parser
from mla_ext.config.models import MLAModelConfig, get_model_config
from mla_ext.config.planner import render_plan
from mla_ext.config.policy import CacheConfig
from mla_ext.kv_b_proj import weights as W
from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.prefill.timing import StepClock, step_work
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.synthetic import SyntheticBatch
from mla_ext.attention.api import ATTENTION

MODEL = "deepseek-v3"
KV_CACHE_DTYPE = "fp8_ds_mla"
SKIP_LAYERS = (0, 1, 60)
BLOCK_SIZE = 64
MEMORY_BYTES = 60 * 2**30
SEED_MAX = 2**32 - 1  # seed * 1000 + small offsets stays inside manual_seed's uint64
TOLERANCE = 1e-2  # SPEC §9, bf16 paths: relative Frobenius error
# The real-model step compares end to end from hidden states, so the module's own bf16
# projections add to the error: mla_ext must be within REAL_TOLERANCE of transformers'
# bf16 forward, and as close to the float64 forward as transformers' bf16 path is
# (at most 1.5x its error + 1e-3).
REAL_TOLERANCE = 2e-2
# DeepSeek-V3's rope_scaling, as transformers 5 spells it.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32, "beta_slow": 1}
STEP_ORDER = ("gather", "kv_b_proj", "keys", "attention", "merge")


@dataclass(frozen=True)
class Size:
    name: str
    heads: int
    layers: int
    ctx_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    workspace_rows: int | None  # None: the SPEC §8 default
    max_model_len: int
    reps: int  # timed runs per layer (the fastest is reported: shared machines are noisy)


SIZES = {
    "full": Size("full", 16, 6, (32768, 16384, 8192, 8192), (512, 512, 512, 512), None, 163840, 3),
    # A request without context and a workspace smaller than the context, so
    # the context is split over chunks as in a long prefill.
    "reduced": Size("reduced", 4, 5, (640, 300, 0, 97), (32, 16, 8, 8), 512, 4096, 3),
    "tiny": Size("tiny", 2, 4, (100, 0, 37), (6, 3, 4), 64, 1024, 2),
}


def weight_kinds(num_layers: int, device: torch.device) -> list[str]:
    """kv_b_proj format per layer: DeepSeek's block FP8; Marlin FP8 on GPUs
    without fp8 tensor cores (sm_8x below sm_89); on the CPU one Marlin and one
    NVFP4 layer among block-FP8 ones."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return ["fp8_block" if cap >= (8, 9) else "marlin_fp8"] * num_layers
    kinds = ["fp8_block"] * num_layers
    for i, kind in ((1, "marlin_fp8"), (2, "nvfp4")):
        if i < num_layers - 1:
            kinds[i] = kind
    return kinds


def make_weight(kind: str, w: torch.Tensor, dtype: torch.dtype):
    cls = {"dense": W.DenseWeight, "fp8_block": W.Fp8BlockWeight, "marlin_fp8": W.MarlinFp8Weight,
           "nvfp4": W.Nvfp4Weight}[kind]
    return cls.from_dense(w, dtype)


class Progress:
    """A text progress bar on stderr (only when enabled)."""

    def __init__(self, total: int, enabled: bool, width: int = 30):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            n = self.width * self.done // self.total
            sys.stderr.write(f"\r[{'#' * n}{'.' * (self.width - n)}] {self.done}/{self.total} {label:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def check_layer(batch, layer, cache, out, check_queries: int | None) -> dict:
    """Compares `out` with the one-shot dense oracle fed with what the cache holds.

    With check_queries, only the first check_queries new tokens of each request
    are compared: a new token sees only earlier ones, so their reference is
    exact without the rest."""
    reqs = [r for r, q in enumerate(batch.q_lens) if q]
    take = [min(batch.q_lens[r], check_queries or batch.q_lens[r]) for r in reqs]
    offs = [0]
    for q in batch.q_lens:
        offs.append(offs[-1] + q)
    rows = torch.cat([torch.arange(offs[r], offs[r] + k) for r, k in zip(reqs, take)])
    kv_c, k_pe = batch.cached_rows(layer, cache, None, reqs)
    dev_rows = rows.to(batch.q.device)
    ref = mla_prefill_reference(
        batch.q[dev_rows].cpu(), batch.kv_c_new[dev_rows].cpu(), batch.k_pe_new[dev_rows].cpu(),
        kv_c, k_pe, take, layer.kv_b_proj.weight_format.dequantize_fp32().cpu(),
        layer.model.P, layer.model.V, layer.softmax_scale,
    )
    got = out[dev_rows].cpu().double()
    nan = bool(torch.isnan(got).any())
    err = float((got - ref.double()).norm() / ref.double().norm())
    ok = not nan and err <= TOLERANCE
    scope = (f"all {len(rows)} new tokens" if sum(take) == batch.num_tokens
             else f"first {check_queries} new tokens of each request ({len(rows)} of {batch.num_tokens})")
    return {"rel_err": err, "nan": nan, "ok": ok, "checked": scope}


def run_layer(batch, layer, meta, reps: int, check_queries, progress: Progress) -> dict:
    i = layer.layer_index
    kv_c, k_pe = batch.layer_context(i)
    cache = batch.fill_cache(layer, kv_c, k_pe)
    del kv_c, k_pe
    progress.step(f"layer {i}: cache filled")
    args = (batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta)
    layer(*args)  # warm-up: compiles kernels, dequantizes the weight once
    progress.step(f"layer {i}: warm-up")
    best, out = None, None
    for _ in range(reps):
        clock = StepClock(batch.device)
        out = layer(*args, clock=clock)
        t = clock.totals()
        if best is None or t["total"] < best["total"]:
            best = t
    progress.step(f"layer {i}: timed")
    check = check_layer(batch, layer, cache, out, check_queries)
    progress.step(f"layer {i}: checked")
    work = step_work(layer, meta)
    steps = {}
    for name in STEP_ORDER:
        s = best.get(name, 0.0)
        rate, unit = work[name].rate(s) if s > 0 else (0.0, "")
        steps[name] = {"seconds": s, "rate": rate, "unit": unit}
    plan = meta.plan(layer.workspace_rows, layer.chunk_alignment)
    device = batch.device
    return {
        "layer": i,
        "kv_cache_dtype": layer.kv_cache_dtype,
        "skipped": layer.spec.skipped,
        "page_bytes": layer.spec.page_bytes(),
        "kv_b_proj": layer.kv_b_proj.weight_format.describe(),
        "kv_b_proj_backend": layer.kv_b_proj.backend_for(layer.workspace_rows, device, layer.activation_dtype),
        "activation_dtype": str(layer.activation_dtype).removeprefix("torch."),
        "workspace_rows": layer.workspace_rows,
        "chunks": plan.num_chunks,
        "total_seconds": best["total"],
        "steps": steps,
        **check,
        "explain": layer.explain(device),
    }


def format_layer(r: dict) -> str:
    steps = " | ".join(
        f"{name} {_fmt_s(s['seconds'])}" + (f" ({s['rate']:.3g} {s['unit']})" if s["unit"] else "")
        for name, s in r["steps"].items())
    verdict = "ok" if r["ok"] else "FAILED"
    return "\n".join([
        r["explain"],
        f"  context chunks: {r['chunks']} (workspace {r['workspace_rows']} rows)",
        f"  time: total {_fmt_s(r['total_seconds'])} | {steps}",
        f"  check vs one-shot dense reference ({r['checked']}): rel err {r['rel_err']:.2e} "
        f"(tolerance {TOLERANCE:.0e}){' NaN!' if r['nan'] else ''} {verdict}",
    ])


def format_summary(results: list[dict]) -> str:
    head = (f"{'layer':>5}  {'cache':<11}{'page B':>8}  {'kv_b_proj -> backend':<34}{'act':<10}{'ms':>9}"
            f"{'rel err':>10}  check")
    lines = [head]
    for r in results:
        fmt = r["kv_b_proj"].split(" ")[0]
        lines.append(f"{r['layer']:>5}  {r['kv_cache_dtype']:<11}{r['page_bytes']:>8}  "
                     f"{fmt + ' -> ' + r['kv_b_proj_backend']:<34}{r['activation_dtype']:<10}"
                     f"{r['total_seconds'] * 1e3:>9.2f}{r['rel_err']:>10.2e}  {'ok' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


def build_model(size: Size) -> MLAModelConfig:
    base = get_model_config(MODEL)
    return MLAModelConfig(
        f"{MODEL} ({size.name}: {size.heads} heads, {size.layers} layers)", L=base.L, R=base.R,
        P=base.P, V=base.V, num_heads=size.heads, num_layers=size.layers,
        model_dtype=torch.bfloat16, max_model_len=size.max_model_len,
    )


def run_prefill(size: Size, device: torch.device, seed: int, check_queries, progress_on) -> dict:
    model = build_model(size)
    cfg = CacheConfig(KV_CACHE_DTYPE, (0, size.layers - 1), BLOCK_SIZE)
    batch = SyntheticBatch(model, size.ctx_lens, size.q_lens, BLOCK_SIZE, device, seed)
    meta = batch.metadata()
    kinds = weight_kinds(size.layers, device)
    gen = torch.Generator().manual_seed(seed + 1)
    progress = Progress(4 * size.layers, progress_on)
    results = []
    for i, kind in enumerate(kinds):
        w = torch.randn(model.num_heads * (model.P + model.V), model.L, generator=gen) / math.sqrt(model.L)
        weight = make_weight(kind, w, model.model_dtype).to(device)
        layer = MLAPrefill(model, cfg, weight, layer=i, workspace_rows_override=size.workspace_rows,
                           max_num_seqs=max(len(size.ctx_lens), 1))
        results.append(run_layer(batch, layer, meta, size.reps, check_queries, progress))
    progress.close()
    return {
        "model": model.name, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": size.name, "ctx_lens": list(size.ctx_lens), "q_lens": list(size.q_lens),
        "block_size": BLOCK_SIZE, "kv_cache_dtype": KV_CACHE_DTYPE, "skip_layers": [0, size.layers - 1],
        "layers": results, "ok": all(r["ok"] for r in results),
    }


def run_transformers_step(size: Size, device: torch.device, seed: int) -> dict:
    """A tiny random transformers DeepSeek-V3 layer: prefill with context through
    mla_ext beside transformers' own forward (see the module doc, step 3)."""
    try:
        import transformers

        from mla_ext.integrations import transformers_deepseek as tx
    except Exception as exc:  # not installed, or not importable with this torch
        return {"skipped": f"transformers cannot be imported ({type(exc).__name__}: {exc}); "
                           "pip install -r requirements.txt"}
    dtype, hidden = torch.bfloat16, 128
    ctx_lens, q_lens, rows = ((100, 0, 37), (6, 3, 4), 64) if size.name == "tiny" \
        else ((300, 0, 130), (8, 4, 6), 128)
    module = tx.random_attention("v3", dtype=dtype, seed=seed, hidden_size=hidden, num_heads=4,
                                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                 v_head_dim=64, q_lora_rank=96,
                                 rope_parameters=DEEPSEEK_V3_YARN).to(device)
    # Marlin FP8 is weight-only (bf16 activations on every device), so transformers,
    # given the dequantized weight, computes the same math.
    weight = make_weight("marlin_fp8", module.kv_b_proj.weight.detach().float().cpu(), dtype).to(device)
    with torch.no_grad():
        module.kv_b_proj.weight.copy_(weight.dequantize(dtype))
    layer = tx.TransformersMLA(module, CacheConfig(KV_CACHE_DTYPE, (), BLOCK_SIZE), kv_b_proj=weight,
                               workspace_rows_override=rows, max_num_seqs=len(ctx_lens))
    gen = torch.Generator().manual_seed(seed + 2)
    xs = [torch.randn(c + q, hidden, generator=gen).to(dtype).to(device)
          for c, q in zip(ctx_lens, q_lens)]
    run = tx.prefill_beside_transformers(layer, xs, ctx_lens, seed=seed)
    e = run.errors()
    ok = (not bool(torch.isnan(run.out).any()) and e["vs_transformers"] <= REAL_TOLERANCE
          and e["vs_fp64"] <= min(REAL_TOLERANCE, 1.5 * e["transformers_vs_fp64"] + 1e-3))
    m = layer.model
    return {
        "transformers": transformers.__version__, "module": type(module).__name__,
        "dims": {"heads": m.num_heads, "L": m.L, "R": m.R, "P": m.P, "V": m.V,
                 "q_lora_rank": module.q_lora_rank, "hidden": hidden},
        "dtype": str(m.model_dtype).removeprefix("torch."), "dtype_source": m.dtype_source,
        "softmax_scale": layer.prefill.softmax_scale, "softmax_scale_source": m.softmax_scale_source,
        "module_scaling": module.scaling, "base_scale": (m.P + m.R) ** -0.5,
        "kv_cache_dtype": layer.prefill.kv_cache_dtype, "kv_b_proj": weight.describe(),
        "ctx_lens": list(ctx_lens), "q_lens": list(q_lens),
        "chunks": run.metadata.plan(layer.prefill.workspace_rows, layer.prefill.chunk_alignment).num_chunks,
        **e, "ok": ok,
    }


def format_transformers_step(r: dict) -> str:
    if "skipped" in r:
        return f"Real model (transformers DeepSeek-V3 layer): skipped: {r['skipped']}"
    d = r["dims"]
    return "\n".join([
        f"Real model: transformers {r['transformers']} {r['module']}, a tiny random layer "
        f"({d['heads']} heads, L={d['L']} R={d['R']} P={d['P']} V={d['V']}, q LoRA {d['q_lora_rank']}, "
        f"DeepSeek-V3 yarn), {r['dtype']}",
        f"  softmax scale {r['softmax_scale']:.5f} from its config; transformers' module.scaling "
        f"{r['module_scaling']:.5f} (a bare (P+R)^-0.5 would be {r['base_scale']:.5f})",
        f"    {r['softmax_scale_source']}",
        f"  cache {r['kv_cache_dtype']}, kv_b_proj {r['kv_b_proj'].split(' params_dtype')[0]}; "
        f"context {r['ctx_lens']}, new {r['q_lens']} tokens, {r['chunks']} context chunks",
        f"  mla_ext vs transformers' own forward over the whole sequences: rel err "
        f"{r['vs_transformers']:.2e} (both bf16); vs float64 {r['vs_fp64']:.2e} (transformers' "
        f"own bf16 path: {r['transformers_vs_fp64']:.2e}): {'ok' if r['ok'] else 'FAILED'}",
    ])


@contextlib.contextmanager
def _cpu_attention(device: torch.device):
    """On the CPU, attention runs through the torch backend: under
    TRITON_INTERPRET=1 (set by the test suite) the dispatcher would pick the
    Triton interpreter, measured here ~20x slower at these sizes."""
    if device.type != "cpu":
        yield
        return

    with ATTENTION.force("torch"):
        yield


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _device(text: str) -> torch.device:
    """cpu or cuda[:i] with that GPU present; anything else is a usage error, not a traceback."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s)")
    return device


def run_demo(argv: list[str] | None = None) -> int:
    parser = one_line_parser(prog="python -m mla_ext demo", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the plan and the results as JSON")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--full", dest="size", action="store_const", const="full",
                       help="DeepSeek-V3 at TP8 sizes (default when CUDA is available)")
    sizes.add_argument("--reduced", dest="size", action="store_const", const="reduced",
                       help="few heads and layers, short contexts (default on the CPU)")
    sizes.add_argument("--tiny", dest="size", action="store_const", const="tiny", help="smallest (tests)")
    parser.add_argument("--device", type=_device, default=None,
                        help="cuda, cuda:N or cpu (default: cuda when available)")
    # Seeds feed torch.Generator.manual_seed (after seed * 1000 + offsets): bounded here,
    # so an out-of-range one is a usage error naming --seed before anything is printed.
    parser.add_argument("--seed", type=int_flag(0, SEED_MAX), default=0,
                        help=f"random seed, an integer in [0, {SEED_MAX}] (default 0)")
    parser.add_argument("--check-queries", type=_positive_int, default=None, metavar="K",
                        help="check only the first K new tokens of each request (default: all; "
                             "64 with --full)")
    parser.add_argument("--plan-only", action="store_true", help="print the cache plan and stop")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress bar on stderr (auto: with --full or on a terminal)")
    args = parser.parse_args(argv or [])

    cfg = CacheConfig(KV_CACHE_DTYPE, SKIP_LAYERS, BLOCK_SIZE)
    plan_text = render_plan(get_model_config(MODEL), cfg, MEMORY_BYTES, as_json=args.json)
    if not args.json:
        print(plan_text)
    if args.plan_only:
        if args.json:
            print(plan_text)
        return 0

    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES[args.size or ("full" if device.type == "cuda" else "reduced")]
    check_queries = args.check_queries if args.check_queries is not None else (64 if size.name == "full" else None)
    progress_on = args.progress == "on" or (args.progress == "auto" and (size.name == "full" or sys.stderr.isatty()))
    with _cpu_attention(device):
        result = run_prefill(size, device, args.seed, check_queries, progress_on)
        real = run_transformers_step(size, device, args.seed)
    ok = result["ok"] and real.get("ok", True)

    if args.json:
        print(json.dumps({**json.loads(plan_text), "prefill": result, "real_model": real}, indent=2))
    else:
        print()
        print(f"Prefill with context: {result['model']} on {result['device_name']}, "
              f"{len(size.ctx_lens)} requests, context {list(size.ctx_lens)} tokens, "
              f"new {list(size.q_lens)} tokens, block {BLOCK_SIZE}, kv_cache_dtype={KV_CACHE_DTYPE}, "
              f"skip layers {result['skip_layers']}")
        print()
        for r in result["layers"]:
            print(format_layer(r))
            print()
        print(format_summary(result["layers"]))
        print()
        print(format_transformers_step(real))
        bad = [r["layer"] for r in result["layers"] if not r["ok"]]
        print(f"\nall {len(result['layers'])} layers ok" if not bad else f"\nFAILED layers: {bad}")
        if "skipped" not in real:
            print("real-model step ok" if real["ok"] else "FAILED: the real-model step")
    return 0 if ok else 1
