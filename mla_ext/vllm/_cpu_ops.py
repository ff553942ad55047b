"""vLLM CPU's MLA context gather over mla_ext's native gather.

vLLM CPU (0.32/0.33) gathers a chunk's cached context with
``ops.gather_mla_context_cache_cpu(src_cache=, dst=, block_table=, starts=,
cu_seq_lens=)`` (keywords only; non-quantized caches; dst rows of request r from
cu_seq_lens[r], its tokens starts[r]..), a per-request Python loop. This is the
same call on ``mla_ext.cache.api.gather_and_maybe_dequant_cache`` (one native
gather for the chunk; any entry width).
"""
from __future__ import annotations

import torch

from mla_ext.cache import api as cache_api

_ONE: dict[torch.device, torch.Tensor] = {}


def gather_mla_context_cache_cpu(*, src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                 starts: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    if src_cache.dtype != dst.dtype:
        raise ValueError(f"src_cache: expected dst's dtype {dst.dtype} (vLLM CPU gathers non-quantized caches "
                         f"only), got {src_cache.dtype}")
    scale = _ONE.get(src_cache.device)
    if scale is None:  # unread for a native cache; one tensor per device, not one per call
        scale = _ONE[src_cache.device] = torch.ones((), dtype=torch.float32, device=src_cache.device)
    cache_api.gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, cu_seq_lens.numel() - 1,
                                             "auto", scale, starts)
