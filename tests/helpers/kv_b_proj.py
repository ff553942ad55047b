"""kv_b_proj test helpers shared across stages."""
from __future__ import annotations

import torch

from mla_ext.kv_b_proj import reference as ref


def emulated_scaled_mm(calls):
    """torch._scaled_mm as cuBLASLt's blockwise path sees it: the layout rules are
    asserted (row-major A, column-major B, scale_a [M, K/128] strides (1, M),
    scale_b [L4, N/128] strides (1, L4), L4 == K/128 so that torch versions before
    and after PyTorch PR 166752 agree, M % 4 == 0, explicit bf16/fp16 out_dtype),
    then the product is computed from the scales as laid out."""
    def fake(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False,
             out=None):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.stride(1) == 1 and a.stride(0) >= k, f"A must be row-major, strides {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) >= k, f"B must be column-major, strides {b.stride()}"
        assert out_dtype in (torch.bfloat16, torch.float16), out_dtype
        assert m % 4 == 0, f"M={m} must be a multiple of 4"
        l, l4 = -(-k // 128), -(-k // 512) * 4
        assert l == l4, f"K={k}: K/128 must be a multiple of 4"
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.shape == (m, l) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
        assert n % 128 == 0 and scale_b.shape == (l4, n // 128) and scale_b.stride() == (1, l4), (
            scale_b.shape, scale_b.stride())
        calls.append((m, k, n))
        sa = scale_a.repeat_interleave(128, 1)[:, :k]
        sb = scale_b.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
        y = ((ref.decode_e4m3(a) * sa) @ (ref.decode_e4m3(b) * sb)).to(out_dtype)
        if out is None:
            return y
        assert out.is_contiguous() and out.shape == (m, n) and out.dtype == out_dtype
        return out.copy_(y)
    return fake
