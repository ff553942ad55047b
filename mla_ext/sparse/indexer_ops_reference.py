"""Pure-PyTorch oracle (float64 arithmetic, float32 results) of the DSA indexer ops that vLLM 0.33
takes from DeepGEMM and vLLM's _C on SM90+, in their contracts (what mla_ext serves on 8.x):

mqa_logits_reference        DeepGEMM fp8_fp4_mqa_logits (fp8 form): compressed logits
paged_mqa_logits_reference  DeepGEMM fp8_fp4_paged_mqa_logits (fp8 form) over vLLM's index cache
decode_row_ends             the visible length of each decode logits row (next_n rule)
top_k_per_row_reference     vLLM _C top_k_per_row_prefill / _decode / persistent_topk selection
indexer_q_rope_quant_reference  vLLM's fused_indexer_q_rope_quant (deepseek_v2.py's indexer q)

Logits (DeepGEMM's definition, its test reference): with q [M, H, D] e4m3 (the per-token q scale
folded into the weights by the caller), k [N, D] e4m3 with one fp32 scale per key,

    logit[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]

(k_scale > 0 commutes with relu). The prefill form returns [M, max_seqlen_k] "compressed" rows:
column c of row m is key ks[m] + c, valid for c < ke[m] - ks[m]; DeepGEMM leaves the rest
unspecified ("not cleaned"), mla_ext fills it with -inf. The paged form returns
[B * next_n, max_model_len]: column c of row r is token c of request r // next_n, valid for
c < decode_row_ends(...)[r]; the rest -inf.

Top-k: indices relative to the row start, -1 padded; which of several equal scores is chosen is
the library's tie rule (mla_ext/sparse/reference.py: higher score, then lower position); vLLM's
CUDA kernels state no order and pick any of the tied, so parity tests compare up to ties.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.sparse.reference import PAD

E4M3_MAX = 448.0


def _f64(x: Tensor) -> Tensor:
    return x.to(torch.float64)


def mqa_logits_reference(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor, ke: Tensor,
                         max_seqlen_k: int) -> Tensor:
    """q [M, H, D] e4m3 (or any float), k [N, D] e4m3, k_scale [N] fp32, weights [M, H], ks/ke [M] int
    -> float32 [M, max_seqlen_k] compressed logits, -inf past each row's range."""
    M = q.shape[0]
    out = torch.full((M, max_seqlen_k), float("-inf"), dtype=torch.float64)
    kd = _f64(k) * _f64(k_scale)[:, None]
    for m in range(M):
        s, e = int(ks[m]), int(ke[m])
        n = min(max(e - s, 0), max_seqlen_k)
        if n == 0:
            continue
        sc = (_f64(q[m]) @ kd[s:s + n].t()).clamp_min(0)  # [H, n]
        out[m, :n] = _f64(weights[m]) @ sc
    return out.to(torch.float32)


