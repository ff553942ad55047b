"""Per-batch inputs shared by every layer of a forward pass (`PrefillMetadata`: the chunk plans
and device copies are made once per batch and reused by every layer) and the context-parallel
group a layer runs under (`ContextParallel`, SPEC §6; its row exchange is context_parallel.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext.prefill.chunking import ChunkPlan, host_to_device, lengths, plan_context_chunks


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism over a torch.distributed group (SPEC §6).

    Each rank's paged cache holds the context tokens with
    `(pos // interleave) % cp_size == rank`, in local order, and
    `PrefillMetadata.block_table` is that rank's LOCAL block table. Context
    lengths in the metadata stay global. Every rank gathers its local rows of
    a chunk, the rows are all-gathered and reordered, and every rank then
    computes the same attention for the (replicated) queries.
    """

    group: object
    cp_size: int
    rank: int
    interleave: int = 1

    def __post_init__(self):
        for name in ("cp_size", "interleave"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.cp_size:
            raise ValueError(f"rank: expected an int in [0, {self.cp_size}), got {self.rank!r}")


class PrefillMetadata:
    """Per-batch inputs shared by every layer of a forward pass.

    block_table [num_reqs, max_blocks] int32 (block ids, shared by all layers);
    context_lens / query_lens: host ints (the scheduler knows them; planning
    chunks needs no device sync). k_scale: fp32 [1] per-tensor K scale for
    per-tensor fp8 layers (ignored by others); a default only, since K scales
    are per layer: `MLAPrefill.forward(..., k_scale=)` overrides it.
    block_size (optional, keyword): the block size the block table was built
    for; when given, a layer with another block size refuses the metadata
    (block ids mean different token ranges there). Pass it: without it that
    mistake cannot be detected.

    Immutable: layers share the chunk plans, device copies and op backends cached
    here, keyed on what each depends on (`plan`: workspace rows and alignment;
    `chunk_tensors`: the chunk and the device; `cu_seqlens_q`: the device;
    `backends`: the layer key of mla_ext/prefill/backends.py), so
    assigning a field would leave them stale. Build a new PrefillMetadata for a
    new batch; assigning or deleting an attribute raises ValueError.
    """

    __slots__ = ("block_table", "context_lens", "query_lens", "k_scale", "block_size",
                 "max_context_len", "_plans", "_cu_q", "_chunk_t", "_backends")

    def __init__(self, block_table: Tensor, context_lens, query_lens, k_scale: Tensor | None = None,
                 *, block_size: int | None = None):
        ctx = tuple(lengths(context_lens, "context_lens"))
        qlens = tuple(lengths(query_lens, "query_lens"))
        if len(ctx) != len(qlens):
            raise ValueError(
                f"query_lens: expected {len(ctx)} entries (as context_lens), got {len(qlens)}"
            )
        bt = block_table
        if not isinstance(bt, Tensor) or bt.dim() != 2 or bt.dtype != torch.int32:
            got = (f"a {bt.dim()}-D {bt.dtype} tensor" if isinstance(bt, Tensor)
                   else type(bt).__name__)
            raise ValueError(f"block_table: expected an int32 tensor [num_reqs, max_blocks], got {got}")
        if bt.size(0) < len(ctx):
            raise ValueError(
                f"block_table: expected >= {len(ctx)} rows (one per request), got {bt.size(0)}"
            )
        if k_scale is not None and (not isinstance(k_scale, Tensor) or k_scale.dtype != torch.float32
                                    or k_scale.numel() != 1):
            got = (f"{k_scale.dtype} of shape {tuple(k_scale.shape)}" if isinstance(k_scale, Tensor)
                   else type(k_scale).__name__)
            raise ValueError(f"k_scale: expected a float32 tensor [1] or None, got {got}")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size <= 0):
            raise ValueError(f"block_size: expected a positive integer or None, got {block_size!r}")
        init = object.__setattr__
        init(self, "block_table", bt)
        init(self, "context_lens", ctx)
        init(self, "query_lens", qlens)
        init(self, "k_scale", k_scale)
        init(self, "block_size", block_size)
        init(self, "max_context_len", max(ctx, default=0))
        init(self, "_plans", {})
        init(self, "_cu_q", {})
        init(self, "_chunk_t", {})
        init(self, "_backends", {})

    def __setattr__(self, name, value):
        raise ValueError(
            f"{name}: PrefillMetadata is immutable (every layer shares the chunk plan and device "
            "copies cached from it); build a new PrefillMetadata for a new batch"
        )

    def __delattr__(self, name):
        self.__setattr__(name, None)

    def __repr__(self) -> str:
        return (f"PrefillMetadata(block_table={tuple(self.block_table.shape)} on "
                f"{self.block_table.device}, context_lens={self.context_lens}, "
                f"query_lens={self.query_lens}, k_scale={self.k_scale!r}, "
                f"block_size={self.block_size})")

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def plan(self, rows: int, alignment: int) -> ChunkPlan:
        """The chunk plan for a workspace of `rows` (cached: layers share it).

        Keyed on (rows, alignment): with the (immutable) lengths that is all a
        plan depends on. The block size enters only through the alignment
        (B, or lcm(B, cp_size * I)), so layers of different block sizes with
        the same alignment share a plan that is valid for both."""
        key = (rows, alignment)
        if key not in self._plans:
            self._plans[key] = plan_context_chunks(self.context_lens, self.query_lens, rows, alignment)
        return self._plans[key]

    def backends(self, key, make):
        """The op backends resolved for this batch under a layer key (mla_ext/prefill/backends.py):
        made by `make()` on the key's first forward, shared by every later call of this batch with
        the same key (layers of the same spec, the same caller tensors' layout, the same dispatch state)."""
        hit = self._backends.get(key)
        if hit is None:
            hit = self._backends[key] = make()
        return hit

    def resolved_backends(self) -> dict:
        """{layer key: BatchBackends} resolved so far for this batch (for explain and the tests)."""
        return dict(self._backends)

    def cu_seqlens_q(self, device) -> Tensor:
        device = torch.device(device)
        if device not in self._cu_q:
            offs = [0]
            for n in self.query_lens:
                offs.append(offs[-1] + n)
            self._cu_q[device] = host_to_device(offs, device)  # pinned + async on CUDA
        return self._cu_q[device]

    def chunk_tensors(self, chunk, device):
        """A chunk's int32 metadata on `device`, copied once per batch: every
        layer with the same plan reuses it (one host-to-device copy, not one per layer).
        Keyed on the chunk's value (all its offsets) and the device."""
        key = (chunk, torch.device(device))
        if key not in self._chunk_t:
            self._chunk_t[key] = chunk.tensors(device)
        return self._chunk_t[key]
