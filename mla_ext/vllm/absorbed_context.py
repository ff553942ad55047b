"""mla_ext's absorbed context attention inside vLLM's MLA prefill (opt-in).

vLLM's ``MLACommonBaseImpl._compute_prefill_context`` up-projects every context
chunk through kv_b_proj and hands head-space keys to the prefill backend, so a
prefill backend alone cannot attend in latent space. The method itself can be
replaced, and that is what ``MLA_EXT_VLLM_CONTEXT`` asks the plugin to do:

* ``vllm`` (default, or unset): vLLM's own chunk loop, untouched;
* ``absorbed``: every batch's context attended in latent space (queries absorbed
  through W_UK, multi-query attention against the cached latent rows decoded
  in the loader, output un-absorbed through W_UV; mla_ext/attention/latent.py);
* ``auto``: per batch, mla_ext's cost model (mla_ext/prefill/context_cost.py,
  the device's measured rates or stated defaults) picks absorbed or vLLM's
  up-projection, in place of always up-projecting.

The replacement returns what vLLM's method returns, (context output
[T, N, V], LSE [N, T] natural log), and vLLM's forward_mha merges it with the
new tokens as before. Where it cannot serve a call it runs vLLM's method
instead, so nothing changes silently: vLLM's FP8 prefill (fp8 queries), and a
kv_b_proj whose weight format mla_ext cannot read (the reason is logged once).
On CUDA the Triton latent kernel reads the whole context straight from the
paged cache in one pass (no workspace); elsewhere each of vLLM's chunks is
gathered into vLLM's workspace (bounded as vLLM bounds it) and the chunks are
merged by LSE. Context parallelism (``dcp_world_size > 1``) keeps vLLM's
``_context_parallel_compute_prefill_context``.

A sparse (DSA) impl (``impl.is_sparse``: DeepSeek-V3.2, GLM-5) reaches this method
through vLLM's dense ``forward_mha``, which vLLM takes when every request fits in
``index_topk`` (``attn_metadata.topk_tokens``) or when forced dense. mla_ext's context
attention is dense too, and dense equals the layer's sparse attention only within
index_topk (the top index_topk of fewer keys is all of them): past it, or where
index_topk cannot be read, the call is left to vLLM's own method, the reason naming
index_topk (``sparse_refusal``), never answered by mla_ext densely.
"""
from __future__ import annotations

import logging
import os

import torch

from mla_ext.attention import api as attn_api
from mla_ext.attention import latent as AB
from mla_ext.prefill import context_cost as AC

CONTEXT_ENV = "MLA_EXT_VLLM_CONTEXT"
CONTEXT_MODES = ("vllm", "absorbed", "auto")
logger = logging.getLogger("vllm.mla_ext")  # a child of vLLM's logger: printed by its handler


def context_mode() -> str:
    value = os.environ.get(CONTEXT_ENV, "").strip().lower() or "vllm"
    if value not in CONTEXT_MODES:
        raise ValueError(f"{CONTEXT_ENV}: expected one of {CONTEXT_MODES} (unset: vllm), got {value!r}")
    return value


def _kv_b_proj(impl):
    """mla_ext's KvBProj over the impl's vLLM kv_b_proj (built once per impl), or the
    reason it cannot be read."""
    cached = getattr(impl, "_mla_ext_kv_b_proj", None)
    if cached is None:
        from mla_ext.kv_b_proj.linear import KvBProj

        try:
            cached = KvBProj(impl.kv_b_proj)
        except ValueError as exc:
            cached = str(exc)
        impl._mla_ext_kv_b_proj = cached
    return cached


def _dims(impl, kv_cache: torch.Tensor, dtype: torch.dtype) -> AC.Dims:
    return AC.Dims(impl.kv_lora_rank, impl.qk_rope_head_dim, impl.qk_nope_head_dim, impl.v_head_dim, impl.num_heads,
                   kv_cache.shape[-1] * kv_cache.element_size(), torch.empty(0, dtype=dtype).element_size(),
                   impl.kv_cache_dtype)


def _cumsum(values) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + int(v))
    return out


def sparse_refusal(impl, attn_metadata) -> str | None:
    """Why mla_ext must not attend this sparse (DSA) impl's context densely, or None (a dense impl,
    or every request with new tokens has context + new <= index_topk)."""
    if not getattr(impl, "is_sparse", False):
        return None
    topk = getattr(attn_metadata, "topk_tokens", None)
    if topk is None:
        buf = getattr(impl, "topk_indices_buffer", None)
        topk = buf.shape[-1] if isinstance(buf, torch.Tensor) else None
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        return "a sparse (DSA) layer whose index_topk is not known here (dense equals it only within index_topk)"
    prefill = attn_metadata.prefill
    ctx = prefill.chunked_context.context_lens_list
    q_lens = [int(x) for x in prefill.query_lens_cpu.tolist()]
    if any(n > 0 and c + n > topk for c, n in zip(ctx, q_lens)):
        return (f"a sparse (DSA) layer past index_topk={topk} (a request has more context + new tokens than "
                "that): mla_ext's context attention is dense, which equals the layer's only within index_topk")
    return None


