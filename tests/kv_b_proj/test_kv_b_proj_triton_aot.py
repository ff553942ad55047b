"""The kv_b_proj Triton kernels compile ahead of time for the GPUs they are
dispatched to (no GPU needed), with every launch config their wrappers use,
within the target's shared memory:

  * NVFP4 W4A16 (`_w4a16_kernel`) on sm_86 and sm_90 (it must run on sm_80+,
    so it may not use Triton's fp8e4nv type, which sm_86 lacks: the e4m3 block
    scales are decoded from raw bytes). Compiled as a launch with K = 512 and a
    576-element row stride specialises it (16-divisible pointers and strides);
    it must then load the packed weight tile and the activations through
    cp.async, 16 bytes at a time where the tile gives a thread 16 bytes, and
    stay under 128 registers without spills (ptxas's report; the registers are
    printed),
  * block-FP8 W8A8 and the 1x128 activation quantizer on sm_90 (native fp8;
    the dispatcher never sends them to sm_86).

Runs in a subprocess because the test process has TRITON_INTERPRET set.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import os, re, subprocess, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import sm_arch_from_capability
from mla_ext.kv_b_proj import quant, triton_fp8_block as fb, triton_w4a16 as w4

SMEM = {86: 99 * 1024, 90: 227 * 1024}

def build(fn, sig, cfg, cc, div16=()):
    cfg = dict(cfg)
    opts = {"num_warps": cfg.pop("num_warps", 4), "num_stages": cfg.pop("num_stages", 3)}
    s = dict(sig, **{k: "constexpr" for k in cfg})
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn=fn, signature=s, constexprs=cfg, attrs=attrs),
                       target=GPUTarget("cuda", cc, 32), options=opts)
    assert k.metadata.shared <= SMEM[cc], (fn.__name__, cc, cfg, k.metadata.shared)
    return k

def ptxas_usage(ptx, cc):
    # (registers, spilled bytes) from ptxas -v with Triton's flags (no GPU: n_regs is filled at load time).
    from triton import knobs
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--regAllocOptLevel=2", "--gpu-name="
                            + sm_arch_from_capability(cc), f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    assert r.returncode == 0, r.stderr[-2000:]
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spill = max(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", r.stderr))
    return regs, spill

i32 = "i32"
w4_sig = dict(a_ptr="*bf16", b_ptr="*u8", s_ptr="*u8", g_ptr="*fp32", c_ptr="*bf16", M=i32, N=i32, K=i32,
              stride_am=i32, stride_bn=i32, stride_sn=i32, stride_cm=i32)
w4_div = ["a_ptr", "b_ptr", "s_ptr", "c_ptr", "K", "stride_am", "stride_bn", "stride_sn", "stride_cm"]
for cc in (86, 90):
    for m, n in ((1, 4096), (1, 32768), (16, 4096), (32, 4096), (64, 4096), (4096, 4096)):
        cfg = dict(w4._config(m, n, 132), EVEN_K=True)
        k = build(w4._w4a16_kernel, w4_sig, cfg, cc, w4_div)
        ptx = k.asm["ptx"]
        assert "e4m3" not in ptx, "fp8 conversion instructions in the sm_80+ W4A16 kernel"
        regs, spill = ptxas_usage(ptx, cc)
        print(f"w4a16 sm_{cc} M={m} N={n} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
              f"warps {cfg['num_warps']}: {regs} registers, {spill} B spilled")
        assert regs < 128 and spill == 0, (cc, m, n, regs, spill)
        assert "cp.async" in ptx, "the W4A16 tiles are not loaded through cp.async"
        if cfg["BLOCK_N"] * cfg["BLOCK_K"] // 2 >= 16 * 32 * cfg["num_warps"]:
            assert re.search(r"cp\.async\.\w+\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)

fb_sig = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", c_ptr="*bf16",
              M=i32, N=i32, K=i32, stride_am=i32, stride_asm=i32, stride_bn=i32, stride_bsn=i32,
              stride_cm=i32)
for m in (1, 64, 8192):
    build(fb._fp8_block_gemm_kernel, fb_sig, dict(fb._config(m), BLOCK_K=fb.BLOCK_K), 90)

q_sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", M=i32, K=i32, Mq=i32, Kq=i32,
             stride_xm=i32, stride_qm=i32, stride_sm=i32, stride_sg=i32, eps="fp32")
build(quant._quant_kernel, q_sig, dict(GROUP=quant.GROUP, BLOCK_M=16, FP8_OUT=True), 90)
print("AOT-OK")
"""


def test_kv_b_proj_triton_kernels_compile_for_their_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stderr[-3000:]
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith("w4a16")))
