"""mla_ext behind Hugging Face transformers' MLA attention modules: every MLA
family transformers 5.23 ships (mla_ext.config.families: deepseek_v2, deepseek_v3,
deepseek_v32, axk1, axk2, bailing_hybrid, dots3_note, glm4_moe_lite, glm5_next,
glm_moe_dsa, hy_v4, kimi_linear, longcat_flash, minicpm3, mistral4,
mistral_large4, youtu).

The family is read from the module's config (`model_type`) and checked against
the module's class; what differs between families is either in the config
(dims, per-layer dims, no-rope and KV-sharing layers: mla_ext.config.models), in the
small table mla_ext.config.families (yarn in the scale or not, sinks, sparse, sliding
windows), or computed by the module's own code: q, kv_c_normed and k_pe are what
the module's forward hands its cache and its attention function
(transformers_capture.py), so LoRA or not, latent rescales, k_pe norms, rope
styles and query temperatures are the family's own. Sparse (DSA) layers whose
indexer mla_ext computes (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`: the
indexer is detected on the module) run sparse past `index_topk`: the indexer's
inputs come from the same forward (what the module hands `module.indexer`), its
keys go to a paged index cache passed beside the latent cache (`index_cache=`),
and MLAPrefill selects and attends (mla_ext/sparse). What mla_ext cannot compute
is refused by name: a layer of another sparse family whose queries would see
more than `index_topk` keys, a sliding-window layer past its window.

For DeepSeek-V2/V3 (models/deepseek_v2, models/deepseek_v3), for example, per token:

    q       = q_proj(x)                                  (no q LoRA: V2-Lite)
            | q_b_proj(q_a_layernorm(q_a_proj(x)))       (q LoRA: V2, V3)
    kv_c, k_pe = split(kv_a_proj_with_mqa(x), [L, R])
    kv_c_normed = kv_a_layernorm(kv_c)
    q_pe, k_pe = rope(q_pe, k_pe)   V2: complex rotation of interleaved pairs
                                     V3: rotate_half, or the interleaved variant
                                         when config.rope_interleave (the default)

then up-project the latents with kv_b_proj and attend with `module.scaling`
(the yarn-corrected scale). This module builds an `MLAPrefill` for such a module
(dims, softmax scale and dtype from its config and weights, kv_b_proj weight
format from the module, layer index from `module.layer_idx`) and produces the
new tokens' `q [T, N, P+R]`, `kv_c_normed [T, L]`, `k_pe [T, R]` with the
module's own projections, layernorms and rotary functions (looked up in the
module's own transformers file, so they follow the installed version).

    layer = TransformersMLA(model.model.layers[i].self_attn, CacheConfig("fp8_ds_mla"))
    layer.write_cache(ctx_hidden, ctx_positions, kv_cache, ctx_slots)   # context tokens
    out = layer(new_hidden, new_positions, kv_cache, PrefillMetadata(...))   # [T, N, V]
    y = layer.o_proj(out)                                                # [T, hidden]

the same for every family; a DSA layer also takes its index cache the same way
(`layer.index_cache_spec.cache_shape(num_blocks)`, same block ids and block size):

    layer = TransformersMLA(attn, CacheConfig("fp8_ds_mla"), index_cache_dtype="fp8")
    layer.write_cache(ctx_hidden, ctx_positions, kv_cache, ctx_slots, index_cache=index_cache)
    out = layer(new_hidden, new_positions, kv_cache, meta, index_cache=index_cache)

The softmax scale is never passed by hand: it is `MLAModelConfig.softmax_scale`
derived from the config (SPEC §10), and building a layer fails if it disagrees
with the module's own `scaling`.

`reference_attention` runs the module's own forward over whole sequences (causal)
and returns its attention's output (the input of its output gate, if any, and
o_proj), optionally with the context positions' latents replaced by what a paged
cache holds: the check used by the tests and the demo.

The attention output returned is the input of what follows the attention in the
module (an output gate where the family has one: bailing_hybrid, axk2,
dots3_note; then o_proj).

transformers is imported lazily (it is a test dependency, not a runtime one).
"""
from __future__ import annotations

import copy
import importlib
import math
import sys
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mla_ext.config.families import FAMILIES, Family, family_of
from mla_ext.integrations.transformers_capture import run_module
from mla_ext.integrations.transformers_random import randomize_
from mla_ext.kv_b_proj.from_module import weight_format_from_module
from mla_ext.kv_b_proj.shard import shard_for
from mla_ext.kv_b_proj.weights import WeightFormat
from mla_ext.config.models import MLAModelConfig, config_from_dict
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.synthetic import SyntheticBatch
from mla_ext.integrations import transformers_indexer as sparse_tx
from mla_ext.sparse.index_cache import IndexCacheSpec, get_index_format, write_index_cache
from mla_ext.prefill.sparse import IndexInputs, SparseConfig

# Attention class -> (its transformers module, its rotary embedding class or None).
SUPPORTED = {
    f.attention: (f"transformers.models.{f.module}.modeling_{f.module}", None)
    for f in FAMILIES.values()
}


class MLAInputs(NamedTuple):
    """One batch of tokens as MLAPrefill takes them (RoPE applied)."""

    q: Tensor  # [T, N, P+R]
    kv_c_normed: Tensor  # [T, L]
    k_pe: Tensor  # [T, R]


