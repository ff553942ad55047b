"""vLLM 0.33's own DSA indexer (sparse_attn_indexer, its CUDA path) run on the CPU with mla_ext's
ops routed in by the plugin at a stated capability 8.6 (runner: tests/clients/vllm_cpu_indexer_ops.py,
which lists its plumbing stand-ins): a mixed decode + prefill batch selects the oracle's positions
(mla_ext.sparse.reference.select_reference on the same e4m3 operands) up to ties."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_vllm_sparse_attn_indexer_selects_the_oracles_positions(vllm_tree):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_tree), str(REPO)]))
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the torch backends (the Triton ones are tested apart)
    proc = subprocess.run([sys.executable, str(HERE / "vllm_cpu_indexer_ops.py")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["mqa_logits"] == "mla_ext.vllm.deep_gemm_ops.fp8_fp4_mqa_logits"
    pre = "vllm.model_executor.layers.sparse_attn_indexer."
    assert {pre + "fp8_fp4_mqa_logits", pre + "fp8_fp4_paged_mqa_logits", "vllm._custom_ops.top_k_per_row_prefill",
            "vllm._custom_ops.top_k_per_row_decode",
            "vllm.model_executor.models.deepseek_v2.fused_indexer_q_rope_quant"} <= set(r["routed"])
    assert r["untouched_tail"]  # rows past the batch are not written
    for t, (got, want, scores) in enumerate(zip(r["got"], r["want"], r["scores"])):
        g, w = {i for i in got if i >= 0}, {i for i in want if i >= 0}
        assert len(g) == sum(i >= 0 for i in got) and got.count(-1) == want.count(-1), t
        if g != w:  # only swaps among scores equal (to float32 rounding) to the k-th selected
            kth = min(scores[i] for i in w)
            tol = 1e-5 * max(abs(s) for s in scores if s != float("-inf"))
            assert all(abs(scores[i] - kth) <= tol for i in g ^ w), f"token {t}: differs beyond ties"
