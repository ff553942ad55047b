"""MLAPrefill under context parallelism (SPEC §6) over 2 gloo ranks equals
the single-rank layer on the same batch.

Each rank's cache holds only its interleaved share of every request's context
(tests/helpers/prefill.py: fill_local_cache) and the metadata carries that
rank's local block table. With interleave I=8 and block 16 the chunk
alignment lcm(16, 2*8) equals the single-rank one, so both runs see the same
chunks and must agree bit for bit; with I=3 (alignment 48) the chunks differ
and the results agree within SPEC §9.
"""
from __future__ import annotations

import math

import pytest
import torch

from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import ContextParallel, MLAPrefill, PrefillMetadata
from helpers.dist import run_on_gloo_ranks
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, Batch, fill_local_cache, make_weight

CASES = [  # (kv_cache_dtype, layer, weight format, interleave, workspace rows)
    ("fp8_ds_mla", 1, "fp8_block", 8, 32),
    ("fp8", 2, "marlin_fp8", 3, 96),
    ("fp8_ds_mla", 0, "dense", 8, 64),  # layer 0 is skipped: native bf16 cache
]


def _worker(rank: int, world: int) -> None:
    for i, (fmt, index, wkind, interleave, rows) in enumerate(CASES):
        gen = torch.Generator().manual_seed(500 + i)
        batch = Batch(ctx_lens=[70, 0, 21, 1, 40], q_lens=[3, 2, 1, 2, 4], seed=i)
        w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen)
        w /= math.sqrt(TINY.L)
        cfg = CacheConfig(kv_cache_dtype=fmt, skip_layers=(0,), block_size=BLOCK)
        k_scale = torch.tensor([0.02])
        single = MLAPrefill(TINY, cfg, make_weight(wkind, w), layer=index,
                            workspace_rows_override=rows, max_num_seqs=8)
        want = single(batch.q, batch.kv_c_new, batch.k_pe_new, batch.fill_cache(single, k_scale),
                      PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, k_scale))

        cp = ContextParallel(group=None, cp_size=world, rank=rank, interleave=interleave)
        layer = MLAPrefill(TINY, cfg, make_weight(wkind, w), layer=index,
                           workspace_rows_override=rows, max_num_seqs=8, context_parallel=cp)
        cache, table = fill_local_cache(batch, layer, k_scale, world, rank, interleave)
        got = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache,
                    PrefillMetadata(table, batch.ctx_lens, batch.q_lens, k_scale))
        if layer.chunk_alignment == single.chunk_alignment:
            assert torch.equal(got, want), f"rank {rank}: case {CASES[i]} not bit-exact"
        else:
            err = rel_fro(got, want)
            assert err <= 1e-2, f"rank {rank}: case {CASES[i]} error {err}"


def test_two_gloo_ranks_equal_one_rank():
    run_on_gloo_ranks(_worker, world=2)


def test_context_parallel_config_errors():
    with pytest.raises(ValueError, match="cp_size"):
        ContextParallel(group=None, cp_size=0, rank=0)
    with pytest.raises(ValueError, match="rank"):
        ContextParallel(group=None, cp_size=2, rank=2)
    with pytest.raises(ValueError, match="interleave"):
        ContextParallel(group=None, cp_size=2, rank=0, interleave=0)
