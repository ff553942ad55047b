"""vLLM 0.33's DeepGEMM indexer entry points (vllm/utils/deep_gemm.py: same names, arguments and
defaults) served by mla_ext on GPUs DeepGEMM's MQA-logits kernels do not run on (SM90+ only):
mla_ext/vllm/sparse_plugin.py's ROUTES bind them in vLLM's indexer modules on capability 8.x.

fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)
    q = (e4m3 [M, H, D], None), kv = (e4m3 [N, D], fp32 scales [N]), weights fp32 [M, H]
    -> fp32 [M, max_seqlen_k] compressed logits (row m, column c = key cu_seqlen_ks[m] + c for
    c < cu_seqlen_ke[m] - cu_seqlen_ks[m]); mla_ext fills the rest with -inf (DeepGEMM: "not cleaned").
fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                         max_model_len, indices=None)
    q = (e4m3 [B, next_n, H, D], None), kv_cache vLLM's fp8 index cache [nb, bs, 1, D + 4] uint8,
    context_lens [B, next_n] (per row) or [B, 1] (per request: row j sees L - next_n + j + 1)
    -> fp32 [B * next_n, max_model_len], -inf past each row's length. schedule_metadata is
    DeepGEMM's SM schedule: not needed here and not read.
get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, indices=None)
    -> int32 zeros [num_sms + 1, 2], the shape and dtype DeepGEMM's schedule has (vLLM copies it
    into its buffer of that size); the kernels above ignore it.

The FP4 (MXFP4, q scales given) form and the varlen form (`indices`, SM100 only) are refused with a
ValueError naming the argument: vLLM passes neither on capability 8.x (its FP8 path folds the q
scale into the weights; varlen decode needs capability family 10.x).
The math: mla_ext/sparse/mqa_logits.py (Triton on CUDA, torch elsewhere).
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.sparse.mqa_logits import mqa_logits, paged_mqa_logits


def _q_values(q, name: str = "q") -> Tensor:
    if isinstance(q, Tensor):
        return q
    if not (isinstance(q, (tuple, list)) and len(q) == 2):
        raise ValueError(f"{name}: expected (values, scales or None) as vLLM passes it, got {type(q).__name__}")
    values, scales = q
    if scales is not None:
        raise ValueError(f"{name}: the MXFP4/MX-scaled form (q scales given) is not served; mla_ext serves the "
                         "FP8 form (q scales folded into the weights, q[1] None), which vLLM uses below SM100")
    return values


def fp8_fp4_mqa_logits(
    q: tuple[Tensor, Tensor | None],
    kv: tuple[Tensor, Tensor],
    weights: Tensor,
    cu_seqlen_ks: Tensor,
    cu_seqlen_ke: Tensor,
    max_seqlen_k: int,
) -> Tensor:
    if not (isinstance(kv, (tuple, list)) and len(kv) == 2):
        raise ValueError(f"kv: expected (k values [N, D], k scales [N]), got {type(kv).__name__}")
    k, k_scale = kv
    if k_scale.dtype != torch.float32:
        raise ValueError(f"kv[1]: expected float32 per-key scales (the MX int32 form is SM100's), got {k_scale.dtype}")
    return mqa_logits(_q_values(q), k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, int(max_seqlen_k))


def fp8_fp4_paged_mqa_logits(
    q: tuple[Tensor, Tensor | None],
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    schedule_metadata: Tensor,
    max_model_len: int,
    indices: Tensor | None = None,
) -> Tensor:
    if indices is not None:
        raise ValueError("indices: the varlen paged form (one request index per row) is SM100's; mla_ext serves "
                         "the [B, next_n] form vLLM uses on other GPUs")
    return paged_mqa_logits(_q_values(q), kv_cache, weights, context_lens, block_tables, int(max_model_len))


def get_paged_mqa_logits_metadata(
    context_lens: Tensor,
    block_size: int,
    num_sms: int,
    indices: Tensor | None = None,
) -> Tensor:
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms: expected a positive int, got {num_sms!r}")
    return torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)