def choose(impl, q: torch.Tensor, kv_cache: torch.Tensor, prefill, attn_metadata=None) -> tuple[str, str]:
    """("absorbed" | "vllm", why) for this batch (`attn_metadata`: for a sparse impl's index_topk)."""
    mode = context_mode()
    if mode == "vllm":
        return "vllm", f"{CONTEXT_ENV} unset"
    sparse_why = sparse_refusal(impl, attn_metadata) if attn_metadata is not None else \
        (None if not getattr(impl, "is_sparse", False) else "a sparse (DSA) layer (index_topk not given)")
    if sparse_why is not None:
        return "vllm", sparse_why
    if q.dtype not in AB.FLOAT_DTYPES:
        return "vllm", f"queries are {q.dtype} (vLLM's FP8 prefill)"
    kvb = _kv_b_proj(impl)
    if isinstance(kvb, str):
        return "vllm", f"kv_b_proj not readable by mla_ext: {kvb}"
    if mode == "absorbed":
        return "absorbed", f"{CONTEXT_ENV}=absorbed"
    chunked = prefill.chunked_context
    q_lens = [int(x) for x in prefill.query_lens_cpu.tolist()]
    gathers = q.device.type != "cuda"
    ch = AC.choose(_dims(impl, kv_cache, q.dtype), chunked.context_lens_list, q_lens, AC.rates_for(q.device),
                   absorbed_gathers=gathers)
    return ("absorbed" if ch.path == "absorbed" else "vllm"), ch.reason


def compute_prefill_context_absorbed(impl, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata,
                                     k_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's _compute_prefill_context contract, in latent space: (o [T, N, V], lse [N, T])."""
    from mla_ext.vllm._custom_ops import _format_bytes

    prefill = attn_metadata.prefill
    chunked = prefill.chunked_context
    N, P, V = impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
    fmt = impl.kv_cache_dtype
    cache = _format_bytes(kv_cache, fmt)
    w_uk, w_uv_t = AB.absorbed_weights(_kv_b_proj(impl), N, P, V, q.dtype, q.device)
    scale = k_scale if k_scale is not None else None
    if q.device.type == "cuda":
        # One pass over every request's whole context, straight from the paged cache.
        q_off = _cumsum(prefill.query_lens_cpu.tolist())
        c_off = _cumsum(chunked.context_lens_list)
        cu_c = torch.tensor(c_off, dtype=torch.int32).to(q.device, non_blocking=True)
        o_lat, lse = AB.latent_context_attention(
            AB.absorb_queries(q[..., :P], w_uk), q[..., P:], cache, fmt, prefill.block_table,
            prefill.query_start_loc, cu_c, None, scale, impl.scale, q_offsets=q_off, ctx_offsets=c_off)
        return AB.unabsorb(o_lat, w_uv_t), lse
    # Elsewhere: vLLM's chunks (its workspace bound), merged by LSE.
    T = q.shape[0]
    out = torch.zeros(T, N, V, dtype=q.dtype, device=q.device)
    out_lse = torch.full((N, T), float("-inf"), dtype=torch.float32, device=q.device)
    for chunk in chunked.chunks:
        ts = chunk.token_slice
        qc = q[ts]
        o_lat, lse = AB.latent_context_attention(
            AB.absorb_queries(qc[..., :P], w_uk), qc[..., P:], cache, fmt, prefill.block_table[chunk.request_slice],
            chunk.query_start_loc, chunk.cu_seq_lens, chunk.starts, scale, impl.scale,
            q_offsets=[int(x) for x in chunk.query_start_loc.tolist()],
            ctx_offsets=[int(x) for x in chunk.cu_seq_lens.tolist()], workspace=chunked.workspace)
        o = AB.unabsorb(o_lat, w_uv_t)
        attn_api.merge_attn_states(out[ts], out_lse[:, ts], o, lse, out=out[ts], out_lse=out_lse[:, ts])
    return out, out_lse


def install(impl_cls) -> bool:
    """Wraps impl_cls._compute_prefill_context (once). Returns True if it wrapped now."""
    original = impl_cls.__dict__.get("_compute_prefill_context")
    if original is None or getattr(original, "_mla_ext_wrapped", False):
        return False
    logged: set[str] = set()

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        path, why = choose(self, q, kv_c_and_k_pe_cache, attn_metadata.prefill, attn_metadata)
        if why not in logged and len(logged) < 64:
            logged.add(why)
            logger.info("mla_ext: MLA context attention %s (%s)", path, why)
        self._mla_ext_last_context_path = path
        if path == "absorbed":
            from mla_ext.vllm.plugin import note_call

            note_call("absorbed_context")
            return compute_prefill_context_absorbed(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        return original(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale)

    _compute_prefill_context._mla_ext_wrapped = True
    _compute_prefill_context._mla_ext_original = original
    impl_cls._compute_prefill_context = _compute_prefill_context
    return True


def uninstall(impl_cls) -> None:
    current = impl_cls.__dict__.get("_compute_prefill_context")
    if current is not None and getattr(current, "_mla_ext_wrapped", False):
        impl_cls._compute_prefill_context = current._mla_ext_original