class DSAInputs(NamedTuple):
    """A DSA layer's tokens: MLAInputs' three and the indexer's inputs (q_I, w, k_I; cache None)."""

    q: Tensor  # [T, N, P+R]
    kv_c_normed: Tensor  # [T, L]
    k_pe: Tensor  # [T, R]
    index: IndexInputs


def _import(module_path: str):
    try:
        return importlib.import_module(module_path)
    except ImportError as exc:
        raise ImportError(
            f"mla_ext.integrations.transformers_deepseek needs transformers ({module_path} "
            f"could not be imported: {exc}); install the version pinned in requirements.txt"
        ) from exc


def family_of_module(module) -> Family:
    """The module's MLA family (mla_ext.config.families), from its config's model_type,
    checked against its class; a ValueError naming what it is otherwise."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected a transformers MLA attention module (one of "
                         f"{', '.join(sorted(FAMILIES))}), got {type(module).__name__}")
    where = type(module).__module__
    cfg = getattr(module, "config", None)
    family = family_of(getattr(cfg, "model_type", None))
    if where.startswith("transformers.") and family is not None:
        lib = _import(f"transformers.models.{family.module}.modeling_{family.module}")
        if isinstance(module, getattr(lib, family.attention)):
            return family
    said = f" (config model_type {cfg.model_type!r})" if getattr(cfg, "model_type", None) else ""
    raise ValueError(
        f"module: {type(module).__name__} (from {where}){said} is not supported; expected "
        f"the MLA attention module of a transformers family: "
        + ", ".join(f"{f.model_type} ({f.attention})" for f in FAMILIES.values())
    )


def attention_kind(module) -> str:
    """The module's attention class name (e.g. 'DeepseekV3Attention'); a ValueError
    for anything that is not an MLA family's attention module."""
    return family_of_module(module).attention


def _check_module(module) -> str:
    family = family_of_module(module)
    kind = family.attention
    n = _layer_attr(module, "num_attention_heads")
    n_kv = _layer_attr(module, "num_key_value_heads")
    if n_kv not in (None, n):
        raise ValueError(
            f"{kind} layer {module.layer_idx}: num_key_value_heads={n_kv} differs from "
            f"num_attention_heads={n}; MLA up-projects one latent to every head "
            "(kv_b_proj), so the two must be equal"
        )
    if module.num_heads != n:
        raise ValueError(f"{kind} layer {module.layer_idx}: the module has {module.num_heads} "
                         f"heads but its config {n}")
    # A no-rope layer (mistral_large4's `no_rope_layers`) moves its rope width into
    # the nope part: its module's R/P differ from the config's by design (the
    # per-layer dims in mla_ext.config.models follow the same rule).
    per_layer_rope = getattr(getattr(module, "config", None), "no_rope_layers", None) is not None
    for attr in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if per_layer_rope and attr in ("qk_rope_head_dim", "qk_nope_head_dim"):
            continue
        # mla_ext plans from the config, mla_inputs splits with the module's attributes.
        have, want = getattr(module, attr, None), _layer_attr(module, attr)
        if have is not None and want is not None and have != want:
            raise ValueError(f"{kind} layer {module.layer_idx}: module.{attr}={have} but its config says "
                             f"{attr}={want}; the module and its config must agree")
    if getattr(module.kv_b_proj, "bias", None) is not None:
        raise ValueError(f"{kind} layer {module.layer_idx}: kv_b_proj has a bias; mla_ext's "
                         "up-projection has none (DeepSeek checkpoints have none)")
    return kind


def _layer_attr(module, name: str):
    """A config attribute as the module's layer sees it: its per_layer_config entry
    where the config has per-layer values (dots3_note's sliding layers), else the
    config's own (None when it has none)."""
    cfg = module.config
    per_layer = getattr(cfg, "per_layer_config", None)
    if per_layer is not None and module.layer_idx is not None:
        try:
            return getattr(per_layer[module.layer_idx], name)
        except (AttributeError, KeyError, IndexError, TypeError):
            pass
    return getattr(cfg, name, None)


