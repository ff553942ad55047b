"""Shared data for the prefill tests: a scaled-down DeepSeek-shaped model and
a batch of random requests whose context sits in a paged cache."""
from __future__ import annotations

import math

import torch

from mla_ext.kv_b_proj import weights as W
from mla_ext.config.models import MLAModelConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.prefill.synthetic import SyntheticBatch

# DeepSeek latent dims (fp8_ds_mla needs L=512, R=64); few, narrow heads.
TINY = MLAModelConfig(
    name="tiny-deepseek", L=512, R=64, P=32, V=32, num_heads=2, num_layers=4,
    model_dtype=torch.bfloat16, max_model_len=256,
)
BLOCK = 16


def make_weight(kind: str, w: torch.Tensor) -> W.WeightFormat:
    dt = torch.bfloat16
    if kind == "dense":
        return W.DenseWeight.from_dense(w, dt)
    if kind == "fp8_block":
        return W.Fp8BlockWeight.from_dense(w, dt)
    if kind == "marlin_fp8":
        return W.MarlinFp8Weight.from_dense(w, dt)
    if kind == "nvfp4":
        return W.Nvfp4Weight.from_dense(w, dt)
    raise AssertionError(kind)


class Batch(SyntheticBatch):
    """A SyntheticBatch of the TINY model whose context is the same for every
    layer, kept per request (`ctx_kv_c[r]`, `ctx_k_pe[r]`) for the oracle."""

    def __init__(self, ctx_lens, q_lens, seed: int):
        super().__init__(TINY, ctx_lens, q_lens, BLOCK, seed=seed)
        kv_c, k_pe = self.layer_context(0)
        self.ctx_kv_c = list(kv_c.split(self.ctx_lens))
        self.ctx_k_pe = list(k_pe.split(self.ctx_lens))

    def fill_cache(self, layer: MLAPrefill, k_scale) -> torch.Tensor:
        return super().fill_cache(layer, torch.cat(self.ctx_kv_c), torch.cat(self.ctx_k_pe), k_scale)


def fill_local_cache(batch: Batch, layer: MLAPrefill, k_scale, cp_size: int, rank: int,
                     interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the batch's context under context parallelism:
    (local paged cache, local block table). Position p of a request lives on
    rank (p // I) % cp_size at local index (p // (I*cp)) * I + p % I."""
    from mla_ext.prefill.context_parallel import cp_local_index, cp_rank_of

    spec = layer.spec
    local_lens = []
    for c in batch.ctx_lens:
        pos = torch.arange(c)
        local_lens.append(int((cp_rank_of(pos, cp_size, interleave) == rank).sum()))
    need = [max(1, math.ceil(n / BLOCK)) for n in local_lens]
    num_blocks = sum(need) + 2
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(99 + rank)).to(torch.int32)
    table = torch.full((len(need), max(need)), -1, dtype=torch.int32)
    at = 0
    for r, nb in enumerate(need):
        table[r, :nb] = ids[at:at + nb]
        at += nb
    cache = torch.zeros(spec.cache_shape(num_blocks), dtype=spec.storage_dtype)
    for r, c in enumerate(batch.ctx_lens):
        pos = torch.arange(c)
        mine = pos[cp_rank_of(pos, cp_size, interleave) == rank]
        if mine.numel() == 0:
            continue
        j = cp_local_index(mine, cp_size, interleave)
        slots = table[r, j // BLOCK].long() * BLOCK + j % BLOCK
        layer.write_cache(batch.ctx_kv_c[r][mine], batch.ctx_k_pe[r][mine], cache, slots, k_scale)
    return cache, table