def decode_row_ends(context_lens: Tensor, next_n: int, num_rows: int) -> Tensor:
    """int64 [num_rows]: how many leading columns row r of decode logits may see. context_lens
    [B, next_n] (or any shape with num_rows entries) holds each row's own length; [B, 1] / [B]
    holds each request's length L, its row j of next_n seeing L - next_n + j + 1 (>= 0)."""
    cl = context_lens.reshape(-1).to(torch.int64).cpu()
    if cl.numel() == num_rows:
        return cl.clamp_min(0)
    r = torch.arange(num_rows)
    return (cl[r // next_n] - next_n + 1 + r % next_n).clamp_min(0)


def _page_keys(cache: Tensor, D: int) -> tuple[Tensor, Tensor]:
    """vLLM's fp8 index cache [nb, B, D + 4] (or its [nb, B, 1, D + 4] view) -> (e4m3 values
    [nb, B, D] as float64, fp32 scales [nb, B] as float64): each page holds its B tokens' D bytes
    token-major, then their B fp32 scales."""
    nb, B = cache.shape[0], cache.shape[1]
    flat = cache.reshape(nb, -1).view(torch.uint8)
    vals = flat[:, : B * D].reshape(nb, B, D).view(torch.float8_e4m3fn)
    scales = flat[:, B * D: B * D + 4 * B].contiguous().view(torch.float32).reshape(nb, B)
    return _f64(vals), _f64(scales)


def paged_mqa_logits_reference(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                               block_tables: Tensor, max_model_len: int) -> Tensor:
    """q [B, next_n, H, D] e4m3, kv_cache vLLM's fp8 index cache [nb, bs, 1, D + 4] uint8, weights
    [B * next_n, H], context_lens [B, next_n] / [B, 1] / [B], block_tables [B, max_blocks] int32
    -> float32 [B * next_n, max_model_len], -inf past each row's end."""
    Bq, next_n, H, D = q.shape
    rows = Bq * next_n
    vals, scales = _page_keys(kv_cache, D)
    bs = vals.shape[1]
    ends = decode_row_ends(context_lens, next_n, rows)
    out = torch.full((rows, max_model_len), float("-inf"), dtype=torch.float64)
    qf = _f64(q).reshape(rows, H, D)
    for r in range(rows):
        n = min(int(ends[r]), max_model_len)
        if n == 0:
            continue
        pos = torch.arange(n)
        blk = block_tables[r // next_n].to(torch.int64).cpu()[pos // bs]
        k = vals[blk, pos % bs] * scales[blk, pos % bs][:, None]
        out[r, :n] = _f64(weights[r]) @ (qf[r] @ k.t()).clamp_min(0)
    return out.to(torch.float32)


def top_k_per_row_reference(logits: Tensor, row_starts: Tensor, row_ends: Tensor, topk: int) -> Tensor:
    """int32 [M, topk]: per row m the columns of [row_starts[m], row_ends[m]) with the largest
    logits (tie rule: lower column first), relative to row_starts[m], -1 padded; a row with at most
    topk columns selects all of them (whatever their values, -inf included: vLLM's rule)."""
    M = logits.shape[0]
    out = torch.full((M, topk), PAD, dtype=torch.int32)
    for m in range(M):
        s, e = int(row_starts[m]), min(int(row_ends[m]), logits.shape[1])
        if e <= s:
            continue
        v = _f64(logits[m, s:e])
        order = torch.sort(v, descending=True, stable=True).indices[:topk]
        out[m, : order.numel()] = order.to(torch.int32)
    return out


def ue8m0_ceil(x: Tensor) -> Tensor:
    """2^ceil(log2(x)) of positive normal fp32 values, exactly (on the bits: a mantissa above
    zero moves the exponent up one)."""
    bits = x.to(torch.float32).view(torch.int32)
    return torch.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits).view(torch.float32)


def _bf16_round(x: Tensor) -> Tensor:
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def indexer_q_rope_quant_reference(positions: Tensor, q: Tensor, cos_sin_cache: Tensor, weights: Tensor,
                                   softmax_scale: float, head_scale: float, is_neox: bool
                                   ) -> tuple[Tensor, Tensor]:
    """vLLM 0.33's fused_indexer_q_rope_quant: q [T, H, 128] bf16 with RoPE on its first 64 dims
    (cos_sin_cache [max_pos, 64] = cos[32] | sin[32]; neox: pairs (i, i + 32), else (2i, 2i + 1),
    written back in the same places), rotated values rounded to bf16, then per (token, head) e4m3
    with a power-of-two scale s = 2^ceil(log2(max(amax, 1e-10) / 448)); returns (q e4m3 [T, H, 128],
    weights * s * softmax_scale * head_scale float32 [T, H])."""
    T, H, D = q.shape
    R = cos_sin_cache.shape[-1]
    half = R // 2
    cs = cos_sin_cache.to(torch.float32)[positions.to(device=cos_sin_cache.device, dtype=torch.int64)]  # [T, R]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = _f64(q).to(cs.device)
    if is_neox:
        i0, i1 = torch.arange(half), half + torch.arange(half)
    else:
        i0, i1 = 2 * torch.arange(half), 2 * torch.arange(half) + 1
    x0, x1 = x[..., i0], x[..., i1]
    # the kernel's fp32 arithmetic, then bf16 (round to nearest even)
    r0 = _bf16_round(x0.float() * cos - x1.float() * sin)
    r1 = _bf16_round(x1.float() * cos + x0.float() * sin)
    y = x.clone()
    y[..., i0], y[..., i1] = r0, r1
    amax = y.abs().amax(dim=-1).to(torch.float32)  # [T, H]
    raw = amax.clamp_min(1e-10) * (1.0 / E4M3_MAX)
    scale = ue8m0_ceil(raw)
    qf = (y / scale.to(torch.float64)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float32)
    w = ((weights.to(device=scale.device, dtype=torch.float32) * scale) * softmax_scale) * head_scale
    return qf.to(torch.float8_e4m3fn), w
