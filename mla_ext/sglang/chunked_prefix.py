"""DeepSeek's chunked-prefix prefill in SGLang, done by mla_ext (imported by SGLang's process only).

SGLang's ``forward_normal_chunked_kv_core`` attends the new tokens itself
(``attn_mha``, output [T, H, V] and LSE [T, H] natural log) and hands them to
``_chunked_prefix_attn_mha(q, accum_output, accum_lse, forward_batch)``, which
loops over prefix chunks: gather from the pool, kv_b_proj, concat, attention
with LSE, ``merge_state``. The hook below replaces that loop by
``MLAPrefill.forward_context`` on SGLang's own pool (pool_view.py: a
[pages, page_size, D] view, req_to_token rows as the block table), whose chunks
go absorbed or up-projected by mla_ext's cost model, then one merge with
SGLang's new-token result. The LSE is normalised at this boundary: SGLang's
[T, H] becomes mla_ext's [H, T] (both natural log).

Chunking is mla_ext's: the workspace holds ``SGLANG_MAX_KV_CHUNK_CAPACITY``
rows (``forward_batch.get_max_chunk_capacity()``, SGLang's own bound on a
chunk), one buffer per device and dtype shared by all layers.
``MLA_EXT_SGLANG_CONTEXT`` = auto (default: per chunk by the cost model),
absorbed or up_project forces one path for every chunk.

A DSA layer (``attn.use_dsa``: DeepSeek-V3.2, GLM-5) attends only its indexer's
top ``index_topk`` keys; mla_ext's context pass is dense, which equals that only
while every request's prefix + new tokens fit in index_topk (the top index_topk
of fewer keys is all of them). So such a layer is served only within index_topk;
past it (or where the layer has no indexer of its own to read index_topk from)
it is left to SGLang, the reason naming index_topk (``dsa_refusal``), and the
MLAPrefill built for it carries a SparseConfig, so its forward_context refuses
past index_topk as well.
"""
from __future__ import annotations

import logging
import os
import threading

import torch

from mla_ext.sglang.pool_view import Unsupported, block_table, kv_cache_format, paged_cache

logger = logging.getLogger("mla_ext.sglang")
_logged: set[str] = set()
_lock = threading.Lock()
_workspaces: dict[tuple, torch.Tensor] = {}
_unit_scale: dict[torch.device, torch.Tensor] = {}
CONTEXT_ENV = "MLA_EXT_SGLANG_CONTEXT"
# Calls served by each side, and the path mla_ext took per chunk (read by the tests).
STATS = {"mla_ext": 0, "sglang": 0, "absorbed": 0, "up_project": 0}


def context_mode() -> str:
    from mla_ext.prefill.context import check_context_attention

    value = os.environ.get(CONTEXT_ENV, "").strip().lower() or "auto"
    try:
        return check_context_attention(value)
    except ValueError as exc:
        raise ValueError(f"{CONTEXT_ENV}: {exc}") from None


def say_once(reason: str) -> None:
    with _lock:
        if reason in _logged:
            return
        _logged.add(reason)
    logger.warning("mla_ext: left to SGLang's chunked-prefix prefill: %s", reason)


def _backend_reasons(forward_batch) -> None:
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha import resolve_attn_backend

    backend = resolve_attn_backend(forward_batch)
    if getattr(backend, "pack_prefix_chunk_kv", None) is not None:
        raise Unsupported(f"{type(backend).__name__} packs prefix chunks into its own FP8 layout")
    translator = getattr(backend, "kv_index_translator", None)
    if getattr(translator, "is_translating", False):
        raise Unsupported("a unified KV pool (req_to_token holds virtual ids, translated per iteration)")


