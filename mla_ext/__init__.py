"""mla_ext: the MLA prefill-with-context path (paged latent cache gather,
kv_b_proj up-projection, chunked context attention) as a PyTorch extension."""
from mla_ext import _ext  # noqa: F401  (loads the compiled ops when built)
from mla_ext.formats import CacheFormat, QuantMode, ScaleKind, get_format, FORMATS  # noqa: F401
from mla_ext.models import MLAModelConfig, get_model_config  # noqa: F401
from mla_ext.policy import CacheConfig, LayerCacheSpec, resolve_layer, resolve_model  # noqa: F401
from mla_ext.planner import LayerPlan, PoolPlan, plan_model, plan_pool  # noqa: F401

__version__ = "0.1.0"
