"""A float8-typed cache must hold the element type of its format (fp8 / fp8_e4m3 -> float8_e4m3fn,
fp8_e5m2 -> float8_e5m2): the other type is refused naming kv_cache_dtype and the cache dtype,
on every core entry point that takes a latent cache (write, gathers, the absorbed-context and
sparse attention). uint8 caches stay accepted. vLLM's surface keeps taking what vLLM's layer
passes (every fp8 cache viewed as float8_e4m3fn): it reinterprets the bytes as uint8 and the
format string decides."""
from __future__ import annotations

import pytest
import torch

from mla_ext.cache import api as cache_api
from mla_ext.cache import reference as ref
from mla_ext.config.formats import get_format
from mla_ext.attention import latent as A
from mla_ext.sparse import sparse_attention as SA
from mla_ext.vllm import _custom_ops as vops

I32 = torch.int32
WRONG = [("fp8_e5m2", torch.float8_e4m3fn), ("fp8", torch.float8_e5m2), ("fp8_e4m3", torch.float8_e5m2)]


def _msg(fmt, dtype):
    fmt = get_format(fmt).name  # the canonical name: fp8_e4m3 is fp8
    return rf"kv_cache_dtype '{fmt}' needs a torch.uint8 or torch.float8_e\w+ cache, got {dtype}"


def _latent(fmt, L=64, R=16, nb=4, B=8):
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(nb, B, L + R, dtype=torch.uint8)
    ks = torch.tensor([0.05])
    cache_api.concat_and_cache_mla(torch.randn(nb * B, L, generator=gen), torch.randn(nb * B, R, generator=gen),
                                   cache, torch.arange(nb * B), fmt, ks)
    return cache, ks


@pytest.mark.parametrize("fmt,dtype", WRONG)
def test_the_cache_ops_refuse_the_other_float8_type(fmt, dtype):
    cache, ks = _latent(fmt)
    bt, cu = torch.tensor([[1, 0]], dtype=I32), torch.tensor([0, 10], dtype=I32)
    with pytest.raises(ValueError, match=_msg(fmt, dtype)):
        cache_api.gather_and_maybe_dequant_cache(cache.view(dtype), torch.empty(10, 80), bt, cu, 1, fmt, ks)
    with pytest.raises(ValueError, match=_msg(fmt, dtype)):
        cache_api.concat_and_cache_mla(torch.randn(2, 64), torch.randn(2, 16), cache.view(dtype),
                                       torch.tensor([0, 1]), fmt, ks)


def _latent_attention(cache, fmt, ks):
    gen = torch.Generator().manual_seed(4)
    N, T, L, R = 2, 3, 64, 16
    q_lat, q_pe = torch.randn(N, T, L, generator=gen), torch.randn(T, N, R, generator=gen)
    bt = torch.tensor([[2, 0], [1, 3]], dtype=I32)
    q_off, c_off = [0, 2, 3], [0, 10, 21]
    with A.LATENT.force("torch"):
        return A.latent_context_attention(q_lat, q_pe, cache, fmt, bt, torch.tensor(q_off, dtype=I32),
                                          torch.tensor(c_off, dtype=I32), None, ks, 0.125,
                                          q_offsets=q_off, ctx_offsets=c_off)


@pytest.mark.parametrize("fmt,dtype", WRONG)
def test_absorbed_context_attention_refuses_the_other_float8_type(fmt, dtype):
    cache, ks = _latent(fmt)
    with pytest.raises(ValueError, match="kv_cache: " + _msg(fmt, dtype)):
        _latent_attention(cache.view(dtype), fmt, ks)


@pytest.mark.parametrize("fmt,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_uint8_and_the_matching_float8_type_give_the_same_attention(fmt, dtype):
    cache, ks = _latent(fmt)
    o8, lse8 = _latent_attention(cache, fmt, ks)
    o, lse = _latent_attention(cache.view(dtype), fmt, ks)
    assert torch.equal(o, o8) and torch.equal(lse, lse8) and torch.isfinite(lse8).all()


def _sparse(cache, fmt, ks):
    gen = torch.Generator().manual_seed(5)
    N, L, R = 2, 64, 16
    q_lens, ctx_lens = [2, 1], [10, 11]
    T = sum(q_lens)
    idx = torch.randint(0, 10, (T, 4), generator=gen, dtype=I32)
    with SA.SPARSE.force("torch"):
        return SA.sparse_latent_attention(torch.randn(N, T, L, generator=gen), torch.randn(T, N, R, generator=gen),
                                          cache, fmt, torch.tensor([[2, 0], [1, 3]], dtype=I32), idx,
                                          torch.randn(T, L, generator=gen), torch.randn(T, R, generator=gen), ks,
                                          0.125, q_lens=q_lens, ctx_lens=ctx_lens)


@pytest.mark.parametrize("fmt,dtype", WRONG)
def test_sparse_attention_refuses_the_other_float8_type_and_takes_uint8(fmt, dtype):
    cache, ks = _latent(fmt)
    with pytest.raises(ValueError, match="kv_cache: " + _msg(fmt, dtype)):
        _sparse(cache.view(dtype), fmt, ks)
    o, lse = _sparse(cache, fmt, ks)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()


def test_the_vllm_surface_takes_an_fp8_e5m2_cache_typed_float8_e4m3fn_as_vllm_passes_it():
    """vLLM's layer views the fp8_e5m2 cache as float8_e4m3fn; the surface reads its bytes by the format."""
    cache, ks = _latent("fp8_e5m2", L=512 - 64, R=64)
    bt, cu = torch.tensor([[1, 0, 3]], dtype=I32), torch.tensor([0, 20], dtype=I32)
    got = torch.full((20, 512), float("nan"))
    vops.gather_and_maybe_dequant_cache(cache.view(torch.float8_e4m3fn), got, bt, cu, torch.zeros(20, dtype=I32),
                                        20, "fp8_e5m2", ks)
    want = torch.empty(20, 512)
    ref.gather_ref(cache, want, bt, cu, 1, "fp8_e5m2", ks)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt,dtype", WRONG[:2])
def test_the_layer_refuses_the_other_float8_type_naming_kv_cache_dtype(fmt, dtype):
    from mla_ext.config.policy import CacheConfig
    from mla_ext.prefill.layer import MLAPrefill
    from helpers.prefill import BLOCK, TINY, make_weight

    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L) / 32
    layer = MLAPrefill(TINY, CacheConfig(fmt, block_size=BLOCK), make_weight("dense", w), layer=1)
    cache = torch.zeros(layer.spec.cache_shape(2), dtype=torch.uint8)
    layer.check_cache(cache)  # bytes: accepted
    layer.check_cache(cache.view(get_format(fmt).fp8_dtype))  # the format's own float8 type: accepted
    with pytest.raises(ValueError, match=rf"kv_cache: layer 1 \(kv_cache_dtype '{fmt}'\) expects .* got .* {dtype}"):
        layer.check_cache(cache.view(dtype))
