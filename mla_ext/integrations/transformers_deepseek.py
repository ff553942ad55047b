"""mla_ext behind Hugging Face transformers' DeepSeek-V2/V3 attention modules.

transformers' `DeepseekV2Attention` / `DeepseekV3Attention` (models/deepseek_v2,
models/deepseek_v3) compute, per token, the same MLA inputs this library takes:

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

The softmax scale is never passed by hand: it is `MLAModelConfig.softmax_scale`
derived from the config (SPEC §10), and building a layer fails if it disagrees
with the module's own `scaling`.

`reference_attention` runs the module's own forward over whole sequences (causal)
and returns the input of its o_proj, optionally with the context positions'
latents replaced by what a paged cache holds: the check used by the tests and
the demo.

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

from mla_ext.kv_b_proj.from_module import weight_format_from_module
from mla_ext.kv_b_proj.shard import shard_for
from mla_ext.kv_b_proj.weights import WeightFormat
from mla_ext.models import MLAModelConfig, config_from_dict
from mla_ext.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.synthetic import SyntheticBatch

# Attention class -> (its transformers module, its rotary embedding class).
SUPPORTED = {
    "DeepseekV2Attention": ("transformers.models.deepseek_v2.modeling_deepseek_v2",
                            "DeepseekV2RotaryEmbedding"),
    "DeepseekV3Attention": ("transformers.models.deepseek_v3.modeling_deepseek_v3",
                            "DeepseekV3RotaryEmbedding"),
}


class MLAInputs(NamedTuple):
    """One batch of tokens as MLAPrefill takes them (RoPE applied)."""

    q: Tensor  # [T, N, P+R]
    kv_c_normed: Tensor  # [T, L]
    k_pe: Tensor  # [T, R]


def _import(module_path: str):
    try:
        return importlib.import_module(module_path)
    except ImportError as exc:
        raise ImportError(
            f"mla_ext.integrations.transformers_deepseek needs transformers ({module_path} "
            f"could not be imported: {exc}); install the version pinned in requirements.txt"
        ) from exc


def attention_kind(module) -> str:
    """'DeepseekV2Attention' or 'DeepseekV3Attention'; a ValueError for anything else.

    Other transformers MLA modules (GLM-4-MoE-Lite, MiniCPM3, Kimi-Linear, ...) are
    generated copies of these with their own changes (indexers, rope variants, norms),
    so they are refused rather than assumed to compute the same thing."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module: expected a transformers DeepseekV2Attention or "
                         f"DeepseekV3Attention, got {type(module).__name__}")
    where = type(module).__module__
    if where.startswith("transformers."):
        for name, (path, _) in SUPPORTED.items():
            if isinstance(module, getattr(_import(path), name)):
                return name
    raise ValueError(
        f"module: {type(module).__name__} (from {where}) is not supported; expected "
        f"transformers' {' or '.join(SUPPORTED)} (other MLA variants differ in rope, norms "
        "or sparse indexers and are not assumed to match)"
    )


def _check_module(module) -> str:
    kind = attention_kind(module)
    cfg = module.config
    n, n_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
    if n_kv not in (None, n):
        raise ValueError(
            f"{kind} layer {module.layer_idx}: num_key_value_heads={n_kv} differs from "
            f"num_attention_heads={n}; MLA up-projects one latent to every head "
            "(kv_b_proj), so the two must be equal"
        )
    if module.num_heads != n:
        raise ValueError(f"{kind} layer {module.layer_idx}: the module has {module.num_heads} "
                         f"heads but its config {n}")
    for attr in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        # mla_ext plans from the config, mla_inputs splits with the module's attributes.
        have, want = getattr(module, attr, None), getattr(cfg, attr, None)
        if have is not None and want is not None and have != want:
            raise ValueError(f"{kind} layer {module.layer_idx}: module.{attr}={have} but its config says "
                             f"{attr}={want}; the module and its config must agree")
    if getattr(module.kv_b_proj, "bias", None) is not None:
        raise ValueError(f"{kind} layer {module.layer_idx}: kv_b_proj has a bias; mla_ext's "
                         "up-projection has none (DeepSeek checkpoints have none)")
    return kind


