"""No compile while serving: every Triton kernel, launched by its
wrapper for batches of several sizes (tokens, requests, table widths, rows, M), needs
ONE compiled variant per launch config on sm_90: the integer arguments that change
with the batch are `do_not_specialize` (Triton would otherwise compile a new variant
for a value == 1 or divisible by 16, mid-serving or inside a CUDA-graph capture).
Each kernel is also compiled ahead of time for sm_90 (no GPU needed).

tests/build/triton_specialization_probe.py does the work in a subprocess (the test process
has TRITON_INTERPRET set, under which kernels are not JITFunctions).
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {
    "_write_kernel", "_amax_kernel", "_scale_kernel", "_gather_paged_kernel",
    "_attn_fwd_kernel", "_merge_kernel", "_latent_attn_kernel", "_w4a16_kernel",
    "_fp8_block_gemm_kernel", "_group_quant_kernel",
}
# Arguments that must have taken several values in the probe (else it proves nothing).
MUST_VARY = {
    "_gather_paged_kernel": {"num_reqs", "max_blocks", "dst_rows", "search_steps"},
    "_attn_fwd_kernel": {"lse_sh"},
    "_merge_kernel": {"num_rows"},
    "_latent_attn_kernel": {"max_blocks", "lse_sh"},
    "_w4a16_kernel": {"M"},
    "_fp8_block_gemm_kernel": {"M"},
    "_group_quant_kernel": {"M", "Mq"},
    "_amax_kernel": {"num_tokens"},
}




@pytest.mark.parametrize("which", ["pinned", "3.6"])
def test_one_specialization_per_config_and_aot_compile_for_sm90(which):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if which == "3.6":
        # The lent GPU machine's Triton 3.6, from the folder tests/build/test_ptxas_budget.py uses.
        from test_ptxas_budget import triton36_folder

        env["PYTHONPATH"] = os.pathsep.join([str(triton36_folder())] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "build", "triton_specialization_probe.py"), "--compile"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {row["kernel"] for row in rows} == KERNELS
    bad = [f"{row['kernel']} {row['config']}: {row['specializations']} variants (differ in {row['differ']})"
           for row in rows if row["specializations"] != 1]
    assert not bad, "\n".join(bad)
    for kernel, names in MUST_VARY.items():
        seen = set().union(*(set(row["varying"]) for row in rows if row["kernel"] == kernel))
        assert names <= seen, (kernel, names - seen)
    assert {row["kernel"] for row in rows if "compile_s" in row} == KERNELS
    print("\n".join(f"{row['kernel']}: compiled for sm_90 in {row['compile_s']} s" for row in rows
                    if "compile_s" in row))
