"""vLLM 0.33's fused_indexer_q_rope_quant (vllm/model_executor/layers/sparse_attn_indexer.py, called by
vllm/model_executor/models/deepseek_v2.py's indexer: same name, arguments and outputs) for GPUs whose
Triton has no fp8e4nv (below sm_89), where vLLM's own kernel does not compile:
mla_ext/vllm/sparse_plugin.py's ROUTES bind it in deepseek_v2.py there.

fused_indexer_q_rope_quant(positions, q, cos_sin_cache, weights, softmax_scale, head_scale, is_neox)
    q bf16 [T, H, 128] -> (q rotated on its first 64 dims (neox: pairs (i, i + 32), else (2i, 2i + 1),
    each in its place) and rounded to bf16, as e4m3 [T, H, 128] with one power-of-two scale per
    (token, head) = 2^ceil(log2(max(amax, 1e-10) / 448)); weights * scale * softmax_scale * head_scale
    fp32 [T, H]). The math: mla_ext/sparse/indexer_q_quant.py.
"""
from __future__ import annotations

from torch import Tensor

from mla_ext.sparse.indexer_q_quant import indexer_q_rope_quant


def fused_indexer_q_rope_quant(
    positions: Tensor,
    q: Tensor,
    cos_sin_cache: Tensor,
    weights: Tensor,
    softmax_scale: float,
    head_scale: float,
    is_neox: bool,
) -> tuple[Tensor, Tensor]:
    return indexer_q_rope_quant(positions, q, cos_sin_cache, weights, softmax_scale, head_scale, is_neox)
