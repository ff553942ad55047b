"""FP8 prefill keeps requests apart: the activation scales are per
token, so a non-finite value in one request's new latents (kv_c_normed) or in its
cached context changes no other request's output, bit for bit, on every cache
format, for both fp8 weight formats and on both context paths. (A per-tensor amax
over the batch made one request's NaN every request's NaN, or failed the whole
batch on the CPU with "x_scale: expected a finite value > 0, got nan".)

The per-row `x_scale` [M, 1] this needs is checked on every kv_b_proj backend
that takes fp8 activations, against the float32 reference."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from mla_ext.attention import ATTENTION
from mla_ext.config.formats import FORMATS
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.kv_b_proj.linear import DISPATCH, KvBProj
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, Batch

CTX, QL = [40, 9, 21], [3, 2, 2]  # request 0 is poisoned; 1 and 2 must not notice
WEIGHTS = {
    "fp8_block": lambda w: W.Fp8BlockWeight.from_dense(w, torch.bfloat16),
    "fp8_channel": lambda w: W.Fp8Weight.from_dense(w, per_channel=True, params_dtype=torch.bfloat16),
}
# Every cache format a bf16 model can use (float16 is refused there); each weight
# format on each format, each on one of the two context paths (the path reads
# the cache; the weight format decides the activation scales).
# Attention through the torch backend (the Triton interpreter is slow on the CPU),
# and once through the default backend.
CASES = [(f.name, wkind, path, "torch") for f in FORMATS if f.name != "float16"
         for wkind, path in (("fp8_block", "up_project"), ("fp8_channel", "absorbed"))]
CASES.append(("fp8_ds_mla", "fp8_block", "up_project", None))


def _layer(fmt: str, wkind: str, path: str) -> MLAPrefill:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    cfg = CacheConfig(kv_cache_dtype=fmt, block_size=BLOCK)
    return MLAPrefill(TINY, cfg, WEIGHTS[wkind](w), layer=1, use_fp8_prefill=True,
                      workspace_rows_override=32, max_num_seqs=8, context_attention=path)


def _run(layer: MLAPrefill, batch: Batch, kv_c_new: torch.Tensor, attention: str | None = None) -> torch.Tensor:
    k_scale = torch.tensor([0.05])
    cache = batch.fill_cache(layer, k_scale)
    meta = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, k_scale, block_size=BLOCK)
    with ATTENTION.force(attention):
        return layer(batch.q, kv_c_new, batch.k_pe_new, cache, meta)


@pytest.mark.parametrize("fmt, wkind, path, attention", CASES)
def test_one_poisoned_request_leaves_the_others_bit_for_bit(fmt, wkind, path, attention):
    layer = _layer(fmt, wkind, path)
    run = functools.partial(_run, attention=attention)
    assert layer.activation_dtype == torch.float8_e4m3fn  # the FP8 prefill path is under test
    batch = Batch(ctx_lens=CTX, q_lens=QL, seed=3)
    clean = run(layer, batch, batch.kv_c_new)
    assert torch.isfinite(clean).all()
    others = slice(QL[0], None)
    # Request 0's new tokens, then (separately) its cached context.
    kv_c_new = batch.kv_c_new.clone()
    kv_c_new[1, 7] = float("nan")
    kv_c_new[2, 3] = float("inf")
    out = run(layer, batch, kv_c_new)
    assert not torch.isfinite(out[: QL[0]]).all()  # the poison did reach request 0
    assert torch.equal(out[others], clean[others]), "request 0's kv_c_normed changed another's output"
    batch.ctx_kv_c[0] = batch.ctx_kv_c[0].clone()
    batch.ctx_kv_c[0][5, 11] = float("nan")
    batch.ctx_kv_c[0][30, 2] = float("-inf")
    out = run(layer, batch, batch.kv_c_new)
    assert torch.equal(out[others], clean[others]), "request 0's context changed another's output"


# -- per-row x_scale on the kv_b_proj backends -------------------------------------

def _per_row_case(name: str):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(256, 512, generator=gen) * 0.05
    layer = KvBProj(W.Fp8BlockWeight.from_dense(w, torch.bfloat16) if name == "fp8_block"
                    else W.Fp8Weight.from_dense(w, per_channel=True, params_dtype=torch.bfloat16))
    x = torch.randn(6, 512, generator=gen) * torch.logspace(-2, 2, 6).view(6, 1)  # rows of very different size
    s = x.abs().amax(dim=1, keepdim=True) / 448.0
    xq = ref.quantize_e4m3(x / s)
    expect = ref.linear_ref(ref.decode_e4m3(xq) * s, layer.weight_format.dequantize_fp32())
    return layer, xq, s, expect


@pytest.mark.parametrize("name, backend", [("fp8_block", "dequant_dense"), ("fp8_channel", "dequant_dense"),
                                           ("fp8_block", "triton_fp8_block")])
def test_per_row_x_scale_on_every_fp8_backend(name, backend):
    layer, xq, s, expect = _per_row_case(name)
    with DISPATCH.force(backend):
        y = layer(xq, s)
    assert rel_fro(y, expect) <= 1e-2
    # Row 0 of a NaN scale: row 0 NaN, every other row unchanged bit for bit.
    s_bad = s.clone()
    s_bad[0] = float("nan")
    with DISPATCH.force(backend):
        y_bad = layer(xq, s_bad)
    assert torch.isnan(y_bad[0]).all() and torch.equal(y_bad[1:], y[1:])


def test_per_row_x_scale_through_scaled_mm_block(monkeypatch):
    """scaled_mm_block's activation scales [Mp, K/128] take the per-row scale in every
    group of the row (cuBLASLt emulated on the CPU, as its own tests do)."""
    from helpers.kv_b_proj import emulated_scaled_mm as _emulated_scaled_mm

    from mla_ext.kv_b_proj import scaled_mm_block as S

    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm([]))
    layer, xq, s, expect = _per_row_case("fp8_block")
    q, scales = S.quantize_activation(xq, 512, s)
    assert scales.shape == (8, 4) and torch.equal(scales[:6], s.expand(6, 4)) and (scales[6:] == 1).all()
    y = S.scaled_mm_block_linear(xq, layer.scaled_mm_block_weight("cpu"), torch.bfloat16, x_scale=s)
    assert rel_fro(y, expect) <= 1e-2


def test_x_scale_shapes():
    layer, xq, s, _ = _per_row_case("fp8_block")
    for bad in (s[:5], s.view(1, 6), s.view(6), torch.ones(6, 2)):
        with pytest.raises(ValueError, match=r"x_scale must be a one-element float tensor or per-row scales \[6, 1\]"):
            layer(xq, bad)
    with pytest.raises(ValueError, match="x_scale: expected a finite value > 0"):
        layer(xq, torch.tensor([float("nan")]))  # one scale for all rows: still refused
