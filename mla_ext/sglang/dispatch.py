"""Absorbed vs MHA for DeepSeek prefill with a cached prefix, by mla_ext's cost model
(imported by SGLang's process only).

SGLang's fa3 / flashinfer / flashmla handlers send a batch whose summed prefix
is below ``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD`` (8,192 tokens by default) to
absorbed MLA, at or above it to MHA (one shot up to ``SGLANG_MAX_KV_CHUNK_CAPACITY``,
else chunked). With the plugin, the same handlers run with that threshold at
1 token, and a one-shot choice with a prefix becomes chunked: every extend
batch with a prefix reaches ``_chunked_prefix_attn_mha``, where mla_ext decides
per chunk between latent-space (absorbed) and up-projected attention from the
chunk's shape and the device's rates (mla_ext.prefill.context_cost). All of
the handlers' other rules stay theirs (CUDA-graph capture and context
parallelism pin MLA, ``disable_chunked_prefix_cache``, flashinfer's
``disable_ragged``, deterministic inference, speculative batches).

Not changed: triton (SGLang's default below Hopper; its backend has no
prefix-chunk MHA), trtllm_mla (always chunks already), fa4, aiter, dsa, ascend;
and batches mla_ext's chunked path would leave to SGLang (the FP4 pool, DCP,
unified pools, packed FP8 prefixes: chunked_prefix.check_servable): their
handler's answer stands.
"""
from __future__ import annotations

HANDLED_BACKENDS = ("fa3", "flashinfer", "flashmla")


class _ThresholdOne:
    """The attention module as the handler sees it, with the prefix threshold at 1."""

    __slots__ = ("_attn",)

    def __init__(self, attn):
        object.__setattr__(self, "_attn", attn)

    def __getattr__(self, name):
        if name == "chunked_prefix_cache_threshold":
            return 1
        return getattr(self._attn, name)


def _servable(attn, forward_batch) -> bool:
    from mla_ext.sglang.chunked_prefix import say_once, check_servable
    from mla_ext.sglang.pool_view import Unsupported

    try:
        check_servable(attn, forward_batch, None)
    except Unsupported as exc:
        say_once(str(exc))
        return False
    return True


def cost_model_handler(handler):
    """`handler` with mla_ext's choice for extend batches with a prefix."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    def handle(attn, forward_batch):
        prefix = forward_batch.extend_prefix_lens_cpu
        if not prefix or not any(prefix) or not _servable(attn, forward_batch):
            return handler(attn, forward_batch)
        method = handler(_ThresholdOne(attn), forward_batch)
        if method == AttnForwardMethod.MHA_ONE_SHOT:
            return AttnForwardMethod.MHA_CHUNKED_KV
        return method

    handle.mla_ext_wraps = handler
    return handle


def get_handler(original, cls, backend_name):
    """AROUND hook on AttentionBackendRegistry.get_handler."""
    handler = original(cls, backend_name)
    if backend_name in HANDLED_BACKENDS and handler is not None:
        return cost_model_handler(handler)
    return handler
