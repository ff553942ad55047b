"""What a model and its cache *are*, decided before any kernel runs (no kernels here).

formats.py          the latent cache formats (mirror of csrc/common/cache_layout.h)
index_formats.py    the DSA index cache formats (mirror of csrc/common/indexer_cache_layout.h)
families.py         the transformers MLA families and their spellings
builtin_configs.py  the built-in model configs by name
hf_reader.py        reads a config through the family's own transformers config class
dict_reader.py      the fallback reader when transformers is not installed
facts.py            the per-layer facts both readers produce
softmax_scale.py    the softmax scale (yarn mscale and kin) of a layer
sparse.py           SparseConfig: a DSA model's indexer facts
models.py           MLAModelConfig / get_model_config: assembles the facts
policy.py           CacheConfig -> LayerCacheSpec: the per-layer cache dtype (skip lists)
planner.py          pages, pools and index pages per layer (plan_model, plan_pool)
"""
from mla_ext.config.formats import FORMATS, CacheFormat, QuantMode, ScaleKind, get_format  # noqa: F401
from mla_ext.config.models import MLAModelConfig, get_model_config  # noqa: F401
from mla_ext.config.planner import LayerPlan, PoolPlan, plan_model, plan_pool  # noqa: F401
from mla_ext.config.policy import CacheConfig, LayerCacheSpec, resolve_layer, resolve_model  # noqa: F401
from mla_ext.config.sparse import SparseConfig  # noqa: F401
