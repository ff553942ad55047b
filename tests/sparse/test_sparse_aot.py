"""The sparse kernels compile ahead of time for sm_86 and sm_90 (the flat-slot kernel, the indexer ops
and the DSA model-file kernels also for sm_80 and sm_89; no GPU needed): within shared memory, no fp8
types below sm_89, and zero register spills (ptxas -v on Triton's PTX)."""
import json
import os
import subprocess
import sys

import pytest

from helpers.ptxas import _tool_version, _triton_ptxas, parse_ptxas, ptxas_report_ptx

_AOT = r"""
import inspect, json
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import sm_arch_from_capability
from mla_ext.attention import triton_latent as TL
from mla_ext.sparse import triton_sparse as TS, triton_indexer as TI

SMEM = {86: 99 * 1024, 90: 227 * 1024}

def build(fn, ptrs, consts, cc, warps, stages, options=None):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: ptrs.get(p, "i32") for p in params}
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": warps, "num_stages": stages, **(options or {})})
    assert k.metadata.shared <= SMEM[cc], (fn.__name__, cc, consts, k.metadata.shared)
    if cc < 89:
        assert "e4m3" not in k.asm["ptx"], (fn.__name__, cc)
    print(json.dumps(dict(kernel=fn.__name__, arch=sm_arch_from_capability(cc), config=repr(consts),
                          ptx=k.asm["ptx"])))

for cc in (86, 90):
    for mode, dt, cache_t in ((TL.MODE_DS_MLA, "bf16", "u8"), (TL.MODE_NVFP4_DS_MLA, "bf16", "u8"),
                              (TL.MODE_E4M3, "bf16", "u8"), (TL.MODE_NATIVE, "bf16", "bf16"),
                              (TL.MODE_NATIVE, "fp32", "fp32")):
        bh, bn, warps, stages = TS._gpu_config(dt == "fp32", cc >= 90, mode)
        ptrs = dict(ql_ptr=f"*{dt}", qp_ptr=f"*{dt}", c_ptr=f"*{cache_t}", c32_ptr="*fp32", c16_ptr="*bf16",
                    nkv_ptr=f"*{dt}", npe_ptr=f"*{dt}", idx_ptr="*i32", req_ptr="*i32", ctx_ptr="*i32",
                    cuq_ptr="*i32", bt_ptr="*i32", ks_ptr="*fp32", o_ptr=f"*{dt}", lse_ptr="*fp32",
                    qk_scale_log2="fp32")
        build(TS._sparse_latent_kernel, ptrs, dict(L=512, R=64, MODE=mode, LOWP_DOT=dt != "fp32",
              IEEE_FP32=dt == "fp32", BLOCK_H=bh, BLOCK_N=bn, BLOCK_L=512, BLOCK_R=64), cc, warps, stages)
    for fp8 in (False, True):
        ptrs = dict(q_ptr="*bf16", w_ptr="*fp32", kc_ptr="*u8" if fp8 else "*bf16", kc32_ptr="*fp32",
                    kn_ptr="*bf16", bt_ptr="*i32", out_ptr="*fp32")
        build(TI._index_score_kernel, ptrs, dict(H=64, D=128, Q=128, FP8=fp8, LOWP_DOT=True, BLOCK_M=64,
              BLOCK_N=64, BLOCK_D=128), cc, 8, 1)
    from mla_ext.sparse import triton_index_cache as TX
    for fp8 in (False, True):
        build(TX._index_write_kernel, dict(k_ptr="*bf16", c_ptr="*u8" if fp8 else "*bf16", c32_ptr="*fp32",
              slot_ptr="*i64"), dict(D=128, Q=128, FP8=fp8, UE8M0=True, BLOCK_T=32, BLOCK_D=128), cc, TX.WRITE_WARPS, 1)
        build(TX._index_gather_kernel, dict(c_ptr="*u8" if fp8 else "*bf16", c32_ptr="*fp32", bt_ptr="*i32",
              cu_ptr="*i32", st_ptr="*i32", out_ptr="*fp32"), dict(D=128, Q=128, FP8=fp8, HAS_STARTS=True,
              BLOCK_T=32, BLOCK_D=128), cc, TX.GATHER_WARPS, 1)
# The flat-slot kernel (vLLM's sparse backend) on every 8.x target and sm_90: the fp8_ds_mla
# decoder with 16-bit outputs and with the split-K fp32 partials, and the native bf16 cache.
SMEM.update({80: 163 * 1024, 89: 99 * 1024})
for cc, mode, cache_t, o_t in ((80, TL.MODE_DS_MLA, "u8", "bf16"), (86, TL.MODE_DS_MLA, "u8", "bf16"),
                               (89, TL.MODE_DS_MLA, "u8", "bf16"), (90, TL.MODE_DS_MLA, "u8", "bf16"),
                               (80, TL.MODE_DS_MLA, "u8", "fp32"), (86, TL.MODE_NATIVE, "bf16", "bf16")):
    bh, bn, warps, stages = TS._gpu_config(False, cc >= 90, mode)
    ptrs = dict(ql_ptr="*bf16", qp_ptr="*bf16", c_ptr=f"*{cache_t}", c32_ptr="*fp32", c16_ptr="*bf16", sl_ptr="*i32",
                ks_ptr="*fp32", o_ptr=f"*{o_t}", lse_ptr="*fp32", qk_scale_log2="fp32")
    build(TS._slot_latent_kernel, ptrs, dict(L=512, R=64, MODE=mode, LOWP_DOT=True, IEEE_FP32=False, BLOCK_H=bh,
          BLOCK_N=bn, BLOCK_L=512, BLOCK_R=64), cc, warps, stages)
# The DSA indexer ops (DeepGEMM's MQA logits and vLLM's indexer q quantization on 8.x): sm_80 to sm_90.
from mla_ext.sparse import triton_mqa_logits as TM, triton_indexer_quant as TQ
for cc in (80, 86, 89, 90):
    for H in (64, 128):
        tiles = dict(H=H, D=128, BLOCK_H=H, BLOCK_N=TM.BLOCK_N, BLOCK_D=128)
        build(TM._mqa_logits_kernel, dict(q_ptr="*u8", k_ptr="*u8", ksc_ptr="*fp32", w_ptr="*fp32", st_ptr="*i32",
              en_ptr="*i32", out_ptr="*fp32"), tiles, cc, TM.warps(H), 1)
        build(TM._paged_mqa_logits_kernel, dict(q_ptr="*u8", c_ptr="*u8", c32_ptr="*fp32", w_ptr="*fp32",
              end_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32"), tiles, cc, TM.warps(H), 1)
    for neox in (False, True):
        build(TQ._q_rope_quant_kernel, dict(pos_ptr="*i64", q_ptr="*bf16", cs_ptr="*fp32", w_ptr="*bf16",
              qo_ptr="*u8", wo_ptr="*fp32", softmax_scale="fp32", head_scale="fp32"),
              dict(D=128, R=64, NEOX=neox, BLOCK_H=TQ.BLOCK_H, BLOCK_D=128), cc, TQ.WARPS, 1)
# vLLM's DeepSeek-V3.2 fused_norm_rope / fused_q on 8.x (mla_ext/vllm/triton_dsa_model_ops.py), as
# launched (fp contraction off): the fp8_ds_mla + fp8 index cache configuration everywhere, native bf16 on sm_86.
from mla_ext.vllm import triton_dsa_model_ops as TD
SMEM.update({80: 163 * 1024, 89: 99 * 1024})
for cc in (80, 86, 89, 90):
    for mla, mla_t in ((TD.MLA_DS, "u8"), (TD.MLA_NATIVE, "i16"))[:2 if cc == 86 else 1]:
        build(TD._norm_rope_kernel, dict(pos_ptr="*i64", slot_ptr="*i64", islot_ptr="*i64", q_ptr="*bf16",
              qw_ptr="*bf16", q_eps="fp32", qo_ptr="*i16", kv_ptr="*bf16", kvw_ptr="*bf16", kv_eps="fp32",
              kvo_ptr="*i16", pe_ptr="*bf16", kcs_ptr="*fp32", peo_ptr="*i16", ik_ptr="*bf16", ikw_ptr="*fp32",
              ikb_ptr="*fp32", ik_eps="fp32", ics_ptr="*fp32", iko_ptr="*i16", topk_ptr="*i32", mla_ptr=f"*{mla_t}",
              ks_ptr="*fp32", idx_ptr="*u8"),
              dict(Q=1536, BLOCK_Q=2048, L=512, R=64, D=128, BLOCK_D=128, I_HALF=32, HAS_INDEXER=True, NEOX=True,
                   HAS_SLOTS=True, HAS_KVO=False, HAS_PEO=False, HAS_IKO=False, HAS_IDX_CACHE=True, SHUFFLE=False,
                   MLA=mla, HAS_KS=False, MLA_KIND=TD.OUT_BF16, QO_KIND=TD.OUT_BF16, KVO_KIND=0, PEO_KIND=0,
                   IKO_KIND=0, TOPK_BLOCK=TD.TOPK_BLOCK), cc, TD.NORM_ROPE_WARPS, 1, TD.GPU_OPTIONS)
    build(TD._q_kernel, dict(pos_ptr="*i64", pe_ptr="*bf16", cs_ptr="*fp32", ln_ptr="*bf16", qs_ptr="*fp32",
          mqa_ptr="*u8", iq_ptr="*bf16", ics_ptr="*fp32", iqo_ptr="*u8", w_ptr="*bf16", wo_ptr="*fp32",
          softmax_scale="fp32", head_scale="fp32"), dict(L=512, BLOCK_L=512, R=64, D=128, BLOCK_D=128, I_HALF=32,
          HAS_INDEXER=True, NEOX=True, QUANT=True, OUT_KIND=0), cc, TD.Q_WARPS, 1, TD.GPU_OPTIONS)
print("AOT-OK")
"""


def test_sparse_kernels_compile_for_sm86_and_sm90_without_spills():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _AOT], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stderr[-3000:]
    ptxas = _triton_ptxas()
    if ptxas is None:
        pytest.skip("no ptxas for Triton")
    version = _tool_version(ptxas)
    spills = []
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            c = json.loads(line)
            for rec in parse_ptxas(ptxas_report_ptx(c["ptx"], c["arch"], ptxas, version)):
                if rec["spill_stores"] or rec["spill_loads"]:
                    spills.append(f"{c['kernel']} {c['arch']} {c['config']}: {rec['spill_stores']}/"
                                  f"{rec['spill_loads']} B spilled, {rec['regs']} regs")
    assert not spills, "\n".join(spills)
