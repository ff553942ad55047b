"""Records every Triton launch the wrappers make for batches of several sizes, and
tells how many compiled variants (specializations) sm_90 would need for them.

Run as a script, in a process WITHOUT TRITON_INTERPRET (the kernels must be real
JITFunctions); tests/build/test_triton_specialization.py does. The wrappers are steered onto
their GPU branch (`_gpu_paths`: the configs an sm_90 device gets) and JITFunction.run
is replaced with a recorder: nothing runs, only the launch arguments are kept.
For each launch, Triton's own binder (built for an sm_90 backend, as at run time)
gives the specialization key; launches of one kernel with the same constexprs and
options must share one key whatever the batch (a second key = a compile while
serving). `--compile` also compiles one launch of each kernel for sm_90.

Prints one JSON line per (kernel, config): name, keys (distinct specializations),
the integer arguments that varied, and compile seconds.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # this tree's mla_ext, then gather_data

from mla_ext import compat  # noqa: E402
from mla_ext.attention import triton_attention, triton_latent, triton_merge  # noqa: E402
from mla_ext.cache import triton_gather, triton_write  # noqa: E402
from mla_ext.kv_b_proj import triton_fp8_block, triton_group_quant, triton_w4a16  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
LAUNCHES: list[tuple[JITFunction, tuple, dict]] = []


def _record(self, *args, grid, warmup, **kwargs):
    LAUNCHES.append((self, args, kwargs))


def _drive(seed: int = 0) -> None:
    """Calls every Triton wrapper at several batch sizes (the values that change per batch)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    # Cache writer and KV scale.
    for fmt in ("auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"):
        for T in (1, 3, 16, 37):
            kv_c, k_pe = torch.randn(T, 512, dtype=bf), torch.randn(T, 64, dtype=bf)
            entry = {"auto": 576, "fp8": 576, "fp8_ds_mla": 656, "nvfp4_ds_mla": 352}[fmt]
            cache = torch.zeros(8, 16, entry, dtype=bf if fmt == "auto" else torch.uint8)
            triton_write.write_triton(kv_c, k_pe, cache, torch.arange(T), fmt, torch.ones(1))
    for T in (1, 16, 37, 100):
        triton_write.kv_scale_triton(torch.randn(T, 512, dtype=bf), torch.randn(T, 64, dtype=bf), "fp8")
    # The gather: requests, table widths and dst rows vary.
    from helpers.gather import make_batch, make_cache

    for fmt in ("fp8_ds_mla", "fp8", "nvfp4_ds_mla"):
        cache, ks = make_cache(fmt, 32, 16, 512, 64, bf, gen=g)
        for num_reqs, max_blocks in ((1, 1), (2, 3), (3, 16), (16, 5), (5, 32)):
            bt, cu, starts = make_batch(rng, num_reqs, 32, 16, max_blocks)
            dst = torch.empty(max(int(cu[-1]), 1) + rng.randint(0, 3), 576, dtype=bf)
            triton_gather.gather_triton(cache, dst, bt, cu, num_reqs, fmt, ks, starts)
    # Attention (varlen), merge, latent attention.
    N = 4
    for lens in ((1,), (16,), (3, 34), (5, 7, 9, 11)):
        Tq = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        q, k = torch.randn(Tq, N, 192, dtype=bf), torch.randn(Tq, N, 192, dtype=bf)
        v = torch.randn(Tq, N, 128, dtype=bf)
        out, lse = torch.empty(Tq, N, 128, dtype=bf), torch.empty(N, Tq)
        triton_attention.varlen_attention_triton(q, k, v, cu, cu, max(lens), 0.1, len(lens) != 2, out, lse)
        for dt, d in ((bf, 128), (bf, 512), (torch.float32, 512)):  # head dims of both paths
            o1, o2 = torch.randn(Tq, N, d, dtype=dt), torch.randn(Tq, N, d, dtype=dt)
            l1, l2 = torch.randn(N, Tq), torch.randn(N, Tq)
            triton_merge.merge_attn_states_triton(torch.empty_like(o1), torch.empty(N, Tq), o1, l1, o2, l2)
        q32, k32, v32 = q.float(), k.float(), v.float()
        triton_attention.varlen_attention_triton(q32, k32, v32, cu, cu, max(lens), 0.1, False, out.float(), lse)
        cache, _ = make_cache("fp8_ds_mla", 32, 16, 512, 64, bf, gen=g)
        bt, cuk, starts = make_batch(rng, len(lens), 32, 16, 1 + Tq % 7, lens=[min(x, 16) for x in lens])
        q_lat = torch.randn(Tq, N, 512, dtype=bf).transpose(0, 1)
        o_lat, lse_lat = torch.empty(Tq, N, 512, dtype=bf).transpose(0, 1), torch.empty(N, Tq)
        triton_latent.latent_attention_triton(
            q_lat, torch.randn(Tq, N, 64, dtype=bf), cache, "fp8_ds_mla", bt, cu, cuk, starts, None, 0.1,
            o_lat, lse_lat, max(lens), 16)
    # Attention with 256-wide heads (QK and V), the other tile config, one batch.
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, v = torch.randn(7, N, 256, dtype=bf), torch.randn(7, N, 256, dtype=bf)
    triton_attention.varlen_attention_triton(q, q, v, cu, cu, 4, 0.1, True, torch.empty_like(v), torch.empty(N, 7))
    # The latent kernel's other decoders (and fp32), one batch each.
    for fmt, dt in (("nvfp4_ds_mla", bf), ("fp8", bf), ("fp8_e5m2", bf), ("auto", bf), ("fp8_ds_mla", torch.float32)):
        cache, ks = make_cache(fmt, 32, 16, 512, 64, bf, gen=g)
        bt, cuk, starts = make_batch(rng, 2, 32, 16, 3, lens=[5, 9])
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        triton_latent.latent_attention_triton(
            torch.randn(7, N, 512, dtype=dt).transpose(0, 1), torch.randn(7, N, 64, dtype=dt), cache, fmt,
            bt, cu, cuk, starts, ks, 0.1, torch.empty(7, N, 512, dtype=dt).transpose(0, 1), torch.empty(N, 7), 4, 16)
    # Every head block (BLOCK_H = N rounded up to a power of two, at most BLOCK_M) the tiles
    # take: 1, 2 (mma.sync on every device), 8, 16 (DeepSeek TP8), 32 and 64 (TP1: 128 heads),
    # with N = 4 above; in every 16-bit decoder.
    for heads in (1, 2, 8, 16, 32, 128):
        for fmt in ("fp8_ds_mla", "nvfp4_ds_mla", "fp8", "fp8_e5m2", "auto"):
            cache, ks = make_cache(fmt, 32, 16, 512, 64, bf, gen=g)
            bt, cuk, starts = make_batch(rng, 2, 32, 16, 3, lens=[5, 9])
            cu = torch.tensor([0, 3, 7], dtype=torch.int32)
            triton_latent.latent_attention_triton(
                torch.randn(7, heads, 512, dtype=bf).transpose(0, 1), torch.randn(7, heads, 64, dtype=bf), cache,
                fmt, bt, cu, cuk, starts, ks, 0.1, torch.empty(7, heads, 512, dtype=bf).transpose(0, 1),
                torch.empty(heads, 7), 4, 16)
    # kv_b_proj kernels: M varies.
    K, Nw = 512, 256
    w4 = torch.randint(0, 255, (Nw, K // 2), dtype=torch.uint8)
    w4s = torch.rand(Nw, K // 16).to(torch.float8_e4m3fn)
    wq = torch.randn(Nw, K).to(torch.float8_e4m3fn)
    ws = torch.rand(Nw // 128, K // 128)
    for M in (1, 3, 16, 20, 32, 37, 64, 100, 256):
        x = torch.randn(M, K, dtype=bf)
        triton_w4a16.nvfp4_w4a16_matmul(x, w4, w4s, torch.ones(1))
        triton_fp8_block.w8a8_block_fp8_matmul(torch.randn(M, K).to(torch.float8_e4m3fn), torch.rand(M, K // 128),
                                               wq, ws, bf)
        mp, kp = triton_group_quant.padded_shape(M, K)
        q = torch.empty(mp, kp, dtype=torch.float8_e4m3fn)
        triton_group_quant.launch_group_quant(x, q, triton_group_quant.mmajor_scales(mp, kp // 128, "cpu"))


def _analyse(compile_each: bool) -> list[dict]:
    backend = make_backend(TARGET)
    binders: dict[int, object] = {}
    groups: dict[tuple, dict] = {}
    for fn, args, kwargs in LAUNCHES:
        binder = binders.setdefault(id(fn), create_function_from_signature(fn.signature, fn.params, backend))
        bound, spec, options = binder(*args, **kwargs)
        # The kernel's own constexprs (tl.constexpr parameters) and the launch options
        # pick a config; everything else (an int == 1 becomes a constexpr too, an int
        # or pointer % 16 an attribute) is the specialization, which must not vary.
        # Argument types (bf16 vs fp32 tensors) are variants of their own too, as intended.
        config = tuple((p.name, repr(bound[p.name])) for p in fn.params if p.is_constexpr) + tuple(
            (p.name, s[0]) for p, s in zip(fn.params, spec) if not p.is_constexpr and s[0] != "constexpr")
        key = tuple((p.name, str(s)) for p, s in zip(fn.params, spec) if not p.is_constexpr)
        cfg = (fn.__name__, config, tuple(sorted((k, repr(v)) for k, v in options.items())))
        grp = groups.setdefault(cfg, {"keys": set(), "ints": {}, "first": (fn, bound, spec, options)})
        grp["keys"].add(key)
        for p in fn.params:
            v = bound[p.name]
            if not p.is_constexpr and isinstance(v, int) and not isinstance(v, bool):
                grp["ints"].setdefault(p.name, set()).add(v)
    out, compiled = [], set()
    for (name, config, _opts), grp in groups.items():
        keys = list(grp["keys"])
        differ = sorted({n for k in keys for (n, s) in k if any(dict(o)[n] != s for o in keys)})
        row = {"kernel": name, "config": dict(config), "specializations": len(keys), "differ": differ,
               "varying": sorted(n for n, vals in grp["ints"].items() if len(vals) > 1)}
        if compile_each and name not in compiled:  # one compile per kernel keeps the test short
            compiled.add(name)
            fn, bound, spec, options = grp["first"]
            opts, signature, constexprs, attrs = fn._pack_args(backend, dict(options), bound, spec, options)
            t0 = time.time()
            triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=opts.__dict__)
            row["compile_s"] = round(time.time() - t0, 2)
        out.append(row)
    return out


def _gpu_paths(cc: int = 90) -> None:
    """Makes the wrappers take their GPU branch on CPU tensors: the launch configs a
    device of capability `cc` (86 or 90, with its shared memory) gets, with the
    device checks that would refuse CPU tensors off."""
    compat.triton_interpreter_reasons = lambda: []  # launch_guard: nothing is interpreted
    triton_gather.triton_not_supported_reasons = lambda *a, **k: []
    triton_gather._interpreting = lambda: False
    triton_gather._hw_fp8 = lambda device: cc >= 89
    triton_latent.interpreting = lambda: False
    smem = 227 * 1024 if cc >= 90 else 99 * 1024  # opt-in shared memory per block, sm_90 / sm_86
    triton_latent.launch_config = lambda rows, dtype, device, mode, heads: triton_latent.gpu_config(
        dtype == torch.float32, (cc // 10, cc % 10) in triton_latent.WGMMA_CAPABILITIES, smem, mode, heads)


def record_launches(cc: int = 90) -> list[tuple[JITFunction, tuple, dict]]:
    """Every launch the wrappers make over the probe's batches on a device of capability
    `cc`, recorded (nothing runs). tests/build/test_ptxas_budget.py compiles them."""
    os.environ.pop("TRITON_INTERPRET", None)
    _gpu_paths(cc)
    run, JITFunction.run = JITFunction.run, _record
    try:
        LAUNCHES.clear()
        _drive()
        return list(LAUNCHES)
    finally:
        JITFunction.run = run


def main() -> None:
    record_launches(90)
    for row in _analyse("--compile" in sys.argv):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