def kv_b_proj_format(kv_b_proj, dtype: torch.dtype):
    """mla_ext's WeightFormat of SGLang's kv_b_proj layer (raises ValueError when unreadable).

    Block-FP8 scale layouts are stated, never guessed from shapes (mla_ext's rule
    for serving-engine layers). The one stated here: SGLang's Fp8LinearMethod keeps
    a 128x128-block checkpoint's ``weight_scale_inv`` as the checkpoint has it
    (fp32 [ceil(N/128), ceil(K/128)]) unless it requantized the scales to UE8M0 for
    DeepGEMM, which it marks with ``format_ue8m0``: "linear". Anything else is read
    by mla_ext's detection, or refused (the layer stays with SGLang)."""
    from mla_ext.kv_b_proj.from_module import weight_format_from_module

    w, scale = kv_b_proj.weight, getattr(kv_b_proj, "weight_scale_inv", None)
    layout = None
    if (w.dtype == torch.float8_e4m3fn and isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
            and not getattr(scale, "format_ue8m0", False)
            and tuple(scale.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))):
        layout = "linear"
    return weight_format_from_module(kv_b_proj, dtype, scale_layout=layout, arg="kv_b_proj")


def dsa_index_topk(attn) -> int | None:
    """A DSA layer's index_topk (its indexer's), None for a dense layer; Unsupported for a DSA
    layer without an indexer of its own (it reuses another layer's top-k: index_topk unknown here)."""
    if not getattr(attn, "use_dsa", False):
        return None
    topk = getattr(getattr(attn, "indexer", None), "index_topk", None)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise Unsupported("a DSA layer without an indexer of its own (it reuses another layer's top-k): its "
                          "index_topk is not known here, and mla_ext's dense context pass equals sparse "
                          "attention only within index_topk")
    return topk


def dsa_refusal(attn, prefix_lens, extend_lens) -> None:
    """Unsupported (naming index_topk) when a DSA layer's batch has a request whose prefix + new
    tokens exceed index_topk: dense attention would not be the layer's there."""
    topk = dsa_index_topk(attn)
    if topk is None:
        return
    if any(n > 0 and p + n > topk for p, n in zip(prefix_lens, extend_lens)):
        raise Unsupported(f"a DSA layer past index_topk={topk} (a request has more prefix + new tokens than "
                          "that): mla_ext's chunked-prefix pass is dense attention, which equals the layer's "
                          "sparse attention only within index_topk")


def _sparse_of(attn):
    """The SparseConfig of a DSA layer (its indexer's shape), None for a dense one."""
    topk = dsa_index_topk(attn)
    if topk is None:
        return None
    from mla_ext.prefill.sparse import SparseConfig

    ix = attn.indexer
    return SparseConfig(topk, int(ix.n_heads), int(ix.head_dim))


def _layer(attn, fmt: str, page_size: int, dtype: torch.dtype, rows: int, mode: str):
    """The attention module's MLAPrefill for this pool format (built once, kept on the module)."""
    from mla_ext.config.models import MLAModelConfig
    from mla_ext.config.policy import CacheConfig
    from mla_ext.prefill.layer import MLAPrefill

    weight = attn.kv_b_proj.weight
    key = (fmt, page_size, dtype, rows, mode, weight.data_ptr())
    cache = attn.__dict__.setdefault("_mla_ext_prefill", {})
    if key not in cache:
        try:
            model = MLAModelConfig(
                name=f"sglang {type(attn).__name__} layer {attn.layer_id}", L=attn.kv_lora_rank,
                R=attn.qk_rope_head_dim, P=attn.qk_nope_head_dim, V=attn.v_head_dim,
                num_heads=attn.num_local_heads, num_layers=attn.layer_id + 1, model_dtype=dtype)
            w = kv_b_proj_format(attn.kv_b_proj, dtype)
            cache.clear()  # a new format or reloaded weights replace the old layer
            cache[key] = MLAPrefill(model, CacheConfig(kv_cache_dtype=fmt, block_size=page_size), w,
                                    layer=attn.layer_id, workspace_rows_override=rows,
                                    softmax_scale=float(attn.attn_mha.scaling), context_attention=mode,
                                    sparse=_sparse_of(attn))
        except ValueError as exc:  # e.g. a quantized kv_b_proj whose scale layout SGLang does not state
            raise Unsupported(f"{type(attn.kv_b_proj).__name__} kv_b_proj or dims: {exc}") from None
    return cache[key]