def module_dtype(module) -> torch.dtype:
    """The dtype the module's activations are in: that of a norm's weight (a norm is
    never quantized, unlike the linears of an fp8 checkpoint): kv_a_layernorm, or
    q_a_layernorm / o_proj on a layer that reads another's KV (no kv_a_layernorm)."""
    for name in ("kv_a_layernorm", "q_a_layernorm"):
        norm = getattr(module, name, None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            return norm.weight.dtype
    return module.o_proj.weight.dtype


def model_config_from_module(module, name: str | None = None) -> MLAModelConfig:
    """The module's MLA dims and softmax scale from its config
    (`mla_ext.config.models.config_from_dict(config.to_dict())`), in the dtype its
    weights really have (a model cast after loading no longer has its config's dtype)."""
    kind = _check_module(module)
    cfg = module.config
    name = name or f"{cfg.model_type} {getattr(cfg, 'name_or_path', '') or kind}".strip()
    model = config_from_dict(cfg.to_dict(), name=name)
    dtype = module_dtype(module)
    if dtype != model.model_dtype or model.dtype_source.startswith("assumed"):
        said = "" if model.dtype_source.startswith("assumed") else \
            f"; the config says {str(model.model_dtype).removeprefix('torch.')}"
        model = replace(model, model_dtype=dtype,
                        dtype_source=f"the module's weights ({kind}.kv_a_layernorm){said}")
    index = module.layer_idx if module.layer_idx is not None else 0
    if not 0 <= index < model.num_layers:
        raise ValueError(f"{kind}: layer_idx {index} is out of range for its config's "
                         f"{model.num_layers} layers")
    mine = model.for_layer(index)
    # The module's own dims must be its config's (a module edited after building
    # would otherwise fail later, in a torch.split, without naming anything).
    for attr, ours in (("kv_lora_rank", mine.L), ("qk_rope_head_dim", mine.R),
                       ("qk_nope_head_dim", mine.P), ("v_head_dim", mine.V)):
        theirs = getattr(module, attr, None)
        if theirs is not None and theirs != ours:
            raise ValueError(f"{kind} layer {index}: module.{attr}={theirs} disagrees with its "
                             f"config ({ours} for this layer); the module and config differ")
    scaling = getattr(module, "scaling", None)
    if scaling is not None and not math.isclose(mine.softmax_scale, scaling, rel_tol=1e-9):
        raise ValueError(
            f"{kind} layer {index}: the softmax scale derived from the config "
            f"({mine.softmax_scale!r}: {mine.softmax_scale_source}) differs from the "
            f"module's own scaling {scaling!r}; the config and the module disagree"
        )
    return model


def kv_b_proj_weight(module) -> WeightFormat:
    """The module's kv_b_proj as an mla_ext weight format (an nn.Linear, or a
    checkpoint-style quantized layer: see mla_ext.kv_b_proj.from_module), in the
    module's dtype."""
    return weight_format_from_module(module.kv_b_proj, module_dtype(module), arg="kv_b_proj")


def prefill_from_module(module, cache_config: CacheConfig, *,
                        kv_b_proj: WeightFormat | None = None, layer: int | None = None,
                        model: MLAModelConfig | None = None, tp_size: int = 1, tp_rank: int = 0,
                        **prefill_kwargs) -> MLAPrefill:
    """An `MLAPrefill` for a transformers DeepSeek-V2/V3 attention module.

    Dims, softmax scale and dtype from `model_config_from_module(module)` (or `model`,
    a full-model config); kv_b_proj from the module (or `kv_b_proj`, e.g. a quantized
    format of the same weight); the layer index from `module.layer_idx` (or `layer`).
    With tp_size > 1 the layer is tensor-parallel rank `tp_rank`'s: heads
    [rank*n, (rank+1)*n) with n = num_heads / tp_size, and those heads' kv_b_proj rows.
    Other keyword arguments go to MLAPrefill (workspace_rows_override, max_num_seqs,
    ...); the softmax scale is not one of them."""
    if "softmax_scale" in prefill_kwargs:
        raise ValueError("softmax_scale: not taken here; the scale is derived from the "
                         "module's config (SPEC §10)")
    model = model if model is not None else model_config_from_module(module)
    index = layer if layer is not None else module.layer_idx
    if index is None:
        raise ValueError(f"{type(module).__name__}: layer_idx is None; pass layer=")
    weight = kv_b_proj if kv_b_proj is not None else kv_b_proj_weight(module)
    if tp_size != 1:
        model = model.shard(tp_size, tp_rank)
        weight = shard_for(weight_format_from_module(weight, arg="kv_b_proj"),
                           model.for_layer(index))
    sinks = getattr(module, "sinks", None) if family_of_module(module).sinks else None
    if sinks is not None:
        n = model.for_layer(index).num_heads
        sinks = sinks.detach().float()[model.tp_rank * n:(model.tp_rank + 1) * n]
    # A DSA module mla_ext runs sparse is sparse here too (bfloat16 index cache unless `sparse=` says
    # otherwise), whatever its model config says: never a dense layer past index_topk.
    prefill_kwargs.setdefault("sparse", _sparse_config(module, None))
    return MLAPrefill(model, cache_config, weight, layer=index, sinks=sinks, **prefill_kwargs)


def rotary_embedding_for(module) -> nn.Module | None:
    """A rotary embedding for the module's config (transformers keeps it in the model,
    `model.model.rotary_emb`, not in the attention module), on the module's device;
    None for a family without one (kimi_linear, glm5_next)."""
    family = family_of_module(module)
    lib = _import(SUPPORTED[family.attention][0])
    prefix = family.attention.removesuffix("Attention").removesuffix("MLA")
    cls = getattr(lib, f"{prefix}RotaryEmbedding", None)
    if cls is None:
        return None
    device = next(module.parameters()).device
    return cls(config=module.config).to(device)


def _batched(module, hidden_states: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """[T, H] + [T] (one flat batch of tokens) or [B, S, H] + [B, S] / [S] -> [B, S, H], [B, S]."""
    hidden = module.config.hidden_size
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() not in (2, 3) \
            or hidden_states.shape[-1] != hidden:
        raise ValueError(f"hidden_states: expected [T, {hidden}] or [B, S, {hidden}], got "
                         f"{tuple(getattr(hidden_states, 'shape', ())) or type(hidden_states).__name__}")
    dtype = module_dtype(module)
    if hidden_states.dtype != dtype:
        raise ValueError(f"hidden_states: expected the module's dtype {dtype}, got "
                         f"{hidden_states.dtype}")
    x = hidden_states if hidden_states.dim() == 3 else hidden_states[None]
    B, S = x.shape[:2]
    pos = position_ids
    if not isinstance(pos, Tensor) or pos.dtype.is_floating_point or pos.dtype == torch.bool \
            or pos.is_complex():
        raise ValueError("position_ids: expected an integer tensor")
    if pos.dim() == 1 and pos.shape[0] == S:
        pos = pos[None].expand(B, S)
    if tuple(pos.shape) != (B, S):
        raise ValueError(f"position_ids: expected [{S}] or [{B}, {S}] for hidden_states "
                         f"{tuple(hidden_states.shape)}, got {tuple(position_ids.shape)}")
    if pos.device != x.device:
        raise ValueError(f"position_ids: expected device {x.device} (as hidden_states), "
                         f"got {pos.device}")
    return x, pos


def _flat(t: Tensor) -> Tensor:
    """[B, 1, S, D] latents -> [B*S, D] (D may be 0: no rope part)."""
    return t.reshape(t.shape[0] * t.shape[2], t.shape[-1]).contiguous()


def mla_inputs(module, hidden_states: Tensor, position_ids: Tensor, *,
               rotary_emb: nn.Module | None = None,
               shared_kv: dict | None = None) -> MLAInputs:
    """q [T, N, P+R], kv_c_normed [T, L], k_pe [T, R] of the tokens, as the module's
    own forward hands them to its cache and its attention (T = B*S, batch-major).

    hidden_states [T, H] with position_ids [T], or [B, S, H] with [B, S] (or [S]).
    rotary_emb: the model's rotary embedding (`model.model.rotary_emb`); built from
    the config when not given. shared_kv: for a layer that reads another layer's KV
    (mistral_large4), the `shared_kv_states` dict its source layer filled; the
    latents returned are then the source's."""
    kind = _check_module(module)
    x, pos = _batched(module, hidden_states, position_ids)
    key = "rope" if getattr(module, "use_rope", True) else "nope"
    if getattr(module, "is_kv_shared_layer", False) and key not in (shared_kv or {}):
        raise ValueError(f"{kind} layer {module.layer_idx} reads another layer's KV "
                         f"(KV sharing): pass shared_kv, the shared_kv_states its source "
                         f"layer filled (key {key!r})")
    rotary = rotary_emb if rotary_emb is not None else rotary_embedding_for(module)
    got = run_module(module, x, pos, rotary, reference=False, shared_kv=shared_kv,
                     mask=family_of_module(module).mask)
    latents = got.latents if got.latents is not None else shared_kv[key]
    q = got.query.transpose(1, 2)  # [B, S, N, P+R]
    q = q.reshape(-1, q.shape[-2], q.shape[-1]).contiguous()
    return MLAInputs(q, _flat(latents[0]), _flat(latents[1]))


def reference_attention(module, hidden_states: Tensor, position_ids: Tensor, *,
                        rotary_emb: nn.Module | None = None,
                        context_latents: tuple[Tensor, Tensor] | None = None,
                        shared_kv: dict | None = None) -> Tensor:
    """transformers' own attention over whole sequences: the module's forward with a
    causal mask (its own sinks, sparse index mask, ...); returns the attention's
    output, the input of the module's output gate / o_proj, as [B*S, N, V].

    context_latents (kv_c, k_pe), each [C, .] (one sequence) or [B, C, .]: the latents
    of the first C positions as a paged cache holds them (the k_pe with RoPE applied,
    in the module's rotary layout); the module then attends to those instead of its own.
    shared_kv: as in mla_inputs (a KV-sharing layer's source latents, [B, 1, S, .]).
    Run the module in eval mode (attention dropout is applied in training mode)."""
    _check_module(module)
    x, pos = _batched(module, hidden_states, position_ids)
    B, S = x.shape[:2]
    rotary = rotary_emb if rotary_emb is not None else rotary_embedding_for(module)
    context = None
    if context_latents is not None:
        kv_c, k_pe = (t if t.dim() == 3 else t[None] for t in context_latents)
        C = kv_c.shape[1]
        if kv_c.shape[0] != B or tuple(k_pe.shape[:2]) != (B, C) or C > S:
            raise ValueError(f"context_latents: expected [{B}, C <= {S}, .] (or [C, .] for one "
                             f"sequence), got {tuple(context_latents[0].shape)} and "
                             f"{tuple(context_latents[1].shape)}")
        context = (kv_c, k_pe)
        if shared_kv:  # a KV-sharing layer attends to its source's stored latents
            shared_kv = {key: _with_context(v, context) for key, v in shared_kv.items()}
    got = run_module(module, x, pos, rotary, reference=True, context=context, shared_kv=shared_kv,
                     mask=family_of_module(module).mask)
    out = got.output  # [B, S, N, V]
    return out.reshape(B * S, out.shape[-2], out.shape[-1])


def _with_context(latents: tuple[Tensor, Tensor], context: tuple[Tensor, Tensor]):
    """Shared latents ([B, 1, S, .] pair) with the first C positions replaced."""
    k, v = latents[0].clone(), latents[1].clone()
    C = context[0].shape[1]
    k[:, 0, :C] = context[0].to(k.dtype)
    v[:, 0, :C] = context[1].to(v.dtype)
    return k, v


class TransformersMLA:
    """One transformers MLA attention layer (any family in mla_ext.config.families) served
    by mla_ext's prefill.

    `prefill` is the layer's MLAPrefill (`prefill.explain()` prints its plan);
    `inputs` computes q / kv_c_normed / k_pe (and a DSA layer's indexer inputs) with
    the module's own code; calling the object runs prefill-with-context for new
    tokens whose context is already in the paged cache, returning [T, N, V] (the
    input of the module's output gate / o_proj). `family` is the module's
    mla_ext.config.families entry; `kv_source` the layer whose cache this one reads (KV
    sharing) or None; `max_keys` the most keys a query may see here (a sliding
    layer's window, the index_topk of a sparse layer mla_ext cannot run sparse) or
    None: past it the layer refuses rather than compute dense attention.

    A DSA layer (deepseek_v32, glm_moe_dsa: `sparse` is its SparseConfig) runs sparse
    past index_topk: it takes its paged index cache (`index_cache_spec`, in
    `index_cache_dtype`) as `index_cache=` in write_cache and forward, as it takes the
    latent cache; a GLM-5 "shared" layer (no indexer) takes the previous full layer's
    `last_selection` as `selection=`."""

    def __init__(self, module, cache_config: CacheConfig, *, kv_b_proj: WeightFormat | None = None,
                 rotary_emb: nn.Module | None = None, layer: int | None = None,
                 tp_size: int = 1, tp_rank: int = 0, index_cache_dtype: str | None = None,
                 **prefill_kwargs):
        self.module = module
        self.family = family_of_module(module)
        sparse = _sparse_config(module, index_cache_dtype)
        if "sparse" in prefill_kwargs:
            raise ValueError("sparse: not taken here; a DSA layer's SparseConfig is read from its module "
                             "(pass index_cache_dtype= for its index cache format)")
        self.prefill = prefill_from_module(module, cache_config, kv_b_proj=kv_b_proj, layer=layer,
                                           tp_size=tp_size, tp_rank=tp_rank, sparse=sparse, **prefill_kwargs)
        self.model = self.prefill.model
        self.sparse = sparse
        # The indexer's weights (None: a dense layer, or a GLM-5 "shared" layer reusing a selection).
        self.indexer = (sparse_tx.IndexerParams.from_module(module)
                        if sparse is not None and getattr(module, "indexer", None) is not None else None)
        n = self.model.num_heads
        self.heads = slice(self.model.tp_rank * n, (self.model.tp_rank + 1) * n)
        self.rotary_emb = rotary_emb if rotary_emb is not None else rotary_embedding_for(module)
        index = self.prefill.layer_index
        self.kv_source = model_config_from_module(module).kv_source(index)
        self.max_keys, self.limit_reason = _key_limit(module, self.family, sparse is not None)

    @property
    def index_cache_spec(self) -> IndexCacheSpec | None:
        """A DSA layer's index cache (shape, dtype, page bytes: `.cache_shape(num_blocks)`), pages
        of the latent cache's block size; None for a layer that keeps none."""
        if self.indexer is None:
            return None
        D, fmt = self.sparse.index_head_dim, self.sparse.index_cache_dtype
        q = D if get_index_format(fmt).quantized else None  # one fp32 scale per token (vLLM's layout)
        return IndexCacheSpec(self.prefill.layer_index, fmt, D, self.prefill.spec.block_size, q)

    @property
    def last_selection(self) -> Tensor | None:
        """The positions the last sparse forward attended (int32 [T, index_topk], -1 padded): what a
        GLM-5 "shared" layer takes as `selection=`."""
        return getattr(self.prefill, "last_selection", None)

    def explain(self, device=None) -> str:
        """The layer's plan (MLAPrefill.explain) with its family and limits."""
        f, i = self.family, self.prefill.layer_index
        if self.max_keys is not None:
            limit = (f"  dense attention equals this layer's up to {self.max_keys} keys per query "
                     f"({self.limit_reason}); refused past it")
        elif self.sparse is not None:
            limit = (f"  sparse past index_topk={self.sparse.index_topk}: "
                     + ("its indexer selects (index cache passed as index_cache=)" if self.indexer is not None
                        else "no indexer: attends the selection passed as selection= (a GLM-5 shared layer)"))
        else:
            limit = "  dense attention: no key limit"
        lines = [f"{f.model_type} ({f.attention}) layer {i}" + (f": {f.note}" if f.note else ""), limit,
                 f"  reads layer {self.kv_source}'s KV cache (KV sharing)"
                 if self.kv_source is not None else "  keeps its own KV cache"]
        return "\n".join(lines + [self.prefill.explain(device)])

    def check_lengths(self, metadata: PrefillMetadata) -> None:
        """Refuses a batch whose queries would see more keys than this layer's dense
        attention equals the family's (sliding: the window; sparse where mla_ext has no
        indexer for the family: index_topk)."""
        if self.max_keys is None:
            return
        for r, (c, q) in enumerate(zip(metadata.context_lens, metadata.query_lens)):
            if c + q > self.max_keys:
                raise ValueError(
                    f"{self.family.model_type} layer {self.prefill.layer_index}: request {r} has "
                    f"{c} context + {q} new tokens = {c + q} keys for its last query, more than "
                    f"{self.limit_reason}; mla_ext computes dense attention, which equals "
                    f"this layer's only up to {self.max_keys} keys")

    def inputs(self, hidden_states: Tensor, position_ids: Tensor,
               shared_kv: dict | None = None) -> MLAInputs | DSAInputs:
        """The tokens' MLA inputs; q of this rank's heads only (`self.heads`); a layer with a DSA
        indexer gives DSAInputs, its indexer inputs in `.index` (from what the same forward hands
        its indexer).
        shared_kv: see `mla_inputs` (layers that read another layer's KV)."""
        with sparse_tx.indexer_inputs_captured(self.module) as seen:
            x = mla_inputs(self.module, hidden_states, position_ids, rotary_emb=self.rotary_emb,
                           shared_kv=shared_kv)
        if self.indexer is not None:
            q, k, w = sparse_tx.indexer_inputs_from(self.indexer, seen, x.q.dtype)
            x = DSAInputs(*x, IndexInputs(q, w, k, None))
        if self.model.tp_size == 1:
            return x
        return x._replace(q=x.q[:, self.heads].contiguous())

    def _write(self, x, kv_cache: Tensor, slot_mapping: Tensor, k_scale, index_cache) -> None:
        self.prefill.write_cache(x.kv_c_normed, x.k_pe, kv_cache, slot_mapping, k_scale)
        if isinstance(x, DSAInputs):
            write_index_cache(x.index.k, index_cache, slot_mapping, self.sparse.index_cache_dtype)

    def _check_index_cache(self, index_cache, kv_cache: Tensor, what: str) -> None:
        """index_cache is given exactly where the layer keeps one, and fits its latent plan."""
        if self.indexer is None:
            if index_cache is not None:
                kind = "is dense" if self.sparse is None else "has no indexer (a GLM-5 shared layer)"
                raise ValueError(f"index_cache: {self.family.model_type} layer {self.prefill.layer_index} {kind}; "
                                 f"it keeps no index cache (pass None to {what})")
            return
        if index_cache is None:
            raise ValueError(f"index_cache: {self.family.model_type} layer {self.prefill.layer_index} is sparse "
                             f"(index_topk={self.sparse.index_topk}); {what} needs its paged index cache "
                             f"(index_cache_spec: {self.index_cache_spec.cache_shape(kv_cache.shape[0])} "
                             f"{self.index_cache_spec.storage_dtype})")
        self.prefill.check_index_cache(index_cache, kv_cache)

    @torch.no_grad()
    def write_cache(self, hidden_states: Tensor, position_ids: Tensor, kv_cache: Tensor,
                    slot_mapping: Tensor, k_scale: Tensor | None = None, *,
                    index_cache: Tensor | None = None) -> MLAInputs | DSAInputs:
        """Computes the tokens' latents and stores them in the layer's cache format (and a DSA
        layer's indexer keys in `index_cache`, same slots)."""
        self._owns_kv("write_cache")
        self._check_index_cache(index_cache, kv_cache, "write_cache")
        x = self.inputs(hidden_states, position_ids)
        self._write(x, kv_cache, slot_mapping, k_scale, index_cache)
        return x

    @torch.no_grad()
    def forward(self, hidden_states: Tensor, position_ids: Tensor, kv_cache: Tensor,
                metadata: PrefillMetadata, *, slot_mapping: Tensor | None = None,
                k_scale: Tensor | None = None, workspace: Tensor | None = None,
                shared_kv: dict | None = None, index_cache: Tensor | None = None,
                selection: Tensor | None = None) -> Tensor:
        """New tokens (hidden_states [T, H], position_ids [T], requests in metadata order)
        -> [T, N, V]. With slot_mapping, the new tokens are also stored in the cache
        (as a serving engine does before attention; their slots are past each context).
        A layer that reads another layer's KV (`kv_source`) takes that layer's cache
        as kv_cache and its new tokens' latents through `shared_kv` (the dict
        {"rope" | "nope": ([1, 1, T, L], [1, 1, T, R])} its source filled).
        A DSA layer takes its paged index cache as `index_cache` (required where it has an
        indexer), or a selection made before (`selection`, int32 [T, K]: another layer's
        `last_selection`; required by a GLM-5 shared layer past index_topk)."""
        self.check_lengths(metadata)
        if slot_mapping is not None:
            self._owns_kv("forward(slot_mapping=)")
        if self.sparse is None and selection is not None:
            raise ValueError(f"selection: {self.family.model_type} layer {self.prefill.layer_index} is dense; "
                             "it takes no selection")
        self._check_index_cache(index_cache, kv_cache, "forward")
        x = self.inputs(hidden_states, position_ids, shared_kv=shared_kv)
        if slot_mapping is not None:
            self._write(x, kv_cache, slot_mapping, k_scale if k_scale is not None else metadata.k_scale,
                        index_cache)
        index = selection
        if index is None and isinstance(x, DSAInputs):
            index = IndexInputs(x.index.q, x.index.weights, x.index.k, index_cache)
        if index is None and self.sparse is not None \
                and self.sparse.drops(metadata.context_lens, metadata.query_lens):
            raise ValueError(f"selection: {self.family.model_type} layer {self.prefill.layer_index} has no indexer "
                             f"(a GLM-5 'shared' layer) and a request has more than index_topk="
                             f"{self.sparse.index_topk} tokens; pass the previous full layer's last_selection")
        return self.prefill(x.q, x.kv_c_normed, x.k_pe, kv_cache, metadata, k_scale=k_scale,
                            workspace=workspace, index=index)

    __call__ = forward

    def _owns_kv(self, what: str) -> None:
        if self.kv_source is not None:
            raise ValueError(f"{self.family.model_type} layer {self.prefill.layer_index}: {what} "
                             f"refused: this layer reads layer {self.kv_source}'s KV cache (KV "
                             f"sharing) and stores none; write through layer {self.kv_source}")

    def o_proj(self, out: Tensor) -> Tensor:
        """The module's output projection of a [T, N, V] attention output -> [T, hidden]
        (all heads: with tensor parallelism, gather the ranks' outputs first). Refused
        for a family with an output gate between the two (bailing_hybrid, axk2,
        dots3_note): that gate depends on the hidden states and is the module's."""
        if self.family.output_gate:
            raise ValueError(f"{self.family.model_type}: o_proj alone would skip the module's "
                             "output gate (sigmoid of a projection of the hidden states, applied "
                             "to the attention output first); apply the module's gate, then "
                             "module.o_proj")
        return self.module.o_proj(out.reshape(out.shape[0], -1))


def _sparse_config(module, index_cache_dtype: str | None) -> SparseConfig | None:
    """The SparseConfig of a DSA module mla_ext runs sparse (its class has an indexer mla_ext
    computes: mla_ext.integrations.transformers_indexer.INDEXER_ROPE_INTERLEAVED), in `index_cache_dtype`
    (default bfloat16; checked); None for any other module, which keeps no index cache (so one call
    with index_cache_dtype= serves every family: the format applies where there is an indexer)."""
    if type(module).__name__ not in sparse_tx.INDEXER_ROPE_INTERLEAVED:
        if index_cache_dtype is not None:
            get_index_format(index_cache_dtype)  # a misspelt format is an error on every module
        return None
    sparse = SparseConfig.from_config(module.config, index_cache_dtype=index_cache_dtype or "bfloat16")
    if sparse is None:
        raise ValueError(f"{type(module).__name__}: its config has no index_topk / index_n_heads / "
                         "index_head_dim; a DSA module's config carries them")
    return sparse


def _key_limit(module, family: Family, runs_sparse: bool) -> tuple[int | None, str]:
    """(the most keys a query may see for dense attention to equal the layer's, why): a sparse
    layer mla_ext cannot run sparse (another family's indexer) is limited to index_topk."""
    cfg = module.config
    limits = []
    indexed = getattr(module, "indexer", None) is not None or (family.sparse and getattr(module, "skip_topk", False))
    if indexed and not runs_sparse:
        topk = getattr(cfg, "index_topk", None)
        if topk is not None:
            limits.append((int(topk), f"index_topk={topk} (sparse attention: each query "
                                      "attends to its top index_topk keys only)"))
    window = getattr(module, "sliding_window", None)
    if window is not None:
        limits.append((int(window), f"sliding_window={window} (this layer attends within a "
                                    "window)"))
    if not limits:
        return None, ""
    return min(limits)


def random_attention(version: str = "v3", *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     hidden_size: int = 64, num_heads: int = 2, kv_lora_rank: int = 512,
                     qk_rope_head_dim: int = 64, qk_nope_head_dim: int = 32, v_head_dim: int = 32,
                     q_lora_rank: int | None = 48, rope_parameters: dict | None = None,
                     layer_idx: int = 1, num_layers: int = 3, **config_kwargs):
    """A tiny transformers DeepseekV2Attention ("v2") / DeepseekV3Attention ("v3") with
    random weights, built locally (no hub), in eval mode: linears with unit-variance
    outputs (q projections x2, so attention is peaked), RMSNorm gains around 1.
    The V3 config records `dtype`; a V2 config gets one only through config_kwargs."""
    kinds = {"v2": "DeepseekV2", "v3": "DeepseekV3"}
    if version not in kinds:
        raise ValueError(f"version: expected one of {sorted(kinds)}, got {version!r}")
    name = kinds[version]
    lib = _import(SUPPORTED[f"{name}Attention"][0])
    config_cls = getattr(_import("transformers"), f"{name}Config")
    kw = dict(hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_heads,
              kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
              qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, q_lora_rank=q_lora_rank,
              num_hidden_layers=num_layers, max_position_embeddings=4096,
              attn_implementation="eager", **config_kwargs)
    if rope_parameters is not None:
        kw["rope_parameters"] = rope_parameters
    if version == "v3":
        kw.setdefault("dtype", str(dtype).removeprefix("torch."))
    module = getattr(lib, f"{name}Attention")(config_cls(**kw), layer_idx=layer_idx)
    return randomize_(module, seed).to(dtype).eval()


class SideBySide(NamedTuple):
    """One batch through mla_ext and through transformers (see prefill_beside_transformers)."""

    out: Tensor  # mla_ext [T, N, V]
    transformers: Tensor  # the module's own forward, its dtype, [T, N, V]
    exact: Tensor | None  # the module's forward in float64 (None unless asked)
    new: MLAInputs  # what mla_ext was given for the new tokens
    held: tuple[list[Tensor], list[Tensor]]  # per request: the context rows the cache holds (fp32)
    metadata: PrefillMetadata
    k_scale: Tensor | None
    exact_module: nn.Module | None

    def errors(self) -> dict[str, float]:
        """Relative Frobenius errors: mla_ext against transformers in the same dtype,
        against float64, and transformers' own error against float64."""
        e = {"vs_transformers": relative_error(self.out, self.transformers)}
        if self.exact is not None:
            e["vs_fp64"] = relative_error(self.out, self.exact)
            e["transformers_vs_fp64"] = relative_error(self.transformers, self.exact)
        return e


def relative_error(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in float64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def prefill_beside_transformers(layer: TransformersMLA, sequences: list[Tensor], context_lens,
                                *, exact: bool = True, seed: int = 0,
                                source: TransformersMLA | None = None) -> SideBySide:
    """Runs a batch of requests both ways. Request r is `sequences[r]` [ctx_r + q_r, H]
    at positions 0, 1, ...; its first `context_lens[r]` tokens are the context.

    mla_ext: the context tokens' latents are written into a paged cache in the layer's
    format (shuffled block ids; a per-tensor fp8 layer gets the K scale the layer
    computes), then the new tokens of all requests run `layer` in one batch.
    transformers: the module's own forward over each whole sequence (causal), attending
    to the context latents the cache holds where the cache quantizes them; with `exact`
    also a float64 copy of the module whose kv_b_proj is the layer's weight format
    dequantized. The module itself must compute with that weight (for a quantized
    format, give the module the dequantized weight). With tensor parallelism the
    comparison covers the layer's own heads (`layer.heads`). A layer that reads
    another layer's KV needs that layer as `source`: it computes and stores the
    latents, this layer's module reads them as its shared_kv_states."""
    ctx_lens = [int(c) for c in context_lens]
    if len(ctx_lens) != len(sequences):
        raise ValueError(f"context_lens: expected {len(sequences)} entries (one per sequence), "
                         f"got {len(ctx_lens)}")
    q_lens = [s.shape[0] - c for s, c in zip(sequences, ctx_lens)]
    if any(q < 0 for q in q_lens):
        raise ValueError("context_lens: a context is longer than its sequence")
    prefill, module = layer.prefill, layer.module
    device = sequences[0].device
    batch = SyntheticBatch(layer.model, ctx_lens, q_lens, prefill.spec.block_size, device, seed)
    pos = [torch.arange(s.shape[0], device=device) for s in sequences]

    def part(ts, new: bool):
        return torch.cat([t[c:] if new else t[:c] for t, c in zip(ts, ctx_lens)])

    if layer.kv_source is not None and (source is None or source.prefill.layer_index != layer.kv_source):
        raise ValueError(f"source: layer {prefill.layer_index} reads layer {layer.kv_source}'s KV; "
                         f"pass that layer's TransformersMLA as source")
    writer = source if layer.kv_source is not None else layer
    key = "rope" if getattr(module, "use_rope", True) else "nope"

    def shared(src_module, x, p):
        """A KV-sharing layer's shared_kv_states for tokens x (its source's latents)."""
        if layer.kv_source is None:
            return None
        lat = mla_inputs(src_module, x, p)
        return {key: (lat.kv_c_normed[None, None], lat.k_pe[None, None])}

    layer.check_lengths(batch.metadata())
    ctx = writer.inputs(part(sequences, False), part(pos, False))
    k_scale = writer.prefill.compute_kv_scale(ctx.kv_c_normed, ctx.k_pe)
    cache = batch.fill_cache(writer.prefill, ctx.kv_c_normed, ctx.k_pe, k_scale)
    meta = batch.metadata(k_scale)
    x_new, p_new = part(sequences, True), part(pos, True)
    new = layer.inputs(x_new, p_new, shared_kv=shared(writer.module, x_new, p_new))
    out = prefill(new.q, new.kv_c_normed, new.k_pe, cache, meta, k_scale=k_scale)
    held = batch.cached_rows(prefill, cache, k_scale)

    def reference(m, src, rotary) -> Tensor:
        dtype = module_dtype(m)
        outs = []
        for r, (x, p, c) in enumerate(zip(sequences, pos, ctx_lens)):
            lat = (held[0][r], held[1][r]) if prefill.spec.is_quantized and c else None
            outs.append(reference_attention(m, x.to(dtype), p, rotary_emb=rotary,
                                             context_latents=lat,
                                             shared_kv=shared(src, x.to(dtype), p))[c:])
        return torch.cat(outs)

    theirs = reference(module, writer.module, layer.rotary_emb)[:, layer.heads]
    m64 = exact64 = None
    if exact:
        m64 = copy.deepcopy(module).double()
        src64 = copy.deepcopy(writer.module).double() if layer.kv_source is not None else None
        hd = layer.model.P + layer.model.V  # this rank's heads' rows (all of them at TP 1)
        rows = slice(layer.heads.start * hd, layer.heads.stop * hd)
        m64.kv_b_proj.weight[rows] = prefill.kv_b_proj.weight_format.dequantize_fp32().double()
        exact64 = reference(m64, src64, rotary_embedding_for(m64))[:, layer.heads]
    return SideBySide(out, theirs, exact64, new, held, meta, k_scale, m64)
