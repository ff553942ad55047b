"""DSA in the layer: `MLAPrefill(..., sparse=SparseConfig)` runs a sparse family sparse.

A sparse family's config carries `index_topk`, `index_n_heads`, `index_head_dim`
(DeepSeek-V3.2, GLM-5 `glm_moe_dsa`); `SparseConfig.from_config` reads them (None for a
dense family, which stays dense). `forward(..., index=IndexInputs(...))` then:

  1. selects, per new token, the index_topk positions of its request's index space
     (context then new tokens) with the chunked indexer (mla_ext/sparse/topk.py), the
     context's indexer keys read from this layer's paged index cache (same block table as
     the latent cache: a block id names both pages);
  2. absorbs the queries through W_UK, attends exactly the selected positions straight from
     the paged latent cache (mla_ext/sparse/sparse_attention.py, any cache format; new
     positions from the new tokens' own rows), un-absorbs through W_UV.

When no request has more than index_topk tokens (context + new) nothing would be dropped and
the dense path is the same computation (tests prove it), so the layer runs dense and the
indexer inputs are not needed; past that, a sparse layer without `index` is an error, never
a silent dense answer. `index` may instead be a selection made before (int32 [T, K],
request-local positions, -1 padded: `layer.last_selection` of another layer), which a GLM-5
"shared" layer reuses from the previous full layer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mla_ext.sparse.index_cache import get_index_format
from mla_ext.sparse.sparse_attention import sparse_latent_attention
from mla_ext.sparse.topk import DEFAULT_CHUNK, indexer_topk

SPARSE_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
# model_type -> whether the indexer pairs its RoPE dims interleaved (the families with parity tests).
ROPE_INTERLEAVED = {"deepseek_v32": False, "glm_moe_dsa": True}


def _pos_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class SparseConfig:
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_interleaved: bool | None = None  # the indexer's RoPE pairing (the layer takes rotated inputs)
    index_cache_dtype: str = "bfloat16"
    chunk: int = DEFAULT_CHUNK  # indexer keys scored per step (bounds the top-k workspace)

    def __post_init__(self):
        for k in SPARSE_KEYS + ("chunk",):
            _pos_int(getattr(self, k), k)
        get_index_format(self.index_cache_dtype)

    @classmethod
    def from_config(cls, config, **overrides) -> "SparseConfig | None":
        """From any model config: a config dict (DSA fields at top level or under text_config),
        a transformers PretrainedConfig, an mla_ext MLAModelConfig (its own `sparse`); None for
        a dense model. A sparse family's config reads its config class's defaults where a field
        is absent (mla_ext.models.sparse_fields). A ValueError naming `config` for anything else."""
        from mla_ext.models import MLAModelConfig, sparse_fields

        if isinstance(config, MLAModelConfig):
            own = config.sparse
            return own if own is None or not overrides else replace(own, **overrides)
        fields = sparse_fields(config, "config")
        return None if fields is None else cls.from_facts(fields, "config", **overrides)

    @classmethod
    def from_facts(cls, fields: dict, name: str, **overrides) -> "SparseConfig":
        """From the indexer's fields a config reader gives (mla_ext.config_facts.ConfigFacts.sparse)."""
        kw = {k: fields[k] for k in SPARSE_KEYS}
        for k, v in kw.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model config {name}: {k} must be a positive integer; got {v!r}")
        kw["rope_interleaved"] = ROPE_INTERLEAVED.get(fields.get("model_type"))
        kw.update(overrides)
        return cls(**kw)

    def drops(self, context_lens, query_lens) -> bool:
        """Whether some request with new tokens has more tokens than index_topk (the indexer then
        drops some)."""
        return any(q > 0 and c + q > self.index_topk for c, q in zip(context_lens, query_lens))

    def describe(self) -> str:
        rope = {None: "rope pairing not stated", False: "half-split rope", True: "interleaved rope"}
        return (f"sparse (DSA): index_topk={self.index_topk}, indexer {self.index_n_heads} heads x "
                f"{self.index_head_dim} ({rope[self.rope_interleaved]}), index cache {self.index_cache_dtype} "
                f"({get_index_format(self.index_cache_dtype).bytes_per_token(self.index_head_dim, self.index_head_dim)}"
                f" B/token), chunked top-k over {self.chunk} keys; dense while context + new <= index_topk")


@dataclass
class IndexInputs:
    """The new tokens' indexer inputs (RoPE applied) and the layer's paged index cache."""
    q: Tensor  # [T, H, D]
    weights: Tensor  # [T, H]: weights_proj(hidden) * H^-0.5 * D^-0.5
    k: Tensor  # [T, D]
    cache: Tensor | None  # [num_blocks, B, D or D + 4D/Q] in SparseConfig.index_cache_dtype


def indexer_backend(q: Tensor) -> str:
    """The indexer's scorer: Triton on CUDA (reads the paged index cache directly), torch elsewhere."""
    if q.device.type != "cuda":
        return "torch"
    from mla_ext.sparse import triton_indexer

    return "torch" if triton_indexer.not_supported_reasons(q) else "triton"


