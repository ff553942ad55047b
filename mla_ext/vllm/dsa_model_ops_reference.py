"""Pure-PyTorch float32 reference of vLLM 0.33's DeepSeek-V3.2 fused_norm_rope / fused_q
(mla_ext/vllm/dsa_model_ops.py is tested against it): clarity over speed, token by token, CPU.
Same arguments and in-place writes as the ops; RoPE written as complex rotation (interleaved
pairs) and rotate-half (NeoX), the latent cache through mla_ext.cache.reference, the index
cache's power-of-two scale from the float's exponent."""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.cache.reference import concat_and_cache_mla_ref

E4M3_MAX = 448.0


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum() / x.numel() + eps) * w.float()


def _ln(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    x = x.float()
    mu = x.sum() / x.numel()
    var = ((x - mu) ** 2).sum() / x.numel()
    return (x - mu) / torch.sqrt(var + eps) * w.float() + b.float()


def _cs(cache: Tensor, pos: int) -> tuple[Tensor, Tensor]:
    half = cache.shape[1] // 2
    return cache[pos, :half].float(), cache[pos, half:2 * half].float()


def rope_pairs_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(x[2i] + i x[2i+1]) * (cos + i sin), i over the last dim's pairs."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.complex(cos, sin)).reshape(x.shape)


def rope_index_ref(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """The indexer's RoPE on x's first 2 * len(cos) values."""
    r = 2 * cos.shape[-1]
    head, tail = x[..., :r].float(), x[..., r:].float()
    if interleave:
        head = rope_pairs_ref(head, cos, sin)
    else:
        x1, x2 = head.chunk(2, dim=-1)
        head = head * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)
    return torch.cat([head, tail], dim=-1)


def pow2_ceil_ref(s: float) -> float:
    """Smallest power of two >= s > 0."""
    m, e = torch.frexp(torch.tensor(s, dtype=torch.float32))
    return float(2.0 ** (int(e) - 1 if float(m) == 0.5 else int(e)))


def ue8m0_quant_ref(x: Tensor) -> tuple[Tensor, float]:
    """x [D] -> (e4m3 bytes [D], the power-of-two scale of max(amax, 1e-4) / 448)."""
    s = pow2_ceil_ref(float(torch.tensor(max(float(x.abs().max()), 1e-4), dtype=torch.float32) / E4M3_MAX))
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8), s


