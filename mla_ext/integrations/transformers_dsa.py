"""Deprecated: `TransformersDSA` is `TransformersMLA` (mla_ext/integrations/transformers_deepseek.py),
which takes every MLA attention module of the transformers families, DSA ones included
(DeepSeek-V3.2 `DeepseekV32Attention`, GLM-5 `GlmMoeDsaAttention`): it detects the indexer and
runs sparse past index_topk, with one call shape for all families (positions, not cos/sin; the
index cache as `index_cache=`):

    layer = TransformersMLA(attn, CacheConfig("fp8_ds_mla"), index_cache_dtype="fp8")
    layer.write_cache(ctx_hidden, ctx_positions, kv_cache, ctx_slots, index_cache=index_cache)
    out = layer(new_hidden, new_positions, kv_cache, PrefillMetadata(...), index_cache=index_cache)

The former cos/sin signature is gone; this name stays for one release as an alias that warns.
"""
from __future__ import annotations

import warnings

from mla_ext.integrations.transformers_deepseek import TransformersMLA


class TransformersDSA(TransformersMLA):
    """Deprecated alias of TransformersMLA (same arguments, same call shape)."""

    def __init__(self, *args, **kwargs):
        warnings.warn("mla_ext.integrations.transformers_dsa.TransformersDSA is deprecated: use "
                      "mla_ext.integrations.transformers_deepseek.TransformersMLA (same arguments; it runs "
                      "DSA modules sparse)", DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)