def module_dtype(module) -> torch.dtype:
    """The dtype the module's activations are in: that of kv_a_layernorm's weight
    (a norm is never quantized, unlike the linears of an fp8 checkpoint)."""
    return module.kv_a_layernorm.weight.dtype


def model_config_from_module(module, name: str | None = None) -> MLAModelConfig:
    """The module's MLA dims and softmax scale from its config
    (`mla_ext.models.config_from_dict(config.to_dict())`), in the dtype its
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
    scaling = getattr(module, "scaling", None)
    if scaling is not None and not math.isclose(model.softmax_scale, scaling, rel_tol=1e-9):
        raise ValueError(
            f"{kind} layer {module.layer_idx}: the softmax scale derived from the config "
            f"({model.softmax_scale!r}: {model.softmax_scale_source}) differs from the "
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
        weight = shard_for(weight_format_from_module(weight, arg="kv_b_proj"), model)
    return MLAPrefill(model, cache_config, weight, layer=index, **prefill_kwargs)


def rotary_embedding_for(module) -> nn.Module:
    """A rotary embedding for the module's config (transformers keeps it in the model,
    `model.model.rotary_emb`, not in the attention module), on the module's device."""
    kind = attention_kind(module)
    path, cls_name = SUPPORTED[kind]
    rotary = getattr(_import(path), cls_name)(config=module.config)
    return rotary.to(module.kv_a_layernorm.weight.device)


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


def _rope(module, kind: str, q_rot: Tensor, k_rot: Tensor, pe) -> tuple[Tensor, Tensor]:
    """The module's own rotary application (as in its forward)."""
    lib = sys.modules[type(module).__module__]
    if kind == "DeepseekV2Attention":
        return lib.apply_rotary_emb(q_rot, k_rot, pe.to(q_rot.device))
    cos, sin = pe
    if module.config.rope_interleave:
        return lib.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    return lib.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)


def mla_inputs(module, hidden_states: Tensor, position_ids: Tensor, *,
               rotary_emb: nn.Module | None = None) -> MLAInputs:
    """q [T, N, P+R], kv_c_normed [T, L], k_pe [T, R] of the tokens, computed as the
    module's forward computes them before its cache update (T = B*S, batch-major).

    hidden_states [T, H] with position_ids [T], or [B, S, H] with [B, S] (or [S]).
    rotary_emb: the model's rotary embedding (`model.model.rotary_emb`); built from
    the config when not given."""
    kind = _check_module(module)
    x, pos = _batched(module, hidden_states, position_ids)
    B, S = x.shape[:2]
    N, P, R, L = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank
    rotary = rotary_emb if rotary_emb is not None else rotary_embedding_for(module)
    pe = rotary(x, pos)
    if module.q_lora_rank is None:
        q = module.q_proj(x)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
    q = q.view(B, S, N, P + R).transpose(1, 2)  # [B, N, S, P+R], the module's layout
    q_pass, q_rot = torch.split(q, [P, R], dim=-1)
    kv_c, k_rot = torch.split(module.kv_a_proj_with_mqa(x), [L, R], dim=-1)
    kv_c = module.kv_a_layernorm(kv_c)
    k_rot = k_rot.reshape(B, 1, S, R)
    q_rot, k_rot = _rope(module, kind, q_rot, k_rot, pe)
    q = torch.cat((q_pass, q_rot), dim=-1).transpose(1, 2).reshape(B * S, N, P + R)
    return MLAInputs(q.contiguous(), kv_c.reshape(B * S, L).contiguous(),
                     k_rot.reshape(B * S, R).contiguous())


