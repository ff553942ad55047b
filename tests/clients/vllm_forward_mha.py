"""Runs vLLM 0.33's own MLA prefill (``forward_mha``) with mla_ext plugged in.

Run in a subprocess by tests/clients/test_vllm_plugin.py, with the vLLM client tree
(tests/clients/client_tree.py) on PYTHONPATH:

    python tests/clients/vllm_forward_mha.py OUT.json

What is vLLM's and what is not:
* vLLM's own code: the plugin loader (``load_general_plugins``, which finds
  mla_ext through its ``vllm.general_plugins`` entry point), the prefill
  backend selection (``VllmConfig(attention_config=AttentionConfig(
  mla_prefill_backend="MLA_EXT"))`` -> ``get_mla_prefill_backend``), the
  ``ColumnParallelLinear`` kv_b_proj, the concrete ``TritonMLAImpl``, the
  chunk planner ``build_mla_chunked_context_metadata``, the metadata classes,
  and ``forward_mha`` with its ``_compute_prefill_context`` chunk loop,
  per-chunk merges and final merge; the cache is written through
  ``vllm._custom_ops.concat_and_cache_mla``.
* Configuration plumbing only: a platform that is CPU-typed and says no pinned
  memory (vLLM's own CPU platform would pick its CPU prefill and ignore the
  chosen backend), and a one-process gloo group for vLLM's TP state.
Nothing of the math or the ops is faked: what runs is vLLM's code calling
mla_ext's ops (routed by the plugin) and mla_ext's attention (the backend).

Each case is checked against the float64 oracle and against mla_ext's own
``MLAPrefill`` on the same cache; the results go to OUT.json, one record per
case, for the test to assert on.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_PLUGINS", "mla_ext")  # only mla_ext's general plugin
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: clients.vllm_cases, helpers.numeric

import torch  # noqa: E402

import vllm.platforms  # noqa: E402
from vllm.platforms.interface import UnspecifiedPlatform  # noqa: E402


class CpuTestPlatform(UnspecifiedPlatform):
    """Plumbing: tensors on the CPU, no pinned memory; everything else is
    vLLM's UnspecifiedPlatform (no capability, not 'cpu' for the backend
    selector, so the configured MLA prefill backend is honoured)."""

    device_type = "cpu"
    device_name = "cpu"

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        # TritonMLAImpl sizes its decode split by this (decode is not run here).
        return os.cpu_count() or 1


# Before any vLLM module binds `current_platform` by name.
vllm.platforms._current_platform = CpuTestPlatform()
vllm.platforms.current_platform = vllm.platforms._current_platform

from vllm import _custom_ops as vllm_ops  # noqa: E402
from vllm.config import AttentionConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.model_executor.layers.attention import mla_attention as vllm_mla  # noqa: E402
from vllm.model_executor.layers.linear import ColumnParallelLinear  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend  # noqa: E402
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl  # noqa: E402

from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.kv_b_proj.from_module import weight_format_from_module  # noqa: E402
from mla_ext.config.models import MLAModelConfig  # noqa: E402
from mla_ext.prefill.layer import CacheConfig, MLAPrefill, PrefillMetadata  # noqa: E402
from mla_ext.prefill.reference import mla_prefill_reference  # noqa: E402
from mla_ext.prefill.synthetic import SyntheticBatch  # noqa: E402
from mla_ext.vllm import plugin  # noqa: E402

from clients.vllm_cases import BATCHES, CONTEXT_CASES  # noqa: E402
from helpers.numeric import rel_fro  # noqa: E402
from mla_ext.vllm.absorbed_context import CONTEXT_ENV  # noqa: E402

BLOCK = 16
# DeepSeek latent dims (the ds_mla formats need L=512, R=64); few, narrow heads.
MODEL = MLAModelConfig(name="tiny-deepseek", L=512, R=64, P=32, V=32, num_heads=2, num_layers=2,
                       model_dtype=torch.bfloat16, max_model_len=512)


def setup_vllm(tmp: str) -> VllmConfig:
    load_general_plugins()  # vLLM's loader: finds mla_ext's entry point, calls plugin.register()
    config = VllmConfig(attention_config=AttentionConfig(mla_prefill_backend=plugin.BACKEND_NAME))
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"file://{tmp}/dist", backend="gloo")
    with set_current_vllm_config(config):
        parallel_state.initialize_model_parallel(1, 1)
    return config


def vllm_cache_view(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    """The cache as vLLM's MLAAttention.forward_impl hands it to forward_mha:
    quantized per-tensor fp8 caches viewed as the platform's fp8 dtype (e4m3,
    even for fp8_e5m2: vLLM's kernels read the bytes by the format string), the
    byte formats (fp8_ds_mla, nvfp4_ds_mla) as uint8."""
    if fmt in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return cache.view(torch.float8_e4m3fn)
    return cache


def run_case(config: VllmConfig, backend_cls, fmt: str, dtype: torch.dtype, batch_spec, seed: int) -> dict:
    name, ctx_lens, q_lens, workspace_rows = batch_spec
    m = dataclasses.replace(MODEL, model_dtype=dtype)
    N, L, R, P, V = m.num_heads, m.L, m.R, m.P, m.V
    dt = m.model_dtype
    gen = torch.Generator().manual_seed(seed)
    batch = SyntheticBatch(m, ctx_lens, q_lens, BLOCK, seed=seed)
    ctx_kv_c, ctx_k_pe = batch.layer_context(0)
    w = torch.randn(N * (P + V), L, generator=gen) / math.sqrt(L)
    k_scale = torch.tensor([0.03], dtype=torch.float32)

    # mla_ext's own layer: the spec of the cache and the comparison.
    layer = MLAPrefill(m, CacheConfig(kv_cache_dtype=fmt, block_size=BLOCK), W.DenseWeight.from_dense(w, dt),
                       layer=1, workspace_rows_override=max(workspace_rows, 64), max_num_seqs=8)
    scale = layer.softmax_scale
    with set_current_vllm_config(config):
        # vLLM's MLAAttention builds its prefill backend at layer construction,
        # before any cache write: the MLA_EXT backend routes the ops then.
        prefill_backend = backend_cls(num_heads=N, scale=scale, kv_lora_rank=L, qk_nope_head_dim=P,
                                      qk_rope_head_dim=R, v_head_dim=V, vllm_config=config)
        cache = torch.empty(layer.spec.cache_shape(batch.num_blocks), dtype=layer.spec.storage_dtype)
        # Poison (e4m3 NaN bytes / NaN values) wherever no context token is written.
        cache.fill_(0x7F) if cache.dtype == torch.uint8 else cache.fill_(float("nan"))
        # vLLM's name for the cache write (routed to mla_ext's by the plugin).
        if sum(ctx_lens):
            vllm_ops.concat_and_cache_mla(ctx_kv_c, ctx_k_pe, cache, torch.cat(batch.slots), fmt, k_scale)
        kv_b_proj = ColumnParallelLinear(L, N * (P + V), bias=False, params_dtype=dt, prefix="kv_b_proj")
        kv_b_proj.weight.data.copy_(w.to(dt))
        # vLLM's real layer read by mla_ext, and the W_UK / W_UV its MLA keeps
        # after loading (its own split_kv_b_proj, stored as in
        # MLAAttention.process_weights_after_loading) turned back into kv_b_proj.
        from_module_exact = torch.equal(weight_format_from_module(kv_b_proj).weight, w.to(dt))
        w_uk, w_uv = vllm_mla.split_kv_b_proj(kv_b_proj, dt, L, N, P, V)
        w_uk_uv_exact = torch.equal(W.DenseWeight.from_vllm_mla(w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)).weight,
                                    w.to(dt))
        impl = TritonMLAImpl(
            num_heads=N, head_size=L + R, scale=scale, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
            kv_cache_dtype=fmt, logits_soft_cap=None, attn_type=AttentionType.DECODER,
            kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=P,
            qk_rope_head_dim=R, qk_head_dim=P + R, v_head_dim=V, kv_b_proj=kv_b_proj)
        workspace = torch.full((workspace_rows, L + R), float("nan"), dtype=dt)
        q_cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        chunked = vllm_mla.build_mla_chunked_context_metadata(
            context_lens_cpu=torch.tensor(ctx_lens, dtype=torch.int32), prefill_query_start_loc_cpu=q_cu,
            chunked_prefill_workspace=workspace, chunked_prefill_workspace_size=workspace_rows,
            block_size=BLOCK, align_chunk_to_block=True, device=torch.device("cpu"), dcp_world_size=1,
            dcp_local_block_size=1, dcp_virtual_block_size=1)
        prefill = vllm_mla.MLACommonPrefillMetadata(
            block_table=batch.block_table, query_start_loc=q_cu, max_query_len=max(q_lens),
            chunked_context=chunked, output_dtype=dt, q_data_type=dt, prefill_backend=prefill_backend,
            query_lens_cpu=torch.tensor(q_lens, dtype=torch.int32))
        prefill_backend.prepare_metadata(prefill)
        T = sum(q_lens)
        seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        attn_metadata = vllm_mla.MLACommonMetadata(
            num_reqs=len(q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_actual_tokens=T,
            query_start_loc=q_cu, slot_mapping=torch.zeros(T, dtype=torch.int64), num_decodes=0,
            num_decode_tokens=0, num_prefills=len(q_lens), prefill=prefill)
        output = torch.full((T, N * V), float("nan"), dtype=dt)
        impl.forward_mha(batch.q, batch.kv_c_new, batch.k_pe_new.unsqueeze(1), vllm_cache_view(cache, fmt),
                         attn_metadata, k_scale, output)
    got = output.view(T, N, V)

    meta = PrefillMetadata(batch.block_table, ctx_lens, q_lens, block_size=BLOCK)
    native = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta, k_scale=k_scale)
    # The oracle sees the context as the cache holds it (the format's own rounding).
    kv_c_ctx, k_pe_ctx = batch.cached_rows(layer, cache, k_scale)
    oracle = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c_ctx, k_pe_ctx, q_lens,
                                   w.to(dt).float(), P, V, scale)
    return {
        "format": fmt, "dtype": str(dtype).removeprefix("torch."), "batch": name, "seed": seed,
        "chunks": 0 if chunked is None else len(chunked.chunks),
        "continuations": 0 if chunked is None else sum(c.is_continuation for c in chunked.chunks),
        "all_written": bool(not got.isnan().any()),
        "rel_vs_oracle": rel_fro(got, oracle),
        "rel_vs_mla_prefill": rel_fro(got, native),
        "mla_prefill_vs_oracle": rel_fro(native, oracle),
        "routed": sorted(plugin.routed()),
        "from_module_exact": from_module_exact, "w_uk_uv_exact": w_uk_uv_exact,
        "context_path": getattr(impl, "_mla_ext_last_context_path", None),
    }


def main(out_path: str) -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = setup_vllm(tmp)
        with set_current_vllm_config(config):
            backend_cls = get_mla_prefill_backend(config)  # vLLM's selector, validating the backend
        header = {
            "backend": backend_cls.get_name(), "backend_class": f"{backend_cls.__module__}.{backend_cls.__name__}",
            "merge_is_mla_ext": vllm_mla.merge_attn_states.__module__.startswith("mla_ext"),
            "routed_before_backend": sorted(plugin.routed()),
        }
        for fmt, dtype, context in CONTEXT_CASES:
            os.environ[CONTEXT_ENV] = context
            for i, spec in enumerate(BATCHES):
                t0 = time.perf_counter()
                try:
                    rec = run_case(config, backend_cls, fmt, dtype, spec, seed=11 * i + len(fmt))
                except Exception as exc:  # reported per case; the test fails on it
                    rec = {"format": fmt, "dtype": str(dtype).removeprefix("torch."), "batch": spec[0],
                           "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                rec["context"] = context
                rec["seconds"] = round(time.perf_counter() - t0, 3)
                results.append(rec)
        header["merge_is_mla_ext_after"] = vllm_mla.merge_attn_states.__module__.startswith("mla_ext")
    Path(out_path).write_text(json.dumps({"header": header, "cases": results}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
