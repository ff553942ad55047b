"""mla_ext's sparse MLA backend (mla_ext/vllm/sparse_backend.py) driven by vLLM 0.33's own code on a
platform stating compute capability 8.6 (tests/clients/vllm_sparse_backend_runner.py, in a
subprocess with vLLM's tree on PYTHONPATH): vLLM's validate_configuration accepts it for a
DSA model (bf16, auto / fp8_ds_mla cache, block 64, sparse); vLLM's builder builds a mixed
decode + prefill batch; vLLM's forward_mqa (top-k -> slots, then the kernel hook) equals the
float64 reference for both cache dtypes (torch and Triton-interpreter backends)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BF16_TOL = 1e-2  # SPEC section 9


@pytest.fixture(scope="module")
def result(vllm_tree) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_tree), str(REPO)]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "vllm_sparse_backend_runner.py")], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_resolves_flashmla_sparse_to_the_backend_on_8x(result):
    assert result["backend"] == "mla_ext.vllm.sparse_backend.MlaExtSparseMLABackend"
    assert result["custom_is_same"] and result["name"] == "MLA_EXT_SPARSE"


@pytest.mark.parametrize("i", [0, 1], ids=["auto", "fp8_ds_mla"])
def test_validate_configuration_accepts_dsa_on_8x_only(result, i):
    case = result["cases"][i]
    assert case["reasons_8_6"] == []
    assert case["reasons_7_5"] == ["compute capability not supported"]
    assert case["reasons_dense"] == ["non-sparse not supported"]


@pytest.mark.parametrize("i", [0, 1], ids=["auto", "fp8_ds_mla"])
def test_vllms_builder_builds_a_mixed_batch(result, i):
    b = result["cases"][i]["builder"]
    assert (b["cls"], b["metadata"], b["cudagraph"]) == ("MlaExtSparseMLAMetadataBuilder", "MlaExtSparseMLAMetadata",
                                                         "UNIFORM_BATCH")
    assert (b["num_decodes"], b["num_prefills"], b["num_decode_tokens"]) == (2, 2, 2) and b["has_prefill"]
    assert b["topk_tokens"] == 128 and b["block_size"] == 64
    assert b["req_id_per_token"] == [0, 1] + [2] * 5 + [3] * 3


@pytest.mark.parametrize("i", [0, 1], ids=["auto", "fp8_ds_mla"])
def test_forward_mqa_equals_the_reference(result, i):
    m = result["cases"][i]["impl"]
    assert m["cls"] == "MlaExtSparseMLAImpl" and not m["quant_query"]
    assert m["shape"] == [10, 4, 512] and m["dtype"] == str(torch.bfloat16) and m["lse_shape"] == [10, 4]
    assert m["all_written"] and m["slots_equal"]
    assert m["rel"] <= BF16_TOL and m["rel_triton"] <= BF16_TOL
    assert m["lse_err"] <= 1e-4


def test_the_impl_refuses_what_dsa_attention_does_not_have_naming_the_argument(result):
    r = result["cases"][0]["impl"]["refusals"]
    assert r["sliding_window"].startswith("sliding_window: MLA_EXT_SPARSE (DSA sparse MLA) takes none, got 128")
    assert r["kv_cache_dtype"].startswith("kv_cache_dtype: MLA_EXT_SPARSE expects one of")
    assert r["kv_cache_dtype"].endswith("got 'fp8'")
