"""The backends of one layer's op calls, resolved once per (layer key, batch plan) and reused.

Every op of `MLAPrefill.forward` (gather, kv_b_proj, varlen attention, merge, latent attention)
has a dispatcher (mla_ext/dispatch.py) whose choice depends on what the layer is (its cache format,
dtypes, weight format, dims, device), on the strides of the tensors the caller hands in, on the
batch plan (each chunk's row counts: kv_b_proj's M buckets, attention's Tq/Tk buckets) and on the
dispatch state (a forced backend, the measurement tables): never on tensor values. So the first
forward of a batch resolves each call site (the new tokens' ops, and each chunk's) once, through
the dispatcher as before, and every later call of that batch by a layer with the same key reuses
the choice: the dispatcher's backends' `not_supported_reasons` and heuristics are not re-run.

The record (`BatchBackends`, one `Chosen` per call site) lives on the PrefillMetadata (one per
batch), keyed by `LayerKey`: the layer's static part (computed once per layer), the caller's
tensors' dtypes, devices and strides, and every dispatcher's `state_key()`, so forcing a backend
(Dispatcher.force, MLA_EXT_FORCE_<OP>) or changing the tables makes a new record, never a stale one.
Input checks still run on every call (they are per call and cheap); only the choice is kept.

`RESOLVE_ONCE = False` (a module switch, for the host-overhead benchmark's "before" column and
the tests' reference) makes every op call dispatch again.
"""
from __future__ import annotations

from typing import Hashable

from torch import Tensor

from mla_ext.attention.api import ATTENTION, MERGE
from mla_ext.attention.latent import LATENT
from mla_ext.cache.api import GATHER
from mla_ext.dispatch import Chosen, dispatch_state
from mla_ext.kv_b_proj.linear import DISPATCH as KV_B_PROJ
from mla_ext.sparse.index_cache_backends import INDEX_GATHER
from mla_ext.sparse.sparse_attention import SPARSE

RESOLVE_ONCE = True

# The dispatchers an MLAPrefill forward reaches (dense: the first five; sparse: the index gather and
# the sparse latent attention).
LAYER_DISPATCHERS = (GATHER, KV_B_PROJ, ATTENTION, MERGE, LATENT, INDEX_GATHER, SPARSE)


class BatchBackends:
    """One layer key's call sites in one batch: site key (e.g. ("attention", chunk index)) ->
    a Chosen, resolved at its first call; and choices made outside a dispatcher (the indexer's
    scorer) -> their value."""

    __slots__ = ("sites", "values")

    def __init__(self) -> None:
        self.sites: dict[Hashable, Chosen] = {}
        self.values: dict[Hashable, object] = {}

    def value(self, key: Hashable, make):
        """A choice that is not a dispatcher's (a plain function of the layer's inputs), made once."""
        if key not in self.values:
            self.values[key] = make()
        return self.values[key]

    def site(self, key: Hashable) -> Chosen:
        c = self.sites.get(key)
        if c is None:
            c = self.sites[key] = Chosen()
        return c

    def describe(self) -> list[str]:
        """One line per resolved call site: 'attention[chunk 0] = triton'."""
        out = []
        for (op, where), c in self.sites.items():
            if c.backend is not None:
                out.append(f"{op}[{where}] = {c.backend.name}")
        out += [f"{op}[{where}] = {v}" for (op, where), v in self.values.items()]
        return out


def _tensor_key(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.dtype, t.device, t.stride())


def static_key(layer) -> tuple:
    """What the layer's op choices depend on that is fixed at construction (layers with the same
    spec, dims and weight format share it; kv_b_proj's weights are described, not identified)."""
    m, s, w = layer.model, layer.spec, layer.kv_b_proj
    cp = None if layer.cp is None else (layer.cp.cp_size, layer.cp.rank, layer.cp.interleave)
    return (s.kv_cache_dtype, s.block_size, s.storage_dtype, s.entry_elems, layer.workspace_dtype,
            layer.workspace_rows, layer.chunk_alignment, m.num_heads, m.L, m.R, m.P, m.V, m.model_dtype,
            type(w.weight_format), w.weight_format.describe(), layer.kv_b_proj_input_dtype, cp)


def layer_key(layer, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor,
              workspace: Tensor | None) -> tuple:
    """The full key of one forward's choices: the layer's static key, its context-path mode, the
    caller's tensors (dtype, device, strides) and the dispatch state."""
    return (layer._static_backend_key(), layer.context_attention.mode, _tensor_key(q), _tensor_key(kv_c_normed),
            _tensor_key(k_pe), _tensor_key(kv_cache), _tensor_key(workspace),
            dispatch_state(LAYER_DISPATCHERS))


class NoPlan:
    """The per-call path: every site is None, so every op call dispatches (RESOLVE_ONCE off)."""

    __slots__ = ()

    @staticmethod
    def site(key: Hashable) -> None:
        return None

    @staticmethod
    def value(key: Hashable, make):
        return make()

    @staticmethod
    def describe() -> list[str]:
        return ["(not resolved: RESOLVE_ONCE is off, every op call dispatches)"]


NO_PLAN = NoPlan()


def for_forward(layer, metadata, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor,
                workspace: Tensor | None) -> BatchBackends | NoPlan:
    """The batch's record for this layer's key (made on the key's first forward of the batch)."""
    if not RESOLVE_ONCE:
        return NO_PLAN
    return metadata.backends(layer_key(layer, q, kv_c_normed, k_pe, kv_cache, workspace), BatchBackends)
