"""vLLM's DSA path on mla_ext's plugin ops: what vLLM 0.33 calls on a GPU of capability 8.x.

  .venv/bin/python benchmarks/bench_vllm_sparse.py [--quick] [--out DIR] [--reps N]

1. The sparse MLA backend's kernel (`MlaExtSparseMLAImpl._forward_mqa_kernel` ->
   `sparse_latent_attention_slots`): absorbed queries attend K physical cache slots each
   (vLLM's top-k after `triton_convert_req_index_to_global_index`), straight from the paged
   cache, for a decode batch (one token per request) and a prefill past index_topk, with the
   latent cache in `auto` (bf16) and `fp8_ds_mla` (656-byte rows). The decode call is also
   captured in a CUDA graph and replayed (the backend states UNIFORM_BATCH graph support: the
   replay must equal the eager call). Bytes moved at least: T*K*entry (each query's rows).
2. The indexer ops with DeepGEMM's contracts (mla_ext/vllm/deep_gemm_ops.py):
   `fp8_fp4_mqa_logits` (prefill, compressed rows) and `fp8_fp4_paged_mqa_logits` (decode) on
   vLLM's fp8 index cache (ue8m0 scales), then vLLM's top-k ops (`top_k_per_row_prefill` /
   `_decode`, mla_ext/vllm/_indexer_ops.py). FLOPs 2*rows*H*D*keys; bytes keys*132.

Every row is checked against the float32 torch reference on the same inputs (rel_err; for
the top-k: the selected sets equal the reference's up to ties) and timed (median of CUDA-event
timings, L2 flushed) against the physical limit measured in the same run: a device-to-device
copy of the same number of bytes (of_copy = copy time / kernel time) for the attention and
the paged logits, and a bf16 cuBLAS GEMM of the same FLOPs for the prefill logits (of_gemm).
Sizes: GPU (--quick, what benchmarks/gpu_check.sh runs): DeepSeek-V3.2 at TP8 (16 heads,
L 512, R 64; indexer 64 x 128), K = 2048, decode 64 requests x 32K context, prefill 1024
queries, indexer prefill 1024 x 32K keys. CPU: small shapes (checks the script).
Output: DIR/vllm_sparse_<device>.csv, one row per measurement as it is measured.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_absorbed import device_name  # noqa: E402
from bench_common import RowLog, pick_device, run_rows  # noqa: E402
from bench_cache import Timer  # noqa: E402

from mla_ext.cache import api as cache_api  # noqa: E402
from mla_ext.cache.reference import decode_cache_rows  # noqa: E402
from mla_ext.sparse.sparse_attention import sparse_latent_attention_slots  # noqa: E402
from mla_ext.vllm import _indexer_ops, deep_gemm_ops  # noqa: E402

BLOCK, L, R, IH, ID = 64, 512, 64, 64, 128
ENTRY = {"auto": (L + R) * 2, "fp8_ds_mla": 656}
FIELDS = ["op", "kv_cache_dtype", "rows", "keys", "topk", "ms", "gbytes", "gflops", "limit_ms", "of_limit",
          "limit", "rel_err", "graph_equal", "sets_equal"]


def sizes(device: str, quick: bool) -> dict:
    if device == "cuda":
        return dict(heads=16, topk=2048, decode=64 if quick else 128, ctx=32768, prefill=1024,
                    idx_rows=1024, idx_keys=32768, idx_heads=IH)
    return dict(heads=4, topk=256, decode=8, ctx=1024, prefill=64, idx_rows=64, idx_keys=1024, idx_heads=8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class LatentCache:
    """`rows` random latent tokens in a paged cache of `fmt`, written by mla_ext's writer."""

    def __init__(self, fmt: str, rows: int, device: str, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        self.fmt, self.nb = fmt, -(-rows // BLOCK)
        dt = torch.uint8 if fmt == "fp8_ds_mla" else torch.bfloat16
        width = ENTRY[fmt] if fmt == "fp8_ds_mla" else L + R
        self.cache = torch.empty(self.nb, BLOCK, width, dtype=dt, device=device)
        self.k_scale = torch.ones(1, device=device)
        for a in range(0, self.nb * BLOCK, 65536):  # bounded temporaries
            n = min(self.nb * BLOCK, a + 65536) - a
            kv = torch.randn(n, L, generator=g, device=device).to(torch.bfloat16)
            pe = torch.randn(n, R, generator=g, device=device).to(torch.bfloat16)
            slots = torch.arange(a, a + n, device=device)
            cache_api.concat_and_cache_mla(kv, pe, self.cache, slots, fmt, self.k_scale)

    def slots(self, T: int, K: int, span: int, seed: int) -> torch.Tensor:
        """int32 [T, K] distinct physical rows per query (a few -1 at the end, as vLLM pads)."""
        g = torch.Generator(device=self.cache.device).manual_seed(seed)
        span = min(span, self.nb * BLOCK)
        base = torch.randint(0, max(1, self.nb * BLOCK - span + 1), (T, 1), generator=g, device=self.cache.device)
        pick = torch.rand(T, span, generator=g, device=self.cache.device).argsort(-1)[:, :K]
        s = (base + pick).to(torch.int32)
        s[:, K - K // 16:] = -1
        return s.contiguous()

    def reference(self, q_nope, q_pe, slots, scale) -> torch.Tensor:
        flat = self.cache.view(self.nb * BLOCK, -1)
        outs = []
        for t0 in range(0, slots.shape[0], 64):  # bounded: [64, K, L+R] fp32 at a time
            s = slots[t0:t0 + 64].long()
            rows = decode_cache_rows(flat[s.clamp_min(0)].flatten(0, 1), self.fmt, self.k_scale)
            rows = rows[:, :L + R].float().view(s.shape[0], s.shape[1], L + R)
            logits = (torch.einsum("thl,tkl->thk", q_nope[t0:t0 + 64].float(), rows[..., :L])
                      + torch.einsum("thr,tkr->thk", q_pe[t0:t0 + 64].float(), rows[..., L:])) * scale
            logits = logits.masked_fill((s < 0)[:, None, :], float("-inf"))
            outs.append(torch.einsum("thk,tkl->thl", logits.softmax(-1), rows[..., :L]))
        return torch.cat(outs)


def copy_ms(timer: Timer, nbytes: int, device: str) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 1e3 * timer(lambda: dst.copy_(src))


def bench_attention(cache: LatentCache, T: int, K: int, heads: int, span: int, timer, device, log, graph: bool):
    g = torch.Generator(device=device).manual_seed(T)
    q_nope = (torch.randn(T, heads, L, generator=g, device=device) * 0.05).to(torch.bfloat16)
    q_pe = (torch.randn(T, heads, R, generator=g, device=device) * 0.05).to(torch.bfloat16)
    slots = cache.slots(T, K, span, seed=T + K)
    scale = (128 + R) ** -0.5
    def call(out=None):
        return sparse_latent_attention_slots(q_nope, q_pe, cache.cache, cache.fmt, slots, scale, k_scale=cache.k_scale,
                                             out=out)

    out, lse = call()
    err = rel(out, cache.reference(q_nope, q_pe, slots, scale))
    ms = 1e3 * timer(call)
    graph_equal = None
    if graph and device == "cuda":
        o_g = torch.empty_like(out)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (Triton compiles here)
            call(o_g)
        torch.cuda.current_stream().wait_stream(stream)
        cg = torch.cuda.CUDAGraph()
        o_g.fill_(float("nan"))
        with torch.cuda.graph(cg):
            call(o_g)
        cg.replay()
        torch.cuda.synchronize()
        graph_equal = bool(torch.equal(o_g, out))
        ms = min(ms, 1e3 * timer(cg.replay))
    nbytes = T * K * ENTRY[cache.fmt]
    lim = copy_ms(timer, nbytes, device)
    log.add(dict(op="attention.decode" if graph else "attention.prefill", kv_cache_dtype=cache.fmt, rows=T, keys=span,
                 topk=K, ms=round(ms, 4), gbytes=round(nbytes / 1e9, 4),
                 gflops=round(2 * T * heads * K * (2 * L + R) / 1e9, 3), limit_ms=round(lim, 4),
                 of_limit=round(lim / ms, 3), limit="device copy", rel_err=round(err, 6), graph_equal=graph_equal))
    print(f"  {cache.fmt:>10} {'decode' if graph else 'prefill':>7} T {T:>5} K {K}: {ms:8.3f} ms "
          f"({lim / ms:.2f} of a copy of the same bytes), rel err {err:.2e}"
          + ("" if graph_equal is None else f", graph replay equal {graph_equal}"), flush=True)


def index_inputs(rows: int, keys: int, H: int, device: str, seed: int):
    """fp8 e4m3 index queries [rows, H, D], keys [keys, D] with fp32 scales, fp32 weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(rows, H, ID, generator=g, device=device) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(keys, ID, generator=g, device=device) * 2).to(torch.float8_e4m3fn)
    k_scale = torch.rand(keys, generator=g, device=device) + 0.5
    w = torch.randn(rows, H, generator=g, device=device) * (H * ID) ** -0.5
    return q, k, k_scale, w


def logits_reference(q, k, k_scale, w) -> torch.Tensor:
    s = torch.einsum("mhd,nd->mhn", q.float(), k.float() * k_scale[:, None])
    return (s.relu() * w[..., None]).sum(1)


def same_sets(got: torch.Tensor, ref_scores: torch.Tensor, n_valid: torch.Tensor, K: int) -> bool:
    """Every row's selection is a top-K set of its valid scores (ties may pick either)."""
    for i in range(got.shape[0]):
        n = int(n_valid[i])
        sel = got[i][got[i] >= 0].long()
        want = min(K, n)
        if sel.numel() != want or sel.unique().numel() != want or (sel >= n).any():
            return False
        if want and want < n:
            kth = ref_scores[i, :n].topk(want).values[-1]
            if ref_scores[i, sel].min() < kth - 1e-4 * kth.abs().clamp_min(1):
                return False
    return True


def bench_indexer(s: dict, timer, device, log):
    rows, keys, H, K = s["idx_rows"], s["idx_keys"], s["idx_heads"], s["topk"]
    q, k, k_scale, w = index_inputs(rows, keys, H, device, seed=1)
    # Prefill: one request, causal rows (row i sees keys [0, keys - rows + i + 1)).
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int32, device=device)
    call = lambda: deep_gemm_ops.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, keys)  # noqa: E731
    logits = call()
    ref = logits_reference(q, k, k_scale, w)
    valid = torch.arange(keys, device=device)[None] < ke[:, None]
    err = rel(logits[valid], ref[valid])
    ms = 1e3 * timer(call)
    flops = 2 * rows * H * ID * keys
    a = torch.randn(rows * H, ID, device=device, dtype=torch.bfloat16)
    b = torch.randn(ID, keys, device=device, dtype=torch.bfloat16)
    lim = 1e3 * timer(lambda: a @ b) if device == "cuda" else None
    log.add(dict(op="indexer.mqa_logits", rows=rows, keys=keys, ms=round(ms, 4), gbytes=round(keys * 132 / 1e9, 4),
                 gflops=round(flops / 1e9, 3), limit_ms=None if lim is None else round(lim, 4),
                 of_limit=None if lim is None else round(lim / ms, 3), limit="bf16 cuBLAS GEMM, same FLOPs",
                 rel_err=round(err, 6)))
    topk = torch.full((rows, K), -7, dtype=torch.int32, device=device)
    _indexer_ops.top_k_per_row_prefill(logits, ks, ke, topk, rows, logits.stride(0), logits.stride(1), K)
    ok = same_sets(topk, ref, ke - ks, K)
    ms_k = 1e3 * timer(lambda: _indexer_ops.top_k_per_row_prefill(logits, ks, ke, topk, rows, logits.stride(0),
                                                                   logits.stride(1), K))
    log.add(dict(op="indexer.top_k_per_row_prefill", rows=rows, keys=keys, topk=K, ms=round(ms_k, 4),
                 sets_equal=ok))
    print(f"  indexer prefill {rows} x {keys}: logits {ms:8.3f} ms"
          + ("" if lim is None else f" ({lim / ms:.2f} of a GEMM of the same FLOPs)")
          + f", rel err {err:.2e}; top-k {ms_k:.3f} ms, sets equal {ok}", flush=True)

    # Decode: B requests of `keys` tokens in vLLM's fp8 index cache (values then fp32 scales per page).
    B = max(1, s["decode"] // 4)
    per_req = -(-keys // BLOCK)
    nb = B * per_req
    kv = torch.randn(nb * BLOCK, ID, device=device)
    cache = torch.zeros(nb, BLOCK, ID + 4, dtype=torch.uint8, device=device)
    _indexer_ops.indexer_k_quant_and_cache(kv.to(torch.bfloat16), cache, torch.arange(nb * BLOCK, device=device),
                                           128, "ue8m0")
    table = torch.randperm(nb, device=device).to(torch.int32).view(B, per_req).contiguous()
    ctx = torch.full((B,), keys, dtype=torch.int32, device=device) - torch.arange(B, dtype=torch.int32, device=device)
    qd, _, _, wd = index_inputs(B, 1, H, device, seed=2)
    sched = deep_gemm_ops.get_paged_mqa_logits_metadata(ctx, BLOCK, 132)
    call = lambda: deep_gemm_ops.fp8_fp4_paged_mqa_logits((qd.view(B, 1, H, ID), None), cache.unsqueeze(-2), wd,  # noqa
                                                          ctx, table, sched, keys)
    logits = call()
    kq = torch.empty(nb * BLOCK, ID, dtype=torch.uint8, device=device)
    ksc = torch.empty(nb * BLOCK, 4, dtype=torch.uint8, device=device)
    cu = torch.arange(0, (B + 1) * per_req * BLOCK, per_req * BLOCK, dtype=torch.int32, device=device)
    _indexer_ops.cp_gather_indexer_k_quant_cache(cache, kq, ksc, table, cu)
    refs = []
    for b in range(B):
        rows_b = slice(b * per_req * BLOCK, (b + 1) * per_req * BLOCK)
        refs.append(logits_reference(qd[b:b + 1], kq[rows_b].view(torch.float8_e4m3fn),
                                     ksc[rows_b].view(torch.float32).squeeze(-1), wd[b:b + 1]))
    ref = torch.cat(refs)[:, :keys]
    valid = torch.arange(keys, device=device)[None] < ctx[:, None]
    err = rel(logits[:, :keys][valid], ref[valid])
    ms = 1e3 * timer(call)
    nbytes = int(ctx.sum()) * (ID + 4)
    lim = copy_ms(timer, nbytes, device)
    log.add(dict(op="indexer.paged_mqa_logits", rows=B, keys=keys, ms=round(ms, 4), gbytes=round(nbytes / 1e9, 4),
                 gflops=round(2 * B * H * ID * keys / 1e9, 3), limit_ms=round(lim, 4), of_limit=round(lim / ms, 3),
                 limit="device copy", rel_err=round(err, 6)))
    topk = torch.full((B, K), -7, dtype=torch.int32, device=device)
    _indexer_ops.top_k_per_row_decode(logits, 1, ctx, topk, B, logits.stride(0), logits.stride(1), K)
    ok = same_sets(topk, ref, ctx, K)
    log.add(dict(op="indexer.top_k_per_row_decode", rows=B, keys=keys, topk=K, sets_equal=ok))
    print(f"  indexer decode {B} x {keys}: paged logits {ms:8.3f} ms ({lim / ms:.2f} of a copy), rel err {err:.2e}; "
          f"top-k sets equal {ok}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--reps", type=int)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    device = pick_device(args.threads)
    s = sizes(device, args.quick)
    log = RowLog(os.path.join(args.out, f"vllm_sparse_{device}.csv"), FIELDS,
                 dict(device=device_name(device), quick=args.quick))
    print(f"vLLM DSA ops: {s['heads']} heads, L {L}, R {R}, K {s['topk']}; indexer {s['idx_heads']} x {ID}", flush=True)

    def measure():
        timer = Timer(device, args.reps or 3)
        for fmt in ("fp8_ds_mla", "auto"):
            try:
                cache = LatentCache(fmt, s["decode"] * s["ctx"] // 8, device, seed=len(fmt))
                bench_attention(cache, s["decode"], s["topk"], s["heads"], s["ctx"], timer, device, log, graph=True)
                bench_attention(cache, s["prefill"], s["topk"], s["heads"], s["ctx"], timer, device, log, graph=False)
                del cache
            except Exception as exc:  # noqa: BLE001 - the next format may still run
                log.fail(dict(op="attention", kv_cache_dtype=fmt), exc)
        try:
            bench_indexer(s, timer, device, log)
        except Exception as exc:  # noqa: BLE001
            log.fail(dict(op="indexer"), exc)

    return run_rows(log, measure)


if __name__ == "__main__":
    sys.exit(main())
