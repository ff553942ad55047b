"""mla_ext's stand-in for vLLM CPU's ``gather_mla_context_cache_cpu`` (mla_ext/vllm/_cpu_ops.py),
against a plain float32 reference of vLLM CPU's semantics, on random paged caches."""
from __future__ import annotations

import pytest
import torch

from mla_ext.vllm._cpu_ops import gather_mla_context_cache_cpu


def reference(src_cache, block_table, starts, cu_seq_lens, rows: int, width: int) -> torch.Tensor:
    """vLLM CPU's contract: dst rows cu_seq_lens[r].. hold request r's cached tokens starts[r].."""
    out = torch.full((rows, width), float("nan"))
    page = src_cache.shape[1]
    for r in range(len(cu_seq_lens) - 1):
        for i in range(int(cu_seq_lens[r + 1] - cu_seq_lens[r])):
            pos = int(starts[r]) + i
            out[int(cu_seq_lens[r]) + i] = src_cache[int(block_table[r, pos // page]), pos % page].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,starts", [([5, 0, 37], [0, 3, 16]), ([16], [0]), ([1, 33], [15, 17])])
def test_gather_matches_vllm_cpus_semantics(dtype, lens, starts):
    g = torch.Generator().manual_seed(len(lens) * 31 + sum(starts))
    blocks, page, width = 24, 16, 576
    src = torch.randn(blocks, page, width, generator=g).to(dtype)
    need = max(s + n for s, n in zip(starts, lens)) // page + 1
    table = torch.stack([torch.randperm(blocks, generator=g)[:need] for _ in lens]).to(torch.int32)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    st = torch.tensor(starts, dtype=torch.int32)
    rows = int(cu[-1])
    dst = torch.full((rows + 3, width), float("nan"), dtype=dtype)  # poison, and 3 rows past the chunk
    gather_mla_context_cache_cpu(src_cache=src, dst=dst[:rows], block_table=table, starts=st, cu_seq_lens=cu)
    want = reference(src, table, st, cu, rows, width)
    assert not dst[:rows].isnan().any(), "a row was not written"
    assert torch.equal(dst[:rows].float(), want)  # a copy: exact
    assert dst[rows:].isnan().all(), "wrote past the chunk's rows"


def test_gather_refuses_a_dtype_change():
    src = torch.randn(2, 16, 576)
    dst = torch.empty(4, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="src_cache: expected dst's dtype torch.bfloat16"):
        gather_mla_context_cache_cpu(src_cache=src, dst=dst, block_table=torch.zeros(1, 1, dtype=torch.int32),
                                     starts=torch.zeros(1, dtype=torch.int32),
                                     cu_seq_lens=torch.tensor([0, 4], dtype=torch.int32))