class _StoredContext:
    """Stands in for a transformers Cache in `module.forward`: `update` hands the
    layer's latents back with the first C positions of each sequence replaced by
    the given ones (what a paged cache holds, e.g. after fp8 rounding)."""

    def __init__(self, kv_c: Tensor, k_pe: Tensor):
        self.kv_c, self.k_pe = kv_c, k_pe  # [B, C, L], [B, C, R]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx, *args, **kwargs):
        C = self.kv_c.shape[1]
        k, v = key_states.clone(), value_states.clone()  # [B, 1, S, L], [B, 1, S, R]
        k[:, 0, :C] = self.kv_c.to(device=k.device, dtype=k.dtype)
        v[:, 0, :C] = self.k_pe.to(device=v.device, dtype=v.dtype)
        return k, v


def reference_attention(module, hidden_states: Tensor, position_ids: Tensor, *,
                        rotary_emb: nn.Module | None = None,
                        context_latents: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """transformers' own attention over whole sequences: the module's forward with a
    causal mask; returns the input of its o_proj as [B*S, N, V].

    context_latents (kv_c, k_pe), each [C, .] (one sequence) or [B, C, .]: the latents
    of the first C positions as a paged cache holds them (the k_pe with RoPE applied,
    in the module's rotary layout); the module then attends to those instead of its own.
    Run the module in eval mode (attention dropout is applied in training mode)."""
    _check_module(module)
    x, pos = _batched(module, hidden_states, position_ids)
    B, S = x.shape[:2]
    rotary = rotary_emb if rotary_emb is not None else rotary_embedding_for(module)
    pe = rotary(x, pos)
    allowed = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    mask = torch.zeros(S, S, dtype=x.dtype, device=x.device).masked_fill(
        ~allowed, torch.finfo(x.dtype).min)[None, None].expand(B, 1, S, S)
    past = None
    if context_latents is not None:
        kv_c, k_pe = (t if t.dim() == 3 else t[None] for t in context_latents)
        C = kv_c.shape[1]
        if kv_c.shape[0] != B or tuple(k_pe.shape[:2]) != (B, C) or C > S:
            raise ValueError(f"context_latents: expected [{B}, C <= {S}, .] (or [C, .] for one "
                             f"sequence), got {tuple(context_latents[0].shape)} and "
                             f"{tuple(context_latents[1].shape)}")
        past = _StoredContext(kv_c, k_pe)
    seen = []
    hook = module.o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        module(hidden_states=x, position_embeddings=pe, attention_mask=mask, past_key_values=past)
    finally:
        hook.remove()
    return seen[0].reshape(B * S, module.num_heads, module.v_head_dim)


class TransformersMLA:
    """One transformers DeepSeek-V2/V3 attention layer served by mla_ext's prefill.

    `prefill` is the layer's MLAPrefill (`prefill.explain()` prints its plan);
    `inputs` computes q / kv_c_normed / k_pe with the module's own code; calling
    the object runs prefill-with-context for new tokens whose context is already in
    the paged cache, returning [T, N, V] (the input of the module's o_proj)."""

    def __init__(self, module, cache_config: CacheConfig, *, kv_b_proj: WeightFormat | None = None,
                 rotary_emb: nn.Module | None = None, layer: int | None = None,
                 tp_size: int = 1, tp_rank: int = 0, **prefill_kwargs):
        self.module = module
        self.prefill = prefill_from_module(module, cache_config, kv_b_proj=kv_b_proj, layer=layer,
                                           tp_size=tp_size, tp_rank=tp_rank, **prefill_kwargs)
        self.model = self.prefill.model
        n = self.model.num_heads
        self.heads = slice(self.model.tp_rank * n, (self.model.tp_rank + 1) * n)
        self.rotary_emb = rotary_emb if rotary_emb is not None else rotary_embedding_for(module)

    def inputs(self, hidden_states: Tensor, position_ids: Tensor) -> MLAInputs:
        """The tokens' MLA inputs; q of this rank's heads only (`self.heads`)."""
        x = mla_inputs(self.module, hidden_states, position_ids, rotary_emb=self.rotary_emb)
        if self.model.tp_size == 1:
            return x
        return x._replace(q=x.q[:, self.heads].contiguous())

    @torch.no_grad()
    def write_cache(self, hidden_states: Tensor, position_ids: Tensor, kv_cache: Tensor,
                    slot_mapping: Tensor, k_scale: Tensor | None = None) -> MLAInputs:
        """Computes the tokens' latents and stores them in the layer's cache format."""
        x = self.inputs(hidden_states, position_ids)
        self.prefill.write_cache(x.kv_c_normed, x.k_pe, kv_cache, slot_mapping, k_scale)
        return x

    @torch.no_grad()
    def forward(self, hidden_states: Tensor, position_ids: Tensor, kv_cache: Tensor,
                metadata: PrefillMetadata, *, slot_mapping: Tensor | None = None,
                k_scale: Tensor | None = None, workspace: Tensor | None = None) -> Tensor:
        """New tokens (hidden_states [T, H], position_ids [T], requests in metadata order)
        -> [T, N, V]. With slot_mapping, the new tokens are also stored in the cache
        (as a serving engine does before attention; their slots are past each context)."""
        x = self.inputs(hidden_states, position_ids)
        if slot_mapping is not None:
            self.prefill.write_cache(x.kv_c_normed, x.k_pe, kv_cache, slot_mapping,
                                     k_scale if k_scale is not None else metadata.k_scale)
        return self.prefill(x.q, x.kv_c_normed, x.k_pe, kv_cache, metadata, k_scale=k_scale,
                            workspace=workspace)

    __call__ = forward

    def o_proj(self, out: Tensor) -> Tensor:
        """The module's output projection of a [T, N, V] attention output -> [T, hidden]
        (all heads: with tensor parallelism, gather the ranks' outputs first)."""
        return self.module.o_proj(out.reshape(out.shape[0], -1))


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
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in module.named_parameters():
            if "layernorm" in pname:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                gain = 2.0 if pname.startswith("q_") else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return module.to(dtype).eval()


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
                                *, exact: bool = True, seed: int = 0) -> SideBySide:
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
    comparison covers the layer's own heads (`layer.heads`)."""
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

    ctx = layer.inputs(part(sequences, False), part(pos, False))
    k_scale = prefill.compute_kv_scale(ctx.kv_c_normed, ctx.k_pe)
    cache = batch.fill_cache(prefill, ctx.kv_c_normed, ctx.k_pe, k_scale)
    meta = batch.metadata(k_scale)
    new = layer.inputs(part(sequences, True), part(pos, True))
    out = prefill(new.q, new.kv_c_normed, new.k_pe, cache, meta, k_scale=k_scale)
    held = batch.cached_rows(prefill, cache, k_scale)

    def reference(m, rotary) -> Tensor:
        dtype = module_dtype(m)
        outs = []
        for r, (x, p, c) in enumerate(zip(sequences, pos, ctx_lens)):
            lat = (held[0][r], held[1][r]) if prefill.spec.is_quantized and c else None
            outs.append(reference_attention(m, x.to(dtype), p, rotary_emb=rotary,
                                             context_latents=lat)[c:])
        return torch.cat(outs)

    theirs = reference(module, layer.rotary_emb)[:, layer.heads]
    m64 = exact64 = None
    if exact:
        m64 = copy.deepcopy(module).double()
        hd = layer.model.P + layer.model.V  # this rank's heads' rows (all of them at TP 1)
        rows = slice(layer.heads.start * hd, layer.heads.stop * hd)
        m64.kv_b_proj.weight[rows] = prefill.kv_b_proj.weight_format.dequantize_fp32().double()
        exact64 = reference(m64, rotary_embedding_for(m64))[:, layer.heads]
    return SideBySide(out, theirs, exact64, new, held, meta, k_scale, m64)