def _write_index_ref(cache: Tensor, slot: int, k: Tensor, shuffled: bool) -> None:
    nb, B, width = cache.shape
    D = k.shape[0]
    if not 0 <= slot < nb * B:
        return
    page = cache.view(torch.uint8)[slot // B].view(-1)
    o = slot % B
    vals, s = ue8m0_quant_ref(k)
    for j in range(D):
        pos = (o // 16 * 16 * D + o % 16 * 16 + j // 16 * 256 + j % 16) if shuffled else o * D + j
        page[pos] = vals[j]
    page[B * D + 4 * o: B * D + 4 * o + 4] = torch.tensor([s], dtype=torch.float32).view(torch.uint8)


def fused_norm_rope_ref(positions, q_c, q_rms_norm_w, q_rms_eps, kv_c, kv_rms_norm_w, kv_rms_eps, k_pe,
                        k_rope_cos_sin_cache, index_k, index_k_layer_norm_w, index_k_layer_norm_bias,
                        index_k_layer_norm_eps, index_k_rope_cos_sin_cache, topk_indices_buffer,
                        slot_mapping=None, indexer_slot_mapping=None, indexer_k_cache=None,
                        indexer_cache_shuffled=False, mla_kv_cache=None, mla_kv_cache_dtype="auto",
                        mla_k_scale=None, has_indexer=True, index_rope_interleave=False, q_c_out=None,
                        kv_c_out=None, k_pe_out=None, index_k_out=None, skip_scale=False) -> Tensor:
    T = positions.shape[0]
    q_out = torch.empty_like(q_c) if q_c_out is None else q_c_out
    caches = mla_kv_cache is not None or (has_indexer and indexer_k_cache is not None)
    if has_indexer:
        topk_indices_buffer[:T] = -1
    kv_rows, pe_rows = [], []
    for t in range(T):
        pos = int(positions[t])
        q_out[t] = _rms(q_c[t], q_rms_norm_w, q_rms_eps)
        kv = _rms(kv_c[t], kv_rms_norm_w, kv_rms_eps)
        pe = rope_pairs_ref(k_pe[t], *_cs(k_rope_cos_sin_cache, pos))
        kv_rows.append(kv)
        pe_rows.append(pe)
        if kv_c_out is not None:
            kv_c_out[t] = kv
        if k_pe_out is not None:
            k_pe_out[t] = pe
        live = not caches or int(slot_mapping[t]) >= 0
        if has_indexer and live and (index_k_out is not None or indexer_k_cache is not None):
            k = _ln(index_k[t], index_k_layer_norm_w, index_k_layer_norm_bias, index_k_layer_norm_eps)
            k = rope_index_ref(k, *_cs(index_k_rope_cos_sin_cache, pos), index_rope_interleave)
            if index_k_out is not None:
                index_k_out[t] = k
            if indexer_k_cache is not None:
                islot = int((slot_mapping if indexer_slot_mapping is None else indexer_slot_mapping)[t])
                _write_index_ref(indexer_k_cache, islot, k, indexer_cache_shuffled)
    if mla_kv_cache is not None and T:
        kv, pe = torch.stack(kv_rows), torch.stack(pe_rows)
        quantized = mla_kv_cache_dtype.startswith("fp8")
        scale = torch.ones(1) if skip_scale or mla_k_scale is None else mla_k_scale.reshape(1).float()
        cache = mla_kv_cache.view(torch.uint8) if quantized else mla_kv_cache
        if not quantized:
            kv, pe = kv.to(cache.dtype), pe.to(cache.dtype)
        concat_and_cache_mla_ref(kv, pe, cache, slot_mapping[:T], "auto" if not quantized else mla_kv_cache_dtype,
                                 scale)
    return q_out


def fused_q_ref(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope, q_scale,
                index_weights, index_weights_softmax_scale, index_weights_head_scale, has_indexer=True,
                index_rope_interleave=False, quantize_mqa=True):
    T, H, R = q_pe.shape
    L = ql_nope.shape[2]
    s = float(q_scale.reshape(()))
    mqa = torch.empty(T, H, L + R, dtype=torch.uint8) if quantize_mqa else torch.empty(T, H, R, dtype=q_pe.dtype)
    iq = wo = None
    if has_indexer:
        iq = torch.empty(index_q.shape, dtype=torch.uint8)
        wo = torch.empty(index_weights.shape, dtype=torch.float32)
    f32 = torch.float32
    for t in range(T):
        pos = int(positions[t])
        pe = rope_pairs_ref(q_pe[t], *_cs(q_pe_cos_sin_cache, pos))
        if quantize_mqa:
            row = torch.cat([ql_nope[t].float(), pe], dim=-1) / s
            mqa[t] = row.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            mqa[t] = pe.to(q_pe.dtype)
        if has_indexer:
            for h in range(index_q.shape[1]):
                k = rope_index_ref(index_q[t, h], *_cs(index_q_cos_sin_cache, pos), index_rope_interleave)
                iq[t, h], sh = ue8m0_quant_ref(k)
                w = index_weights[t, h].float() * torch.tensor(sh, dtype=f32)
                wo[t, h] = (w * torch.tensor(index_weights_softmax_scale, dtype=f32)
                            * torch.tensor(index_weights_head_scale, dtype=f32))
    if quantize_mqa:
        mqa = mqa.view(torch.float8_e4m3fn)
    if not has_indexer:
        return torch.empty(1, 1, 1, dtype=torch.float8_e4m3fn), torch.empty(1, 1), mqa
    return iq.view(torch.float8_e4m3fn), wo, mqa
