"""Shared data for the prefill tests: a scaled-down DeepSeek-shaped model and
a batch of random requests whose context sits in a paged cache."""
from __future__ import annotations

import math

import torch

from mla_ext.cache import reference as cache_ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.models import MLAModelConfig
from mla_ext.prefill.layer import MLAPrefill

# DeepSeek latent dims (fp8_ds_mla needs L=512, R=64); few, narrow heads.
TINY = MLAModelConfig(
    name="tiny-deepseek", L=512, R=64, P=32, V=32, num_heads=2, num_layers=4,
    model_dtype=torch.bfloat16, max_model_len=256,
)
BLOCK = 16


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


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


class Batch:
    """Random requests whose context already sits in a paged cache."""

    def __init__(self, ctx_lens, q_lens, gen: torch.Generator):
        self.ctx_lens, self.q_lens = list(ctx_lens), list(q_lens)
        m = TINY
        blocks_per_req = [max(1, math.ceil(c / BLOCK)) for c in ctx_lens]
        self.num_blocks = sum(blocks_per_req) + 3
        ids = torch.randperm(self.num_blocks, generator=gen).to(torch.int32)
        width = max(blocks_per_req)
        self.block_table = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
        pos = 0
        for r, nb in enumerate(blocks_per_req):
            self.block_table[r, :nb] = ids[pos:pos + nb]
            pos += nb
        T = sum(q_lens)
        self.q = torch.randn(T, m.num_heads, m.P + m.R, generator=gen).to(torch.bfloat16)
        self.kv_c_new = torch.randn(T, m.L, generator=gen).to(torch.bfloat16)
        self.k_pe_new = torch.randn(T, m.R, generator=gen).to(torch.bfloat16)
        self.ctx_kv_c = [torch.randn(c, m.L, generator=gen).to(torch.bfloat16) for c in ctx_lens]
        self.ctx_k_pe = [torch.randn(c, m.R, generator=gen).to(torch.bfloat16) for c in ctx_lens]

    def slots(self, r: int) -> torch.Tensor:
        pos = torch.arange(self.ctx_lens[r])
        return (self.block_table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK)

    def fill_cache(self, layer: MLAPrefill, k_scale) -> torch.Tensor:
        spec = layer.spec
        cache = torch.full(spec.cache_shape(self.num_blocks), 0, dtype=spec.storage_dtype)
        if spec.storage_dtype == torch.uint8:
            cache.fill_(0x7F)  # poison: e4m3 NaN everywhere a token is not written
        else:
            cache.fill_(float("nan"))
        for r in range(len(self.ctx_lens)):
            if self.ctx_lens[r]:
                layer.write_cache(self.ctx_kv_c[r], self.ctx_k_pe[r], cache, self.slots(r), k_scale)
        return cache

    def cached_rows(self, layer: MLAPrefill, cache, k_scale):
        """What the cache holds for each request, dequantized by the reference."""
        m = TINY
        kv_c, k_pe = [], []
        scale = k_scale if k_scale is not None else torch.ones(1)
        for r, c in enumerate(self.ctx_lens):
            # A native cache is gathered in its own dtype (no reinterpretation).
            dt = torch.float32 if layer.spec.is_quantized else layer.spec.storage_dtype
            dst = torch.empty(c, m.L + m.R, dtype=dt)
            cu = torch.tensor([0, c], dtype=torch.int32)
            cache_ref.gather_ref(cache, dst, self.block_table[r:r + 1], cu, 1,
                                 layer.spec.kv_cache_dtype, scale)
            kv_c.append(dst[:, : m.L].float())
            k_pe.append(dst[:, m.L:].float())
        return kv_c, k_pe



def fill_local_cache(batch: Batch, layer: MLAPrefill, k_scale, cp_size: int, rank: int,
                     interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the batch's context under context parallelism:
    (local paged cache, local block table). Position p of a request lives on
    rank (p // I) % cp_size at local index (p // (I*cp)) * I + p % I."""
    from mla_ext.cache.context_parallel import cp_local_index, cp_rank_of

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