def _workspace(layer, device: torch.device) -> torch.Tensor:
    key = (device, layer.workspace_dtype, layer.workspace_rows, layer.model.L + layer.model.R)
    ws = _workspaces.get(key)
    if ws is None:
        with _lock:
            _workspaces.clear()  # one live buffer: a new capacity replaces the old one
            ws = _workspaces[key] = torch.empty(key[2], key[3], dtype=key[1], device=device)
    return ws


def _unit(device: torch.device) -> torch.Tensor:
    s = _unit_scale.get(device)
    if s is None:
        s = _unit_scale[device] = torch.ones(1, dtype=torch.float32, device=device)
    return s


def check_servable(attn, forward_batch, model_dtype: torch.dtype | None):
    """(kv_cache_dtype, buffer view dtype) when mla_ext can take this layer's
    chunked prefix; raises Unsupported (the reason) when it stays with SGLang."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    if getattr(attn, "dcp_size", 1) > 1:
        raise Unsupported("decode context parallelism (DCP) gathers the prefix across ranks")
    if model_dtype is not None and model_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Unsupported(f"{model_dtype} queries (the backend's FP8 prefill)")
    _backend_reasons(forward_batch)
    if getattr(attn, "use_dsa", False):
        dsa_refusal(attn, [int(n) for n in forward_batch.extend_prefix_lens_cpu],
                    [int(n) for n in forward_batch.extend_seq_lens_cpu])
    return kv_cache_format(get_token_to_kv_pool(), model_dtype, attn.kv_lora_rank, attn.qk_rope_head_dim)


def context_attention(attn, q: torch.Tensor, forward_batch):
    """(o [T, H, V], LSE [H, T]) of q against each request's cached prefix, by mla_ext."""
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    from mla_ext.prefill.layer import PrefillMetadata

    fmt, view_dtype = check_servable(attn, forward_batch, q.dtype)
    cache = paged_cache(get_token_to_kv_pool(), attn.attn_mha.layer_id, view_dtype)
    ps = cache.shape[1]
    layer = _layer(attn, fmt, ps, q.dtype, int(forward_batch.get_max_chunk_capacity()), context_mode())
    # One PrefillMetadata per batch and page size, kept on the ForwardBatch: every layer
    # shares its block table, chunk plan and device copies (PrefillMetadata caches them).
    metas = forward_batch.__dict__.setdefault("_mla_ext_prefill_metadata", {})
    meta = metas.get(ps)
    if meta is None:
        prefix = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
        qlens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        table = block_table(get_req_to_token_pool().req_to_token, forward_batch.req_pool_indices, max(prefix), ps)
        meta = metas[ps] = PrefillMetadata(table, prefix, qlens, block_size=ps)
    out = layer.forward_context(q, cache, meta, k_scale=_unit(q.device), workspace=_workspace(layer, q.device))
    for c in meta.plan(layer.workspace_rows, layer.chunk_alignment).chunks:  # choices are cached: no recompute
        STATS[layer.context_attention.choose(c, q.device).path] += 1
    return out


def chunked_prefix_attn_mha(original, attn, q, accum_output, accum_lse, forward_batch):
    """AROUND hook on DeepseekMHAForwardMixin._chunked_prefix_attn_mha: same inputs,
    same result ([T, H, V] in accum_output's dtype), computed by mla_ext."""
    from mla_ext.attention.api import merge_attn_states

    try:
        o_ctx, lse_ctx = context_attention(attn, q, forward_batch)
    except Unsupported as exc:
        say_once(str(exc))
        STATS["sglang"] += 1
        return original(attn, q=q, accum_output=accum_output, accum_lse=accum_lse, forward_batch=forward_batch)
    # SGLang's new-token LSE is [T, H]; mla_ext's merge takes [H, T] (natural log both).
    out, _ = merge_attn_states(o_ctx, lse_ctx, accum_output, accum_lse.transpose(0, 1).contiguous())
    STATS["mla_ext"] += 1
    return out.to(accum_output.dtype)
