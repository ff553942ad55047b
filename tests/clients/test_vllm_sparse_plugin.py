"""Where mla_ext's vLLM plugin installs its DSA pieces (mla_ext/vllm/sparse_plugin.py): the
sparse backend under CUSTOM everywhere and under FLASHMLA_SPARSE on capability 8.x only; vLLM
functions rebound only where the GPU lacks them, including in modules imported after the
plugin loaded; nothing on 9.x. The post-import hook and the route matrix are checked without
vLLM."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mla_ext.vllm import sparse_plugin as sp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OURS = sp.SPARSE_BACKEND_PATH


def _routes(cap):
    return {r.attr for r in sp.ROUTES if sp.needed(r, cap)}


def test_routes_follow_what_the_gpu_lacks():
    deep_gemm = {"fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "has_deep_gemm", "get_paged_mqa_logits_metadata"}
    triton_fp8 = {"fused_norm_rope", "fused_q", "fused_indexer_q_rope_quant", "pack_seq_triton",
                  "_PACK_SEQ_TRITON_KERNEL"}
    c_ops = {"indexer_k_quant_and_cache", "cp_gather_indexer_k_quant_cache", "top_k_per_row_prefill",
             "top_k_per_row_decode"}
    ours = {"_canonicalize_sparse_mla_kv_cache_dtype"}  # acts on mla_ext's backend only
    assert _routes((8, 0)) == _routes((8, 6)) == deep_gemm | triton_fp8 | c_ops | ours
    assert _routes((8, 9)) == deep_gemm | c_ops | ours  # Triton has fp8e4nv from sm_89
    assert _routes((9, 0)) == _routes((10, 0)) == _routes((12, 0)) == ours
    assert _routes(None) == set()  # vLLM CPU: its own forward_cpu


def test_post_import_hook_patches_a_module_imported_later(tmp_path, monkeypatch):
    (tmp_path / "mla_ext_hook_probe.py").write_text("def f():\n    return 'vllm'\n\ndef g():\n    return f()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    sp.when_imported("mla_ext_hook_probe", lambda m: (seen.append(m.__name__), setattr(m, "f", lambda: "mla_ext")))
    assert not seen
    import mla_ext_hook_probe

    assert seen == ["mla_ext_hook_probe"] and mla_ext_hook_probe.g() == "mla_ext"
    sp.when_imported("mla_ext_hook_probe", lambda m: seen.append("again"))  # already imported: now
    assert seen[-1] == "again"
    sys.modules.pop("mla_ext_hook_probe")


def test_sparse_mode_is_parsed_strictly(monkeypatch):
    monkeypatch.setenv(sp.SPARSE_ENV, "sometimes")
    with pytest.raises(ValueError, match="MLA_EXT_VLLM_SPARSE: expected 1/on, 0/off or unset"):
        sp.sparse_mode()


def _registration(vllm_tree, stated: str, **env_extra) -> dict:
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_tree), str(REPO)]), **env_extra)
    proc = subprocess.run([sys.executable, str(HERE / "vllm_sparse_registration.py"), stated], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_capability_8x_gets_the_backend_without_flags_and_the_routes(vllm_tree):
    r = _registration(vllm_tree, "8.6")
    assert r["flashmla_sparse"] == OURS and r["custom"] == OURS
    assert r["flash_attn_mla_sparse"] is None  # one member is enough; the others stay vLLM's
    # vllm._custom_ops was imported after the plugin loaded: patched at its import (no _C here).
    assert r["top_k_per_row_prefill"] == "mla_ext.vllm._indexer_ops.top_k_per_row_prefill"
    assert "vllm._custom_ops.indexer_k_quant_and_cache" in r["routed"]
    # `--kv-cache-dtype fp8` is served as fp8_ds_mla by mla_ext's backend, as vLLM does for
    # FLASHMLA_SPARSE; another backend keeps vLLM's answer.
    assert r["canonical"] == {"ours": {"fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla", "auto": "auto",
                                       "fp8_ds_mla": "fp8_ds_mla"}, "other_fp8": "fp8"}
    # The indexer's fp8 query padding: packed as bytes by vLLM's own kernel, and its JIT warmup
    # registers that uint8 kernel (an fp8 one cannot compile below sm_89 and vLLM warms up by default).
    assert r["pack_seq"]["fn"] == "mla_ext.vllm.seq_pack.pack_seq_triton" and r["pack_seq"]["rows_equal"]
    assert r["pack_seq"]["warmup"] == [["PackSeqTritonKernel", "torch.uint8", 0]]


CANONICAL = "vllm.model_executor.layers.attention.mla_attention._canonicalize_sparse_mla_kv_cache_dtype"


def test_capability_9x_keeps_vllms_kernels(vllm_tree):
    r = _registration(vllm_tree, "9.0")
    assert r["flashmla_sparse"] is None and r["custom"] == OURS
    # Only the kv-cache-dtype canonicalisation, which acts on mla_ext's own backend (CUSTOM) alone.
    assert r["routed"] == [CANONICAL] and set(r["waiting_before_import"]) <= {CANONICAL.rsplit(".", 1)[0]}
    assert r["top_k_per_row_prefill"] == "vllm._custom_ops.top_k_per_row_prefill"
    assert r["pack_seq"]["fn"] == "vllm.v1.attention.ops.common.pack_seq_triton"
    assert r["pack_seq"]["warmup"] == [["PackSeqTritonKernel", "torch.float8_e4m3fn", float("-inf")]]


def test_sparse_off_registers_nothing(vllm_tree):
    r = _registration(vllm_tree, "8.6", MLA_EXT_VLLM_SPARSE="0")
    assert r["flashmla_sparse"] is None and r["custom"] is None and r["routed"] == []


def test_c_op_routes_check_the_namespace_vllms_wrapper_calls(vllm_tree):
    """A "no-c-op" route stands aside when vLLM's compiled library has the op: the check must look
    where vLLM's wrapper looks (the cache ops live in torch.ops._C_cache_ops, not _C)."""
    import ast

    source = (vllm_tree / "vllm" / "_custom_ops.py").read_text()
    bodies = {n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef)}
    c_routes = [r for r in sp.ROUTES if r.need == "no-c-op"]
    assert c_routes
    for r in c_routes:
        assert r.module == "vllm._custom_ops" and r.attr in bodies, r
        assert f"torch.ops.{r.c_op}(" in bodies[r.attr], (r.attr, r.c_op)
