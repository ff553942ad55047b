"""DeepSeek Sparse Attention prefill with context against dense, at long contexts.

  .venv/bin/python benchmarks/bench_sparse.py [--quick] [--out DIR] [--context C ...]
      [--new-tokens T ...] [--topk K] [--reps N]

One DeepSeek-V3.2 layer at TP8 (16 heads; L 512, R 64, P = V = 128; block-FP8 kv_b_proj,
Marlin FP8 below sm_89) with its indexer (64 heads x 128, index_topk 2048), one request
with C context tokens in a paged fp8_ds_mla cache (block 64) and an fp8 index cache (vLLM's
layout), T new tokens, through `MLAPrefill.forward` twice: dense (context attended in latent
space, every context token) and sparse (chunked indexer top-k, then sparse latent attention
of each query's K tokens straight from the paged cache). The sparse path's two stages are
also timed alone. Each row carries the bytes and FLOPs the path must move at least and the
time the roofline allows (SPEC §11's H200: 4.3 TB/s, 790 TFLOP/s bf16; none on the CPU):

  dense context   FLOPs 2*T*N*C*(2L+R), bytes C*656 (the cache read once)
  sparse attn     FLOPs 2*T*N*K*(2L+R), bytes T*K*656 (each query's own rows)
  indexer         FLOPs 2*T*H*D*C, bytes C*132*ceil(T/256) (the index cache per query block)

Sizes: GPU C in 32K, 64K, 128K x T in 256, 1024; --quick (what benchmarks/gpu_check.sh
runs): C in 32K, 128K x T 256, 3 repetitions. CPU: C 2K x T 64 with K 256 (checks the
script). Output: DIR/sparse_<device>.csv, one row per measurement as it is measured.
Interrupted (SIGINT): keeps the rows measured so far.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

from bench_absorbed import device_name, kv_b_proj, model_config  # noqa: E402
from bench_common import RowLog, finish, pick_device  # noqa: E402
from bench_cache import Timer  # noqa: E402

from mla_ext.cache import api as cache_api  # noqa: E402
from mla_ext.config.policy import CacheConfig  # noqa: E402
from mla_ext.attention.latent import absorb_queries, absorbed_weights  # noqa: E402
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata  # noqa: E402
from mla_ext.sparse.index_cache import get_index_format, write_index_cache  # noqa: E402
from mla_ext.prefill.sparse import IndexInputs, SparseConfig, indexer_backend  # noqa: E402
from mla_ext.sparse.sparse_attention import sparse_latent_attention  # noqa: E402
from mla_ext.sparse.topk import indexer_topk  # noqa: E402

BLOCK, FMT, INDEX_FMT, H, D = 64, "fp8_ds_mla", "fp8", 64, 128
GPU_C, GPU_T, CPU_C, CPU_T = [32768, 65536, 131072], [256, 1024], [2048], [64]
PEAK = {"cuda": (4.3e12, 790e12)}  # bytes/s, FLOP/s (SPEC §11, H200); none stated for the CPU
FIELDS = ["context", "new_tokens", "topk", "path", "ms", "gbytes", "gflops", "roofline_ms", "of_roofline",
          "speedup_vs_dense", "rel_err"]


class Setup:
    """Caches holding C random context tokens (latent fp8_ds_mla and fp8 index keys)."""

    def __init__(self, m, C: int, device: str):
        g = torch.Generator(device=device).manual_seed(C)
        self.nb = -(-C // BLOCK) + 1
        self.kv_cache = torch.empty(self.nb, BLOCK, 656, dtype=torch.uint8, device=device)
        self.index_cache = get_index_format(INDEX_FMT).empty(self.nb, BLOCK, D, D, device=device)
        self.table = torch.arange(self.nb, dtype=torch.int32, device=device).flip(0)[None].contiguous()
        ks = torch.ones(1, device=device)
        for a in range(0, C, 16384):  # bounded temporaries
            n = min(C, a + 16384) - a
            pos = torch.arange(a, a + n, device=device)
            slots = self.table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
            kv = torch.randn(n, m.L, generator=g, device=device).to(torch.bfloat16)
            pe = torch.randn(n, m.R, generator=g, device=device).to(torch.bfloat16)
            cache_api.concat_and_cache_mla(kv, pe, self.kv_cache, slots, FMT, ks)
            write_index_cache(torch.randn(n, D, generator=g, device=device), self.index_cache, slots, INDEX_FMT)
        self.C = C


def inputs(m, T: int, device: str):
    g = torch.Generator(device=device).manual_seed(T)
    bf = torch.bfloat16
    q = (torch.randn(T, m.num_heads, m.P + m.R, generator=g, device=device) * 0.5).to(bf)
    kv = torch.randn(T, m.L, generator=g, device=device).to(bf)
    pe = torch.randn(T, m.R, generator=g, device=device).to(bf)
    ix = IndexInputs(torch.randn(T, H, D, generator=g, device=device).to(bf),
                     torch.randn(T, H, generator=g, device=device) * (H * D) ** -0.5,
                     torch.randn(T, D, generator=g, device=device).to(bf), None)
    return q, kv, pe, ix


def roofline(device, nbytes, flops):
    if device not in PEAK:
        return None
    bw, peak = PEAK[device]
    return 1e3 * max(nbytes / bw, flops / peak)


def bench_case(m, proj, setup, T, K, timer, device, log):
    dense = MLAPrefill(m, CacheConfig(FMT, block_size=BLOCK), proj, layer=0, context_attention="absorbed")
    sparse = MLAPrefill(m, CacheConfig(FMT, block_size=BLOCK), proj, layer=0,
                        sparse=SparseConfig(K, H, D, False, INDEX_FMT))
    q, kv, pe, ix = inputs(m, T, device)
    ix.cache = setup.index_cache
    meta = PrefillMetadata(setup.table, [setup.C], [T], torch.ones(1, device=device), block_size=BLOCK)
    C, N, L, R = setup.C, m.num_heads, m.L, m.R
    common = dict(context=C, new_tokens=T, topk=K)
    o_dense = dense(q, kv, pe, setup.kv_cache, meta)
    o_sparse = sparse(q, kv, pe, setup.kv_cache, meta, index=ix)
    ms_dense = 1e3 * timer(lambda: dense(q, kv, pe, setup.kv_cache, meta))
    ms_sparse = 1e3 * timer(lambda: sparse(q, kv, pe, setup.kv_cache, meta, index=ix))
    be = indexer_backend(ix.q)
    sel = indexer_topk(ix.q, ix.weights, ix.k, setup.index_cache, setup.table, [T], [C], K,
                       index_cache_dtype=INDEX_FMT, backend=be)
    ms_index = 1e3 * timer(lambda: indexer_topk(ix.q, ix.weights, ix.k, setup.index_cache, setup.table, [T], [C], K,
                                                index_cache_dtype=INDEX_FMT, backend=be))
    w_uk, _ = absorbed_weights(proj, N, m.P, m.V, q.dtype, q.device)
    q_lat = absorb_queries(q[..., :m.P], w_uk)
    ms_attn = 1e3 * timer(lambda: sparse_latent_attention(q_lat, q[..., m.P:], setup.kv_cache, FMT, setup.table, sel,
                                                          kv, pe, torch.ones(1, device=device), m.softmax_scale,
                                                          q_lens=[T], ctx_lens=[C]))
    k_eff = min(K, C + T)
    rows = [("dense", ms_dense, C * 656, 2 * T * N * C * (2 * L + R)),
            ("sparse", ms_sparse, T * k_eff * 656 + C * 132 * math.ceil(T / 256),
             2 * T * N * k_eff * (2 * L + R) + 2 * T * H * D * C),
            ("sparse.indexer", ms_index, C * 132 * math.ceil(T / 256), 2 * T * H * D * C),
            ("sparse.attention", ms_attn, T * k_eff * 656, 2 * T * N * k_eff * (2 * L + R))]
    err = float((o_sparse.double() - o_dense.double()).norm() / o_dense.double().norm())
    for path, ms, nbytes, flops in rows:
        roof = roofline(device, nbytes, flops)
        log.add(dict(common, path=path, ms=round(ms, 4), gbytes=round(nbytes / 1e9, 4), gflops=round(flops / 1e9, 3),
                     roofline_ms=None if roof is None else round(roof, 4),
                     of_roofline=None if roof is None else round(roof / ms, 3),
                     speedup_vs_dense=round(ms_dense / ms, 2), rel_err=round(err, 4) if path == "sparse" else None))
    print(f"  C {C:>6} T {T:>5} K {K}: dense {ms_dense:9.3f} ms, sparse {ms_sparse:9.3f} ms "
          f"(indexer {ms_index:.3f}, attention {ms_attn:.3f}); {ms_dense / ms_sparse:.2f}x; "
          f"sparse vs dense rel diff {err:.3f} (they differ: K < C)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(_HERE, "results"))
    ap.add_argument("--context", type=int, nargs="+")
    ap.add_argument("--new-tokens", type=int, nargs="+")
    ap.add_argument("--topk", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    device = pick_device(args.threads)
    contexts = args.context or (([32768, 131072] if args.quick else GPU_C) if device == "cuda" else CPU_C)
    news = args.new_tokens or (([256] if args.quick else GPU_T) if device == "cuda" else CPU_T)
    K = args.topk or (2048 if device == "cuda" else 256)
    reps = args.reps or (3 if args.quick or device == "cpu" else 10)
    log = RowLog(os.path.join(args.out, f"sparse_{device}.csv"), FIELDS,
                 dict(device=device_name(device), quick=args.quick))
    m = model_config()
    print(f"DSA layer: N={m.num_heads}, L={m.L}, R={m.R}; indexer {H}x{D}, topk {K}; {FMT} cache, {INDEX_FMT} index "
          f"cache; C {contexts}, T {news}", flush=True)
    interrupted = False
    try:
        timer = Timer(device, reps)
        proj = kv_b_proj(m, device)
        for C in contexts:
            try:
                setup = Setup(m, C, device)
            except Exception as exc:  # noqa: BLE001 - the next size may still run
                log.fail(dict(context=C, path="setup"), exc)
                continue
            for T in news:
                try:
                    bench_case(m, proj, setup, T, K, timer, device, log)
                except Exception as exc:  # noqa: BLE001
                    log.fail(dict(context=C, new_tokens=T, topk=K, path="both"), exc)
            del setup
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: keeping the rows measured so far", flush=True)
    return finish(log, interrupted)


if __name__ == "__main__":
    sys.exit(main())
