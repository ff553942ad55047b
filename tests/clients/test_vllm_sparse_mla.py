"""DSA on capability 8.x, proven on the CPU: vLLM 0.33's own DSA code, stating compute capability 8.6, selects
mla_ext's sparse MLA backend, builds a mixed prefill/decode batch's metadata with its own builders
and runs its DeepSeek-V3.2 / GLM-5 attention layer (DeepseekV32Attention, sparse_attn_indexer and
the impl's forward) on mla_ext's ops; the layer equals transformers' module past index_topk and
equals dense attention when nothing is dropped. The runner (tests/clients/vllm_sparse_mla.py)
states every stand-in; it runs once per session (about 45 s) and these tests read its record."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OURS = "mla_ext.vllm.sparse_backend.MlaExtSparseMLABackend"
TOL = 1e-5  # SPEC section 9: fp32 against the model's own attention module (max abs error)
BF16_REL = 1e-2  # SPEC section 9: bf16, relative Frobenius error against the fp32 module
FAMILIES = ("deepseek_v32", "glm_moe_dsa")
# (family, kv cache dtype, index_topk, model dtype, MLA prefill backend): index_topk 128 drops tokens
# (sequences of 152 and 201 tokens), 256 drops none; with mla_ext's MLA_EXT prefill backend vLLM runs
# prefills no longer than index_topk as dense MHA (without one, none serves this CPU platform)
CASES = [("deepseek_v32", "auto", 128, "float32", None), ("glm_moe_dsa", "auto", 128, "float32", None),
         ("deepseek_v32", "fp8_ds_mla", 128, "float32", None), ("glm_moe_dsa", "fp8_ds_mla", 128, "float32", None),
         ("deepseek_v32", "auto", 256, "float32", None), ("glm_moe_dsa", "fp8_ds_mla", 256, "float32", None),
         ("deepseek_v32", "fp8_ds_mla", 128, "bfloat16", None), ("glm_moe_dsa", "auto", 128, "bfloat16", None),
         ("deepseek_v32", "auto", 256, "float32", "MLA_EXT"), ("glm_moe_dsa", "auto", 256, "bfloat16", "MLA_EXT")]
# vLLM functions the plugin serves at capability 8.6 (what the layer called instead of vLLM's kernels)
ROUTED = {
    "vllm.models.deepseek_v32.attention.fused_norm_rope", "vllm.models.deepseek_v32.attention.fused_q",
    "vllm.model_executor.layers.sparse_attn_indexer.fp8_fp4_mqa_logits",
    "vllm.model_executor.layers.sparse_attn_indexer.fp8_fp4_paged_mqa_logits",
    "vllm._custom_ops.top_k_per_row_prefill", "vllm._custom_ops.top_k_per_row_decode",
    "vllm._custom_ops.cp_gather_indexer_k_quant_cache",
}


@pytest.fixture(scope="module")
def record(vllm_tree) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_tree), str(REPO)]), VLLM_PLUGINS="mla_ext",
               TRITON_INTERPRET="1")
    env.pop("VPROOF_ONLY", None)
    proc = subprocess.run([sys.executable, str(HERE / "vllm_sparse_mla.py")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]  # vLLM logs to stdout
    return json.loads(last)


def _case(record, *key) -> dict:
    [case] = [c for c in record["cases"]
              if (c["family"], c["kv_cache_dtype"], c["topk"], c["dtype"], c["prefill"]) == key]
    assert "error" not in case, case.get("traceback", case["error"])
    return case


@pytest.mark.parametrize("family", FAMILIES)
def test_selector_picks_mla_ext_with_no_flag_and_with_custom(record, family):
    assert record["stated_capability"] == "8.6"
    recs = record["selection"][family]
    got = {(r["flag"], r["kv_cache_dtype"], r["dtype"]): r.get("backend", r.get("error")) for r in recs}
    assert set(got) == {(f, c, d) for f in (None, "CUSTOM") for c in ("auto", "fp8_ds_mla", "fp8")
                        for d in ("float32", "bfloat16")}
    assert set(got.values()) == {OURS}, got


def test_the_layer_called_mla_ext_for_what_capability_8_6_lacks(record):
    assert ROUTED <= set(record["routed"]), sorted(ROUTED - set(record["routed"]))


@pytest.mark.parametrize("family,fmt,topk,dtype,prefill", CASES)
def test_vllm_dsa_layer_matches_transformers(record, family, fmt, topk, dtype, prefill):
    case = _case(record, family, fmt, topk, dtype, prefill)
    assert case["backend"] == OURS
    assert case["impl"].startswith("mla_ext.vllm.sparse_backend.") and case["builder"].startswith(
        "mla_ext.vllm.sparse_backend.")
    # vLLM's builders split the steps: prefill x2, then mixed (one decode + one prefill with context),
    # then decode x2 -- the sparse backend's and the indexer's alike
    splits = [(s["num_decodes"], s["num_prefills"]) for s in case["steps"]]
    assert splits == [(0, 2), (1, 1), (2, 0)]
    assert [(s["indexer_num_decodes"], s["indexer_num_prefills"]) for s in case["steps"]] == splits
    # the prefills take vLLM's dense MHA route only with a prefill backend and nothing to drop
    dense_route = prefill is not None and topk >= 201
    assert [s["dense_prefill"] for s in case["steps"]] == [dense_route, dense_route, False]
    assert case["all_written"]
    for req in case["requests"]:
        n = req["tokens"]
        assert req["sel_counts_ok"]  # min(index_topk, position + 1) selected per token
        assert req["sel_bad_rows_vs_cache_scores"] == []  # the top-k of what its indexer holds, up to ties
        # what its indexer holds (e4m3 keys with ue8m0 scales, e4m3 queries) scores as transformers'
        # float64 indexer within e4m3's rounding (measured 3.5-3.9%; a RoPE or scale slip is ~100%)
        assert req["index_scores_rel"] <= 0.06, req
        # transformers fed vLLM's selection (and, for fp8_ds_mla or a bf16 model, the cache's latents)
        # and on its own (fp32 indexer) on every row whose selected set is the same
        if dtype == "float32":
            assert req["max_err_fed"] <= TOL and req["max_err_own_same_rows"] <= TOL, req
        else:  # the bf16 model against the same module in fp32
            assert req["rel_fed"] <= BF16_REL and req["rel_own_same_rows"] <= BF16_REL, req
        if topk >= n:  # nothing dropped: dense attention, and the very same selection
            assert req["dropped_rows"] == 0 and req["sel_equal_transformers_rows"] == n
            assert req["max_err_dense"] <= TOL if dtype == "float32" else req["rel_dense"] <= BF16_REL
        else:
            assert req["dropped_rows"] > 0
            # vLLM scores fp8 indexer keys/queries, transformers fp32: near ties may go the other way
            assert req["sel_equal_transformers_rows"] >= 0.7 * n, req
