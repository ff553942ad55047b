"""mla_ext behind transformers' sparse (DSA) MLA attention modules: DeepSeek-V3.2
(`DeepseekV32Attention`) and GLM-5 (`GlmMoeDsaAttention`), transformers 5.23.

`TransformersDSA(module, CacheConfig(...), index_cache_dtype=...)` builds an `MLAPrefill` that
runs sparse (its `SparseConfig` from the module's config: index_topk, index_n_heads,
index_head_dim; the indexer's weights from `module.indexer`), computes the new tokens' MLA and
indexer inputs from hidden states (mla_ext.sparse.from_transformers.project: this library's own
float64 code, cast to the module's dtype), writes a context into the paged latent and index
caches, and runs the layer:

    layer = TransformersDSA(attn, CacheConfig("fp8_ds_mla"), index_cache_dtype="fp8")
    layer.write_cache(ctx_hidden, ctx_cos, ctx_sin, kv_cache, index_cache, ctx_slots)
    out = layer(new_hidden, new_cos, new_sin, kv_cache, index_cache, PrefillMetadata(...))  # [T, N, V]
    y = layer.o_proj(out)

cos / sin [T, R] are the model's rotary table at the tokens' positions (`rotary(positions)`).
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace

import torch
from torch import Tensor

from mla_ext.kv_b_proj.from_module import weight_format_from_module
from mla_ext.models import config_from_dict
from mla_ext.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.sparse.from_transformers import INDEXER_ROPE_INTERLEAVED, IndexerParams, project
from mla_ext.sparse.index_cache import write_index_cache
from mla_ext.sparse.layer import IndexInputs, SparseConfig


class TransformersDSA:
    def __init__(self, module, cache_config: CacheConfig, *, index_cache_dtype: str = "bfloat16", **prefill_kwargs):
        kind = type(module).__name__
        if kind not in INDEXER_ROPE_INTERLEAVED:
            raise ValueError(f"module: expected one of {sorted(INDEXER_ROPE_INTERLEAVED)}, got {kind}")
        self.module = module
        # A GLM-5 "shared" layer has no indexer: it attends the previous full layer's selection
        # (`forward(..., selection=that_layer.prefill.last_selection)`).
        self.indexer = IndexerParams.from_module(module) if getattr(module, "indexer", None) is not None else None
        cfg = module.config
        self.dtype = module.kv_a_layernorm.weight.dtype
        model = config_from_dict(cfg.to_dict(), name=f"{cfg.model_type} ({kind})")
        model = replace(model, model_dtype=self.dtype, dtype_source=f"the module's weights ({kind})")
        if not math.isclose(model.softmax_scale, module.scaling, rel_tol=1e-9):
            raise ValueError(f"{kind}: the softmax scale from the config ({model.softmax_scale!r}) differs from the "
                             f"module's scaling {module.scaling!r}")
        sparse = SparseConfig.from_config(cfg, index_cache_dtype=index_cache_dtype)
        self.prefill = MLAPrefill(model, cache_config, weight_format_from_module(module.kv_b_proj, self.dtype),
                                  layer=module.layer_idx, sparse=sparse, **prefill_kwargs)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin) [T, R] of the family's rotary embedding at `positions`."""
        mod = sys.modules[type(self.module).__module__]
        rot = getattr(mod, type(self.module).__name__.replace("Attention", "RotaryEmbedding"))(self.module.config)
        x = torch.empty(1, dtype=torch.float32)
        cos, sin = rot(x, positions.reshape(1, -1))
        return cos[0], sin[0]

    def inputs(self, hidden: Tensor, cos: Tensor, sin: Tensor):
        """(q, kv_c_normed, k_pe, IndexInputs without a cache, or None for a layer without an
        indexer) of tokens hidden [T, hidden]."""
        with torch.no_grad():
            x = project(self.module, self.indexer, hidden, cos, sin)
        d = self.dtype
        ix = None if self.indexer is None else IndexInputs(x.q_idx.to(d), x.w_idx.to(torch.float32), x.k_idx.to(d),
                                                             None)
        return x.q.to(d), x.kv_c.to(d), x.k_pe.to(d), ix

    def write_cache(self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, index_cache: Tensor,
                    slot_mapping: Tensor, k_scale: Tensor | None = None) -> None:
        _, kv_c, k_pe, ix = self.inputs(hidden, cos, sin)
        self.prefill.write_cache(kv_c, k_pe, kv_cache, slot_mapping, k_scale)
        if ix is not None:
            write_index_cache(ix.k, index_cache, slot_mapping, self.prefill.sparse.index_cache_dtype)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, index_cache: Tensor | None,
                metadata: PrefillMetadata, *, selection: Tensor | None = None, **kwargs) -> Tensor:
        """[T, N, V]. `selection`: a previous full layer's (required for a layer without an indexer)."""
        q, kv_c, k_pe, ix = self.inputs(hidden, cos, sin)
        if selection is None and ix is None:
            raise ValueError(f"selection: layer {self.module.layer_idx} has no indexer (a 'shared' layer); pass the "
                             "previous full layer's selection")
        if ix is not None:
            ix.cache = index_cache
        return self.prefill(q, kv_c, k_pe, kv_cache, metadata, index=ix if selection is None else selection,
                            **kwargs)

    __call__ = forward

    def o_proj(self, out: Tensor) -> Tensor:
        with torch.no_grad():
            return self.module.o_proj(out.reshape(out.shape[0], -1).to(self.module.o_proj.weight.dtype))
