"""Random prefill batches whose context sits in a paged cache (demo and benchmark).

A `SyntheticBatch` holds one batch's host metadata (context and query
lengths), a shuffled block table shared by every layer, and the new tokens'
q / kv_c_normed / k_pe. Per layer, `layer_context` draws that layer's context
latents, `fill_cache` writes them into a fresh cache in the layer's own
format (one `write_cache` call), and `cached_rows` reads back what the cache
holds, decoded by the float32 cache reference per request, for the one-shot
oracle (so fp8 rounding is the cache's, not an error of the pipeline).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from mla_ext.cache import reference as cache_ref
from mla_ext.config.formats import QuantMode
from mla_ext.config.models import MLAModelConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata


class SyntheticBatch:
    def __init__(self, model: MLAModelConfig, ctx_lens, q_lens, block_size: int,
                 device: torch.device | str = "cpu", seed: int = 0):
        if len(ctx_lens) != len(q_lens):
            raise ValueError(f"q_lens: expected {len(ctx_lens)} entries (as ctx_lens), got {len(q_lens)}")
        self.model, self.block_size = model, block_size
        self.device = torch.device(device)
        self.ctx_lens, self.q_lens = [int(x) for x in ctx_lens], [int(x) for x in q_lens]
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        need = [max(1, math.ceil(c / block_size)) for c in self.ctx_lens]
        # A few spare blocks, and shuffled ids, so paging is really exercised.
        self.num_blocks = sum(need) + 3
        ids = torch.randperm(self.num_blocks, generator=gen).to(torch.int32)
        table = torch.full((len(need), max(need, default=1)), -1, dtype=torch.int32)
        slots, at = [], 0
        for r, nb in enumerate(need):
            table[r, :nb] = ids[at:at + nb]
            at += nb
            pos = torch.arange(self.ctx_lens[r])
            slots.append(table[r, pos // block_size].long() * block_size + pos % block_size)
        self.block_table = table.to(self.device)
        self.slots = [s.to(self.device) for s in slots]
        T, m, dt = sum(self.q_lens), model, model.model_dtype
        dgen = self._gen(seed)
        self.q = torch.randn(T, m.num_heads, m.P + m.R, generator=dgen, device=self.device).to(dt)
        self.kv_c_new = torch.randn(T, m.L, generator=dgen, device=self.device).to(dt)
        self.k_pe_new = torch.randn(T, m.R, generator=dgen, device=self.device).to(dt)

    def _gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def metadata(self, k_scale: Tensor | None = None) -> PrefillMetadata:
        return PrefillMetadata(self.block_table, self.ctx_lens, self.q_lens, k_scale,
                               block_size=self.block_size)

    def layer_context(self, layer_index: int) -> tuple[Tensor, Tensor]:
        """This layer's context latents: (kv_c [sum ctx, L], k_pe [sum ctx, R]) in the model dtype."""
        m, n = self.model, sum(self.ctx_lens)
        gen = self._gen(self.seed * 1000 + 17 * layer_index + 1)
        kv_c = torch.randn(n, m.L, generator=gen, device=self.device).to(m.model_dtype)
        k_pe = torch.randn(n, m.R, generator=gen, device=self.device).to(m.model_dtype)
        return kv_c, k_pe

    def fill_cache(self, layer: MLAPrefill, kv_c: Tensor, k_pe: Tensor,
                   k_scale: Tensor | None = None) -> Tensor:
        """A fresh cache in the layer's format holding the context (spare slots poisoned)."""
        spec = layer.spec
        cache = torch.empty(spec.cache_shape(self.num_blocks), dtype=spec.storage_dtype, device=self.device)
        # Poison: e4m3 NaN bytes / NaN values wherever no token is written.
        cache.fill_(0x7F) if spec.storage_dtype == torch.uint8 else cache.fill_(float("nan"))
        if kv_c.shape[0]:
            layer.write_cache(kv_c, k_pe, cache, torch.cat(self.slots), k_scale)
        return cache

    def cached_rows(self, layer: MLAPrefill, cache: Tensor, k_scale: Tensor | None = None,
                    requests=None) -> tuple[list[Tensor], list[Tensor]]:
        """For each request in `requests` (default: all, in order): the context rows
        the cache holds, decoded by the cache reference, float32 on the CPU."""
        m, spec = self.model, layer.spec
        if spec.quant_mode == QuantMode.FP8_PER_TENSOR and k_scale is None:
            raise ValueError(
                f"k_scale: layer {spec.layer_index} ({spec.kv_cache_dtype}) stores per-tensor fp8; "
                "pass the K scale its cache was written with"
            )
        flat = cache.reshape(-1, cache.shape[-1])
        kv_c, k_pe = [], []
        for r in (range(len(self.ctx_lens)) if requests is None else requests):
            rows = flat[self.slots[r]].cpu()
            full = cache_ref.decode_cache_rows(rows, spec.kv_cache_dtype, k_scale)
            kv_c.append(full[:, : m.L])
            k_pe.append(full[:, m.L:m.L + m.R])  # fp8_ds_mla keeps 64 zero rope columns at R=0
        return kv_c, k_pe
