"""Running a transformers MLA attention module's own forward and reading what it
hands its attention function, for any of the MLA families (mla_ext.config.families).

Every family's forward ends the same way: the latents go through
`past_key_values.update(kv_c_normed, k_pe, layer_idx)` (what a cache stores), then
the query (after all its family's changes: LoRA, rescales, rope, a position-
dependent temperature) and the up-projected keys/values reach
`attention_interface(self, query, key, value, attention_mask, scaling=..., ...)`,
looked up as the family file's own `eager_attention_forward` when the config says
"eager". So instead of re-implementing 17 families' input math, `run_module`
calls the module's forward with

- a stand-in cache (`_Cache`) that records the latents (and can hand back the
  first C positions replaced by what a paged cache holds, for the reference), and
- an attention function swapped in for the duration of the call: `capture`
  records the query / scaling / indices and stops the forward there (nothing
  after it is needed); `reference` runs the family's own eager attention and
  records its output (the input of any output gate and of o_proj).

The swap patches the family file's `eager_attention_forward` and the config's
attention implementation for the call only (not thread-safe; restored on exit).
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch import Tensor


class _Stop(Exception):
    """Raised by the capture attention function: the forward need not go on."""


class _CacheLayer:
    """What glm5_next's indexer reads of a cache layer (its keys' length)."""

    def __init__(self, cache: "_Cache"):
        self.cache = cache

    @property
    def keys(self) -> Tensor:
        return self.cache.indexer_keys

    def get_seq_length(self) -> int:
        return int(self.cache.indexer_keys.shape[-2])


class _Cache:
    """Stands in for a transformers Cache in `module.forward`: `update` records the
    layer's latents ([B, 1, S, L], [B, 1, S, R]) and returns them, the first C
    positions of each sequence replaced by `context` (kv_c [B, C, L], k_pe [B, C, R])
    when given; the indexer's cache calls pass their keys through."""

    def __init__(self, context: tuple[Tensor, Tensor] | None = None):
        self.context = context
        self.latents: tuple[Tensor, Tensor] | None = None
        self.indexer_keys: Tensor | None = None
        self.layers = _Layers(self)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx=None, *args, **kwargs):
        self.latents = (key_states, value_states)
        if self.context is None:
            return key_states, value_states
        kv_c, k_pe = self.context
        C = kv_c.shape[1]
        k, v = key_states.clone(), value_states.clone()
        k[:, 0, :C] = kv_c.to(device=k.device, dtype=k.dtype)
        v[:, 0, :C] = k_pe.to(device=v.device, dtype=v.dtype)
        return k, v

    def update_indexer(self, keys: Tensor, layer_idx=None, *args, **kwargs) -> Tensor:
        self.indexer_keys = keys
        return keys

    def get_seq_length(self, layer_idx=0) -> int:
        return 0


class _Layers:
    def __init__(self, cache: _Cache):
        self.cache = cache

    def __getitem__(self, i) -> _CacheLayer:
        return _CacheLayer(self.cache)


class Captured:
    """What one forward handed its attention function (B sequences of S tokens)."""

    query: Tensor | None = None  # [B, N, S, P+R] as the attention receives it
    scaling: float | None = None
    output: Tensor | None = None  # [B, S, N, V] the attention's output (reference only)
    latents: tuple[Tensor, Tensor] | None = None  # as stored: [B, 1, S, L], [B, 1, S, R]
    indices: Tensor | None = None  # sparse indices when the backend takes them
    sliding_window: int | None = None


@contextlib.contextmanager
def _attention_swapped(module, fn):
    """The family file's eager attention replaced by `fn`, and the config set to
    "eager" so the forward looks it up there, for the duration of the block."""
    lib = sys.modules[type(module).__module__]
    cfg = module.config
    saved_fn = lib.eager_attention_forward
    saved_impl = cfg.__dict__.get("_attn_implementation_internal")
    lib.eager_attention_forward = fn
    cfg.__dict__["_attn_implementation_internal"] = "eager"
    try:
        yield saved_fn
    finally:
        lib.eager_attention_forward = saved_fn
        cfg.__dict__["_attn_implementation_internal"] = saved_impl


def causal_mask(B: int, S: int, dtype: torch.dtype, device) -> Tensor:
    """The additive [B, 1, S, S] causal mask the eager attention takes."""
    allowed = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    return torch.zeros(S, S, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None].expand(B, 1, S, S)


def all_causal_topk(B: int, S: int, device) -> Tensor:
    """Top-k indices [B, S, S] that select every causal key (j <= i; later slots
    repeat i): what a shared-indexer layer receives from its full layer when
    every query sees at most index_topk keys."""
    j = torch.arange(S, device=device)
    return torch.minimum(j[None, :], j[:, None])[None].expand(B, S, S).to(torch.int64)


def forward_kwargs(module, x: Tensor, pos: Tensor, rotary, cache: _Cache,
                   shared_kv: dict | None, mask: str = "causal") -> dict:
    """The keyword arguments the module's forward takes, as its decoder layer passes
    them (mask, rotary cos/sin, positions, cache, KV-sharing dict, shared top-k)."""
    B, S = x.shape[:2]
    params = inspect.signature(module.forward).parameters
    attention_mask = causal_mask(B, S, x.dtype, x.device) if mask == "causal" else \
        torch.ones(B, S, dtype=torch.bool, device=x.device)
    kw = {"hidden_states": x, "attention_mask": attention_mask, "past_key_values": cache}
    if "position_embeddings" in params:
        kw["position_embeddings"] = rotary_embeddings(module, rotary, x, pos)
    if "position_ids" in params:
        kw["position_ids"] = pos
    if "shared_kv_states" in params:
        kw["shared_kv_states"] = shared_kv if shared_kv is not None else {}
    if "prev_topk_indices" in params:
        kw["prev_topk_indices"] = all_causal_topk(B, S, x.device)
    return kw


def rotary_embeddings(module, rotary, x: Tensor, pos: Tensor):
    """cos/sin (or V2's complex frequencies) as the family's model computes them:
    per layer type where the rotary embedding takes one (dots3_note, which also
    feeds its indexed layers float32 input)."""
    if rotary is None:
        return None
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        layer_type = module.config.layer_types[module.layer_idx]
        return rotary(x.float() if layer_type == "indexed_attention" else x, pos, layer_type)
    return rotary(x, pos)


def run_module(module, x: Tensor, pos: Tensor, rotary, *, reference: bool,
               context: tuple[Tensor, Tensor] | None = None,
               shared_kv: dict | None = None, mask: str = "causal") -> Captured:
    """One forward of `module` over x [B, S, H] at positions pos [B, S].

    reference=False: stops at the attention call, recording the query, scaling and
    latents. reference=True: runs the family's own eager attention (its masks,
    sinks, sparse indices), recording its output too."""
    got = Captured()
    cache = _Cache(context)

    def capture(mod, query, key, value, attention_mask, *args, scaling=None, **kwargs):
        got.query, got.scaling = query, scaling
        got.indices, got.sliding_window = kwargs.get("indices"), kwargs.get("sliding_window")
        if not reference:
            raise _Stop
        out, weights = own(mod, query, key, value, attention_mask, *args, scaling=scaling, **kwargs)
        got.output = out
        return out, weights

    with _attention_swapped(module, capture) as own:
        try:
            module(**forward_kwargs(module, x, pos, rotary, cache, shared_kv, mask))
        except _Stop:
            pass
    got.latents = cache.latents
    if got.query is None:
        raise RuntimeError(f"{type(module).__name__}: its forward never called the attention "
                           "function; this transformers version computes it another way")
    return got
