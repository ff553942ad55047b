"""One split-K Marlin v2 GEMM and one paged-gather call, the two CUDA kernels that
share data between threads through shared memory and a cross-CTA reduction, for
`compute-sanitizer --tool racecheck` (benchmarks/gpu_check.sh, step racecheck).
Small shapes: under the sanitizer every shared-memory access is instrumented.

    python benchmarks/racecheck_calls.py [--device cuda|cpu]

On the CPU it runs the same calls through the CPU kernels (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    dev = torch.device(ap.parse_args(argv).device)
    from mla_ext.cache import api
    from mla_ext.kv_b_proj import weights as W
    from mla_ext.kv_b_proj.marlin import marlin_fp8_gemm

    gen = torch.Generator().manual_seed(0)
    # DeepSeek TP8 kv_b_proj shape at M = 16, four K slices: partials, ticket, reduction.
    w = torch.randn(4096, 512, generator=gen) / 23
    packed = W.MarlinFp8Weight.from_dense(w, torch.bfloat16).to(dev).packed
    a = torch.randn(16, 512, generator=gen).to(device=dev, dtype=torch.bfloat16)
    out = marlin_fp8_gemm(a, packed, split_k=4)
    print(f"marlin v2 split-K 4: out {tuple(out.shape)}, finite {bool(torch.isfinite(out).all())}")

    # A paged fp8_ds_mla gather: 4 requests over shuffled pages, windows spanning requests.
    num_blocks, B = 64, 16
    cache = torch.zeros(num_blocks, B, 656, dtype=torch.uint8, device=dev)
    kv_c = torch.randn(num_blocks * B, 512, generator=gen).to(device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(num_blocks * B, 64, generator=gen).to(device=dev, dtype=torch.bfloat16)
    one = torch.ones(1, device=dev)
    api.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(num_blocks * B, device=dev), "fp8_ds_mla", one)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(4, 16).to(dev)
    cu = torch.tensor([0, 100, 180, 300, 420], dtype=torch.int32, device=dev)
    dst = torch.empty(420, 576, dtype=torch.bfloat16, device=dev)
    with api.GATHER.force("cuda_paged" if dev.type == "cuda" else "cpu"):
        api.gather_and_maybe_dequant_cache(cache, dst, table, cu, 4, "fp8_ds_mla", one)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"paged gather: dst {tuple(dst.shape)}, finite {bool(torch.isfinite(dst).all())}")
    print("RACECHECK-CALLS-OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