def sparse_forward(layer, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor, metadata,
                   index: IndexInputs, k_scale: Tensor | None) -> Tensor:
    """[T, N, V]: the sparse layer's output (arguments already checked by MLAPrefill.forward)."""
    from mla_ext.prefill.absorbed import absorb_queries, absorbed_weights, unabsorb

    cfg, m = layer.sparse, layer.model
    T, dev = q.shape[0], q.device
    ctx, qls = list(metadata.context_lens), list(metadata.query_lens)
    if isinstance(index, Tensor):  # a selection made before (GLM-5's "shared" layers reuse the last full one's)
        if index.dim() != 2 or index.shape[0] != T or index.dtype not in (torch.int32, torch.int64) \
                or index.device != dev:
            raise ValueError(f"index: a selection must be int32 [T={T}, K] on {dev}, got {index.dtype} "
                             f"{tuple(index.shape)} on {index.device}")
        sel = index
    elif isinstance(index, IndexInputs):
        H, D = cfg.index_n_heads, cfg.index_head_dim
        if tuple(index.q.shape) != (T, H, D) or tuple(index.weights.shape) != (T, H) \
                or tuple(index.k.shape) != (T, D):
            raise ValueError(f"index: expected q [{T}, {H}, {D}], weights [{T}, {H}], k [{T}, {D}]; got "
                             f"{tuple(index.q.shape)}, {tuple(index.weights.shape)}, {tuple(index.k.shape)}")
        sel = indexer_topk(index.q, index.weights, index.k, index.cache, metadata.block_table, qls, ctx,
                           cfg.index_topk, index_cache_dtype=cfg.index_cache_dtype, chunk=cfg.chunk,
                           backend=indexer_backend(index.q))
    else:
        raise ValueError(f"index: expected mla_ext.sparse.layer.IndexInputs or a selection tensor, got "
                         f"{type(index).__name__}")
    w_uk, w_uv_t = absorbed_weights(layer.kv_b_proj, m.num_heads, m.P, m.V, q.dtype, dev)
    q_lat = absorb_queries(q[..., :m.P], w_uk)
    scale = layer._k_scale(k_scale if k_scale is not None else metadata.k_scale, dev)
    o_lat, _ = sparse_latent_attention(q_lat, q[..., m.P:], kv_cache, layer.kv_cache_dtype, metadata.block_table,
                                       sel, kv_c_normed, k_pe, scale, layer.softmax_scale, q_lens=qls, ctx_lens=ctx)
    layer.last_selection = sel  # for inspection and tests
    return unabsorb(o_lat, w_uv_t)


def check_index_cache(cfg: SparseConfig, index_cache, block_size: int, kv_cache: Tensor | None = None,
                      arg: str = "index_cache") -> None:
    """A layer's paged index cache against its latent plan, before anything reads it: the same block
    ids name a latent page and an index page, so the index pages must hold `block_size` tokens (the
    latent cache's page size; another page size maps block b, offset o to other tokens and the
    indexer scores the wrong rows), at least as many blocks as the latent cache (an id valid there
    must be valid here), the storage dtype of `cfg.index_cache_dtype` and its row width (D, or
    D + 4*D/Q bytes for fp8). ValueError naming `arg` otherwise."""
    fmt = get_index_format(cfg.index_cache_dtype)
    D = cfg.index_head_dim
    if not isinstance(index_cache, Tensor):
        raise ValueError(f"{arg}: expected a paged index cache tensor [num_blocks, {block_size}, ...] "
                         f"({cfg.index_cache_dtype}), got {type(index_cache).__name__}")
    if index_cache.dim() != 3 or index_cache.dtype != fmt.storage_dtype:
        raise ValueError(f"{arg}: expected a 3-D {fmt.storage_dtype} tensor [num_blocks, {block_size}, ...] "
                         f"(index_cache_dtype={cfg.index_cache_dtype!r}), got {index_cache.dtype} "
                         f"{tuple(index_cache.shape)}")
    if index_cache.shape[1] != block_size:
        raise ValueError(f"{arg}: pages of {index_cache.shape[1]} tokens, but the latent cache's block_size is "
                         f"{block_size}; one block id names a page of each, so the index cache's page size must "
                         f"be {block_size} (else the indexer scores other tokens' keys)")
    width = index_cache.shape[2]
    if not fmt.quantized:
        ok = width == D
        want = f"{D} (index_head_dim)"
    else:  # D e4m3 bytes then D/Q fp32 scales per token, Q a divisor of D
        extra = width - D
        ok = extra > 0 and extra % 4 == 0 and D % (extra // 4) == 0
        want = f"index_head_dim + 4 * index_head_dim / Q bytes = {D + 4} for Q = {D} (one scale per token)"
    if not ok:
        raise ValueError(f"{arg}: rows of {width} {index_cache.dtype} elements, expected {want} "
                         f"(index_cache_dtype={cfg.index_cache_dtype!r}, index_head_dim={D})")
    if fmt.quantized and not index_cache[0].is_contiguous():
        raise ValueError(f"{arg}: fp8 pages must be contiguous (values then scales)")
    if kv_cache is not None and index_cache.shape[0] < kv_cache.shape[0]:
        raise ValueError(f"{arg}: {index_cache.shape[0]} blocks, fewer than the latent cache's "
                         f"{kv_cache.shape[0]}; every block id of the latent cache names an index page too")
    if kv_cache is not None and index_cache.device != kv_cache.device:
        raise ValueError(f"{arg}: on {index_cache.device}, expected the latent cache's device {kv_cache.device}")
