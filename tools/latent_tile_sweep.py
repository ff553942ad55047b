"""Registers, spills and shared memory of the latent kernel's GPU tiles, without a GPU.

Compiles `_latent_attn_kernel` ahead of time (Triton's own PTX, then its ptxas -v) for every
tile `gpu_config` can pick, every 16-bit decoder and fp32, and every head block, on sm_86 and
sm_90a, and prints one line each plus the worst case per tile. This is how the tiles in
mla_ext/attention/triton_latent.py were chosen (issue 19); tests/build/test_ptxas_budget.py checks
the launches the wrappers make, this sweeps the space around them.

    .venv/bin/python tools/latent_tile_sweep.py                      # the installed Triton
    PYTHONPATH=.clients/triton-3.6.0 .venv/bin/python tools/latent_tile_sweep.py   # Triton 3.6

About 80 compiles: 4-8 minutes on two cores. Exit status 1 if anything spills.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mla_ext.attention import triton_latent as TL  # noqa: E402

# name -> (mode, query dtype, cache element type)
DECODERS = {"auto": (TL.MODE_NATIVE, "bf16", "bf16"), "fp8": (TL.MODE_E4M3, "bf16", "u8"),
            "fp8_e5m2": (TL.MODE_E5M2, "bf16", "u8"), "fp8_ds_mla": (TL.MODE_DS_MLA, "bf16", "u8"),
            "nvfp4_ds_mla": (TL.MODE_NVFP4_DS_MLA, "bf16", "u8"), "auto/fp32": (TL.MODE_NATIVE, "fp32", "fp32"),
            "fp8_ds_mla/fp32": (TL.MODE_DS_MLA, "fp32", "u8")}
DEVICES = {86: (False, 99 * 1024), 90: (True, 227 * 1024)}  # cc -> (wgmma, opt-in shared memory)
# Arguments a real launch sees as 16-byte aligned / divisible by 16 (the rest, N included, are not).
ALIGNED = ("ql_st", "ql_sh", "qp_st", "qp_sh", "c_blk", "c_ent", "o_st", "o_sh", "block_size")


def _ptxas() -> str:
    try:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - older Triton: its bundled binary
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_one(cc: int, name: str, tile: tuple[int, int, int, int], heads: int) -> dict:
    mode, dt, cache_t = DECODERS[name]
    bm, bn, warps, stages = tile
    i32 = "i32"
    sig = dict(ql_ptr=f"*{dt}", qp_ptr=f"*{dt}", c_ptr=f"*{cache_t}", c32_ptr="*fp32", c16_ptr="*bf16",
               bt_ptr="*i32", cu_q_ptr="*i32", cu_k_ptr="*i32", st_ptr="*i32", ks_ptr="*fp32",
               o_ptr=f"*{dt}", lse_ptr="*fp32", qk_scale_log2="fp32", N=i32, num_blocks=i32, block_size=i32,
               max_blocks=i32, split_len=i32, ql_st=i32, ql_sh=i32, qp_st=i32, qp_sh=i32, c_blk=i32, c_ent=i32,
               bt_s0=i32, bt_s1=i32, o_ss=i32, o_st=i32, o_sh=i32, lse_ss=i32, lse_sh=i32)
    params = list(sig)
    consts = dict(L=512, R=64, MODE=mode, HAS_STARTS=True, LOWP_DOT=dt != "fp32", IEEE_FP32=dt == "fp32",
                  BLOCK_M=bm, BLOCK_H=TL.head_block(heads, bm), BLOCK_N=bn, BLOCK_L=512, BLOCK_R=64,
                  SLICE=TL.latent_slice(512))
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in params if n.endswith("_ptr") or n in ALIGNED}
    k = triton.compile(ASTSource(fn=TL._latent_attn_kernel, signature=dict(sig, **{c: "constexpr" for c in consts}),
                                 constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        arch = "sm_90a" if cc == 90 else f"sm_{cc}"
        r = subprocess.run([_ptxas(), "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", f.name, "-o", os.devnull],
                           capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return dict(regs=int(regs.group(1)) if regs else -1, spill=sum(map(int, spill.groups())) if spill else -1,
                smem=k.metadata.shared, wgmma="wgmma.mma_async" in ptx, cp_async="cp.async" in ptx,
                error=r.stderr[-300:] if r.returncode else "")


def main() -> int:
    worst: dict[tuple, list[int]] = {}
    bad, seen = 0, set()
    for cc, (wgmma, smem) in DEVICES.items():
        for name, (mode, dt, _) in DECODERS.items():
            for heads in (1, 2, 4, 8, 16, 32, 128):
                tile = TL.gpu_config(dt == "fp32", wgmma, smem, mode, heads)
                if (cc, name, tile, TL.head_block(heads, tile[0])) in seen:
                    continue  # the same compile as a smaller head count
                seen.add((cc, name, tile, TL.head_block(heads, tile[0])))
                r = compile_one(cc, name, tile, heads)
                mma = "wgmma" if r["wgmma"] else "mma.sync/fma"
                print(f"triton {triton.__version__} sm_{cc} {name:16s} heads {heads:3d} tile {tile}: {r['regs']} regs, "
                      f"spill {r['spill']} B, {r['smem']} B shared, {mma}, cp.async {r['cp_async']} {r['error']}",
                      flush=True)
                w = worst.setdefault((cc, tile), [0, 0, 0])
                w[0], w[1], w[2] = max(w[0], r["regs"]), max(w[1], r["spill"]), max(w[2], r["smem"])
                bad += r["spill"] != 0 or bool(r["error"]) or r["smem"] > TL.TILE_SMEM[tile]
    for (cc, tile), (regs, spill, smem) in sorted(worst.items()):
        print(f"worst sm_{cc} {tile}: {regs} registers, {spill} B spilled, {smem} B shared "
              f"(stated {TL.TILE_SMEM[tile]} B)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
