"""mla_ext: the MLA prefill-with-context path (paged latent cache gather, kv_b_proj
up-projection, chunked context attention, DSA sparse attention) as a PyTorch extension.

The public face:

    from mla_ext import MLAPrefill, PrefillMetadata, CacheConfig, get_model_config, plan_model, KvBProj

Stages (each has the same name in csrc/, mla_ext/, tests/ and benchmarks/): config/ (what a
model and its cache are), cache/ (paged latent cache ops), kv_b_proj/ (the up-projection),
attention/ (varlen, merge, latent attention), sparse/ (DSA index cache, indexer, top-k, sparse
attention), prefill/ (the layer that runs them); integrations/, vllm/, sglang/ sit on top.
"""
from mla_ext import _ext  # noqa: F401  (loads the compiled ops when built)
from mla_ext._moved import install as _install_moved_paths
from mla_ext.config import (  # noqa: F401
    FORMATS,
    CacheConfig,
    CacheFormat,
    LayerCacheSpec,
    LayerPlan,
    MLAModelConfig,
    PoolPlan,
    QuantMode,
    ScaleKind,
    SparseConfig,
    get_format,
    get_model_config,
    plan_model,
    plan_pool,
    resolve_layer,
    resolve_model,
)
from mla_ext.kv_b_proj.linear import KvBProj  # noqa: F401
from mla_ext.prefill.layer import MLAPrefill  # noqa: F401
from mla_ext.prefill.metadata import ContextParallel, PrefillMetadata  # noqa: F401

_install_moved_paths()

__version__ = "0.1.0"
__all__ = ["MLAPrefill", "PrefillMetadata", "ContextParallel", "CacheConfig", "LayerCacheSpec", "get_model_config",
           "MLAModelConfig", "SparseConfig", "plan_model", "plan_pool", "KvBProj", "get_format", "FORMATS"]
