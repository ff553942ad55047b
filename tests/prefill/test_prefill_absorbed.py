"""Context attention in latent space (absorbed) gives the same answer as the
up-projection path and as the one-shot oracle (SPEC §9), for every cache
format, compute dtype and kv_b_proj format; the per-chunk cost model, the
override and explain(); the Triton latent kernel under the interpreter and
compiled ahead of time for sm_86 / sm_90.

Data is random (never zeros); the oracle sees exactly what the cache holds
(decoded by the cache reference) and the dequantized weight, so what remains
is the pipeline's own error.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from mla_ext.attention import triton_latent as TL
from mla_ext.cache import api as cache_api
from mla_ext.config.formats import get_format
from mla_ext.kv_b_proj import weights as W
from mla_ext.config.models import MLAModelConfig
from mla_ext.config.policy import CacheConfig
from mla_ext.attention import latent as A
from mla_ext.prefill import context_cost as AC
from mla_ext.attention.latent_reference import (
    head_space_context_attention_reference,
    latent_context_attention_reference,
)
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.reference import mla_prefill_reference
from mla_ext.prefill.synthetic import SyntheticBatch
from helpers.benchmarks import load_benchmark
from helpers.numeric import rel_fro

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None

BLOCK = 16
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}  # SPEC §9 (fp32: ours)
DS_FORMATS = ("fp8_ds_mla", "nvfp4_ds_mla")  # need L = 512, R = 64
FORMATS = ("auto", "fp8", "fp8_e5m2") + DS_FORMATS


def model(fmt: str, dtype: torch.dtype = torch.bfloat16) -> MLAModelConfig:
    """DeepSeek latent dims where the format needs them (few, narrow heads), else
    small ones (P != V, an odd head count: a slicing mistake shows)."""
    if fmt in DS_FORMATS:
        return MLAModelConfig(name="absorbed-ds", L=512, R=64, P=32, V=32, num_heads=2, num_layers=2,
                              model_dtype=dtype, max_model_len=256)
    return MLAModelConfig(name="absorbed-small", L=64, R=16, P=16, V=32, num_heads=3, num_layers=2,
                          model_dtype=dtype, max_model_len=256)


def weight(m: MLAModelConfig, wkind: str, seed: int) -> W.WeightFormat:
    w = torch.randn(m.num_heads * (m.P + m.V), m.L, generator=torch.Generator().manual_seed(seed)) / math.sqrt(m.L)
    params = m.model_dtype if not (wkind.startswith("marlin") and m.model_dtype == torch.float32) else torch.bfloat16
    return W.quantize(wkind, w, params)


class Case:
    """One layer in two modes over one batch, and the oracle."""

    def __init__(self, fmt: str, dtype: torch.dtype, wkind: str, ctx_lens, q_lens, *, rows: int = 48,
                 seed: int = 0, modes=("absorbed", "up_project")):
        self.m = m = model(fmt, dtype)
        cfg = CacheConfig(kv_cache_dtype=fmt, block_size=BLOCK)
        wf = weight(m, wkind, seed)
        self.layers = {mode: MLAPrefill(m, cfg, wf, layer=0, workspace_rows_override=rows, max_num_seqs=8,
                                        context_attention=mode) for mode in modes}
        layer = self.layer = next(iter(self.layers.values()))
        self.batch = b = SyntheticBatch(m, ctx_lens, q_lens, BLOCK, seed=seed)
        kv_c, k_pe = b.layer_context(0)
        self.k_scale = None
        if layer.spec.format.fp8_dtype is not None and layer.spec.format.scale_kind.name == "PER_TENSOR":
            amax = max([1.0] + [float(t.float().abs().max()) for t in (kv_c, k_pe) if t.numel()])
            self.k_scale = torch.tensor([amax / (448.0 if fmt == "fp8" else 57344.0)], dtype=torch.float32)
        self.cache = b.fill_cache(layer, kv_c, k_pe, self.k_scale)
        self.meta = b.metadata(self.k_scale)

    def run(self, mode: str) -> torch.Tensor:
        b = self.batch
        return self.layers[mode](b.q, b.kv_c_new, b.k_pe_new, self.cache, self.meta)

    def oracle(self, with_context: bool = True) -> torch.Tensor:
        b, m = self.batch, self.m
        kv_c, k_pe = b.cached_rows(self.layer, self.cache, self.k_scale)
        if not with_context:
            kv_c, k_pe = [t[:0] for t in kv_c], [t[:0] for t in k_pe]
        return mla_prefill_reference(b.q, b.kv_c_new, b.k_pe_new, kv_c, k_pe, b.q_lens,
                                     self.layer.kv_b_proj.weight_format.dequantize_fp32(), m.P, m.V,
                                     self.layer.softmax_scale)

    def check(self, dtype: torch.dtype) -> dict:
        outs = {mode: self.run(mode) for mode in self.layers}
        ref = self.oracle()
        errs = {}
        for mode, out in outs.items():
            assert out.dtype == dtype and not torch.isnan(out).any(), mode
            errs[mode] = rel_fro(out, ref)
            assert errs[mode] <= TOL[dtype], (mode, errs, self.layer.explain())
        if len(outs) == 2:
            a, u = outs.values()
            errs["absorbed_vs_up"] = rel_fro(a, u)
            assert errs["absorbed_vs_up"] <= TOL[dtype], errs
        return errs


# -- the algebra ------------------------------------------------------------------------

@pytest.mark.parametrize("R", [16, 0])
def test_latent_reference_is_the_head_space_reference(R):
    gen = torch.Generator().manual_seed(3)
    N, P, V, L = 3, 16, 24, 40
    q_lens, ctx = [2, 3, 1], [9, 0, 14]
    q = torch.randn(sum(q_lens), N, P + R, generator=gen)
    w = torch.randn(N * (P + V), L, generator=gen) / math.sqrt(L)
    kv = [torch.randn(c, L, generator=gen) for c in ctx]
    pe = [torch.randn(c, R, generator=gen) for c in ctx]
    o1, l1 = latent_context_attention_reference(q, kv, pe, q_lens, w, P, V, 0.2)
    o2, l2 = head_space_context_attention_reference(q, kv, pe, q_lens, w, P, V, 0.2)
    assert torch.allclose(o1, o2, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    assert torch.allclose(l1[~torch.isinf(l1)], l2[~torch.isinf(l2)], rtol=1e-6)
    # the request without context: o = 0, lse = -inf; the others see keys
    assert (o1[2:5] == 0).all() and torch.isinf(l1[:, 2:5]).all() and torch.isfinite(l1[:, :2]).all()
    assert o1[:2].abs().sum() > 0


# -- the layer: absorbed == up_project == oracle -----------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_cache_format_and_dtype(fmt, dtype):
    # a long request split across chunks, one without context, single tokens
    case = Case(fmt, dtype, "dense", [70, 0, 21, 1, 40], [3, 2, 1, 2, 4], seed=FORMATS.index(fmt))
    case.check(dtype)
    assert rel_fro(case.run("absorbed"), case.oracle(with_context=False)) > 0.1  # the context matters


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("wkind", sorted(W.RECIPES))
def test_every_kv_b_proj_format(wkind, dtype):
    fmt = "fp8_ds_mla" if dtype == torch.bfloat16 else "nvfp4_ds_mla"
    Case(fmt, dtype, wkind, [50, 7, 0], [2, 3, 1], seed=7).check(dtype)


def test_fp32_with_quantized_weights():
    for wkind in ("fp8_block", "nvfp4", "int4_group"):
        Case("fp8_ds_mla", torch.float32, wkind, [33, 4], [2, 1], seed=8).check(torch.float32)


def test_auto_mixes_paths_per_chunk_and_matches_the_oracle():
    """A request with many new tokens takes up_project, requests with few take
    absorbed, in one batch; the result is the oracle's."""
    case = Case("fp8_ds_mla", torch.bfloat16, "fp8_block", [64, 20, 0, 40], [60, 1, 2, 3], rows=64,
                modes=("auto",))
    layer = case.layers["auto"]
    plan = case.meta.plan(layer.workspace_rows, layer.chunk_alignment)
    paths = [layer.context_attention.choose(c, "cpu").path for c in plan.chunks]
    assert "absorbed" in paths and "up_project" in paths, (paths, layer.explain_context(case.meta))
    text = layer.explain_context(case.meta)
    assert text.count("absorbed (cost model") == paths.count("absorbed")
    case.check(torch.bfloat16)


def test_absorbed_never_up_projects_the_context(monkeypatch):
    from mla_ext.kv_b_proj.linear import KvBProj

    case = Case("fp8", torch.bfloat16, "dense", [70, 5], [2, 3])
    seen = []
    call = KvBProj.__call__
    monkeypatch.setattr(KvBProj, "__call__", lambda self, x, *a, **k: (seen.append(x.shape[0]), call(self, x, *a, **k))[1])
    for mode, want in (("absorbed", [5]), ("up_project", [5, 48, 27])):  # new tokens, then the chunks
        seen.clear()
        case.run(mode)
        assert seen == want, (mode, seen)


def test_absorbed_weights_are_views_of_the_one_cached_dequantized_weight():
    case = Case("fp8_ds_mla", torch.bfloat16, "nvfp4", [20], [2])
    layer = case.layers["absorbed"]
    m = case.m
    w_uk, w_uv_t = A.absorbed_weights(layer.kv_b_proj, m.num_heads, m.P, m.V, torch.bfloat16, "cpu")
    again = A.absorbed_weights(layer.kv_b_proj, m.num_heads, m.P, m.V, torch.bfloat16, "cpu")
    dense = layer.kv_b_proj.dense_weight(torch.bfloat16, torch.device("cpu"))
    assert w_uk.data_ptr() == again[0].data_ptr() == dense.data_ptr()
    full = layer.kv_b_proj.weight_format.dequantize(torch.bfloat16).view(m.num_heads, m.P + m.V, m.L)
    assert torch.equal(w_uk, full[:, : m.P]) and torch.equal(w_uv_t, full[:, m.P:].transpose(1, 2))
    assert tuple(w_uk.shape) == (m.num_heads, m.P, m.L) and tuple(w_uv_t.shape) == (m.num_heads, m.L, m.V)


if given is not None:
    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        reqs=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 5)), min_size=1, max_size=5).filter(
            lambda r: sum(q for _, q in r) >= 1 and sum(c for c, q in r if q) >= 1),
        rows=st.sampled_from([16, 48, 96]),
        fmt=st.sampled_from(["fp8_ds_mla", "fp8", "auto", "nvfp4_ds_mla"]),
    )
    def test_property_absorbed_equals_up_projection(reqs, rows, fmt):
        """Any batch of (context, new tokens), chunked by any workspace: chunks that
        split requests, mix them, hold requests without context or without queries."""
        ctx, q = [c for c, _ in reqs], [n for _, n in reqs]
        Case(fmt, torch.bfloat16, "dense", ctx, q, rows=rows, seed=sum(ctx) + 7 * sum(q)).check(torch.bfloat16)


# -- the Triton latent kernel (interpreter here; CUDA below) -----------------------------

@pytest.mark.parametrize("fmt, dtype", [(f, torch.bfloat16) for f in FORMATS]
                         + [("auto", torch.float32), ("fp8", torch.float16)], ids=str)
def test_layer_with_the_triton_latent_kernel(fmt, dtype):
    with A.LATENT.force("triton"):
        Case(fmt, dtype, "dense", [40, 0, 9], [2, 1, 3], rows=48, seed=5).check(dtype)


def _paged(fmt, ctx, dtype=torch.bfloat16, L=512, R=64, seed=0):
    """A random cache in `fmt` holding `ctx` tokens per request, a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    f = get_format(fmt)
    need = [max(1, -(-c // BLOCK)) for c in ctx]
    nb = sum(need) + 2
    ids = torch.randperm(nb, generator=gen).to(torch.int32)
    table = torch.full((len(ctx), max(need) + 1), -1, dtype=torch.int32)
    cache = torch.full((nb, BLOCK, f.entry_elems(L, R)), 0x7F if f.is_quantized else float("nan"),
                       dtype=f.storage_dtype(dtype))
    ks = torch.tensor([0.04])
    at = 0
    for r, c in enumerate(ctx):
        table[r, :need[r]] = ids[at:at + need[r]]
        at += need[r]
        pos = torch.arange(c)
        slots = table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK
        kv = (torch.randn(c, L, generator=gen) * 2).to(dtype)
        pe = torch.randn(c, R, generator=gen).to(dtype)
        cache_api.concat_and_cache_mla(kv, pe, cache, slots, fmt, ks)
    return cache, table, ks


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_kernel_split_kv_and_offsets_match_the_torch_path(fmt):
    """Chunks that start inside a request's context (seq_starts), split-KV
    partials merged, a request without context rows: Triton == torch backend."""
    L, R = (512, 64) if fmt in DS_FORMATS else (64, 16)
    cache, table, ks = _paged(fmt, [300, 20, 0], L=L, R=R)
    N, q_off, c_off = 2, [0, 2, 5, 6], [0, 250, 270, 270]
    starts = torch.tensor([48, 0, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q_lat = (torch.randn(N, 6, L, generator=gen) / math.sqrt(L)).bfloat16()
    q_pe = torch.randn(6, N, R, generator=gen).bfloat16()
    args = (q_lat, q_pe, cache, fmt, table, torch.tensor(q_off, dtype=torch.int32),
            torch.tensor(c_off, dtype=torch.int32), starts, ks, 0.3)
    with A.LATENT.force("torch"):
        o_t, l_t = A.latent_context_attention(*args, q_offsets=q_off, ctx_offsets=c_off)
    assert torch.isfinite(l_t[:, :5]).all() and torch.isinf(l_t[:, 5]).all() and (o_t[:, 5] == 0).all()
    for splits in (1, 3):
        o, lse = torch.empty_like(o_t), torch.empty_like(l_t)
        TL.latent_attention_triton(*args, o, lse, 3, 250, splits=splits)
        # fp8 per-tensor: the torch path rounds the decoded rows to bf16 (the gather's
        # workspace), the interpreter keeps fp32; outputs: bf16 stores (toward zero there).
        assert torch.allclose(lse, l_t, atol=3e-3, rtol=0), (splits, (lse - l_t).abs().max())
        assert rel_fro(o, o_t) <= 1e-2, splits


@pytest.mark.parametrize("fmt", ["auto", "fp8"])
@pytest.mark.parametrize("L,R,N", [(256, 32, 3), (200, 0, 3), (384, 64, 3), (96, 16, 3), (96, 16, 80),
                                   (64, 16, 16)], ids=str)
def test_triton_kernel_latent_slices_and_head_blocks_cover_every_shape(fmt, L, R, N):
    """The kernel decodes the latent in 128-column slices (1, 2 or 4 of them): widths that are
    two slices (256), a partial last slice (200 -> 2, 384 -> 4 with one masked off), one
    slice (96), and no rope part (R = 0). Its rows are tokens x heads padded to a power of
    two: 3 heads (4-row groups), 80 (two 64-head blocks, the second 16/64 full), 16. All
    equal the torch backend, every element written."""
    cache, table, ks = _paged(fmt, [150, 37], L=L, R=R, seed=3)
    q_off, c_off = [0, 4, 7], [0, 150, 187]
    gen = torch.Generator().manual_seed(4)
    q_lat = (torch.randn(N, 7, L, generator=gen) / math.sqrt(L)).bfloat16()
    q_pe = torch.randn(7, N, R, generator=gen).bfloat16()
    args = (q_lat, q_pe, cache, fmt, table, torch.tensor(q_off, dtype=torch.int32),
            torch.tensor(c_off, dtype=torch.int32), None, ks, 0.2)
    with A.LATENT.force("torch"):
        o_t, l_t = A.latent_context_attention(*args, q_offsets=q_off, ctx_offsets=c_off)
    o, lse = torch.full_like(o_t, float("nan")), torch.full_like(l_t, float("nan"))
    TL.latent_attention_triton(*args, o, lse, 4, 150)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert torch.allclose(lse, l_t, atol=3e-3, rtol=0), (lse - l_t).abs().max()
    assert rel_fro(o, o_t) <= 1e-2


def test_out_of_range_block_ids_read_zero_rows_in_both_backends():
    """Unchecked bad ids: no read, zero rows that take part in the softmax (the
    gather's documented result), the same in the Triton kernel and the gather path."""
    cache, table, ks = _paged("fp8_ds_mla", [40], seed=4)
    table[0, 1] = cache.shape[0] + 5  # past the cache
    table[0, 2] = -3
    gen = torch.Generator().manual_seed(2)
    q_lat = torch.randn(2, 2, 512, generator=gen).bfloat16() / 20
    q_pe = torch.randn(2, 2, 64, generator=gen).bfloat16()
    off = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32)
    res = {}
    for be in ("torch", "triton"):
        with A.LATENT.force(be):
            res[be] = A.latent_context_attention(q_lat, q_pe, cache, "fp8_ds_mla", table, *off, None, ks, 0.5,
                                                 q_offsets=[0, 2], ctx_offsets=[0, 40])
    (o1, l1), (o2, l2) = res["torch"], res["triton"]
    assert torch.allclose(l1, l2, atol=1e-4) and rel_fro(o2, o1) <= 1e-2
    good_cache, good_table, _ = _paged("fp8_ds_mla", [40], seed=4)
    _, l3 = A.latent_context_attention(q_lat, q_pe, good_cache, "fp8_ds_mla", good_table, *off, None, ks, 0.5,
                                       q_offsets=[0, 2], ctx_offsets=[0, 40])
    assert (l3 - l1).abs().max() > 1e-2  # the zero rows did replace two blocks of keys


def test_latent_op_names_bad_arguments():
    q_lat = torch.randn(2, 3, 64).bfloat16()
    q_pe = torch.randn(3, 2, 16).bfloat16()
    cache, table, ks = _paged("auto", [10], L=64, R=16)
    cu = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32)
    ok = dict(q_offsets=[0, 3], ctx_offsets=[0, 10])
    with pytest.raises(ValueError, match=r"q_pe: expected \[3, 2, R\]"):
        A.latent_context_attention(q_lat, q_pe[:2], cache, "auto", table, *cu, None, ks, 0.5, **ok)
    with pytest.raises(ValueError, match="q_offsets: expected non-decreasing offsets starting at 0"):
        A.latent_context_attention(q_lat, q_pe, cache, "auto", table, *cu, None, ks, 0.5,
                                   q_offsets=[1, 3], ctx_offsets=[0, 10])
    with pytest.raises(ValueError, match="cu_seq_lens: expected an int32 tensor"):
        A.latent_context_attention(q_lat, q_pe, cache, "auto", table, cu[0], cu[1].long(), None, ks, 0.5, **ok)
    with pytest.raises(ValueError, match="softmax_scale: expected a float > 0"):
        A.latent_context_attention(q_lat, q_pe, cache, "auto", table, *cu, None, ks, float("nan"), **ok)
    with pytest.raises(ValueError, match="block_table: expected an int32 tensor"):
        A.latent_context_attention(q_lat, q_pe, cache, "auto", table.long(), *cu, None, ks, 0.5, **ok)


# -- the override, explain() and the cost model ------------------------------------------

def test_override_is_checked_and_explained():
    m = model("fp8_ds_mla")
    wf = weight(m, "dense", 0)
    cfg = CacheConfig(kv_cache_dtype="fp8_ds_mla", block_size=BLOCK)
    with pytest.raises(ValueError, match=r"context_attention: expected one of \('auto', 'absorbed', 'up_project'\), "
                                         r"got 'latent'"):
        MLAPrefill(m, cfg, wf, layer=0, context_attention="latent")
    auto = MLAPrefill(m, cfg, wf, layer=0).explain()
    assert "context attention: auto, per chunk by cost model" in auto and "predicted crossover" in auto
    assert "no measurement for cpu" in auto
    forced = MLAPrefill(m, cfg, wf, layer=0, context_attention="up_project").explain()
    assert "context attention: up_project for every chunk" in forced


def _v3_tp8_dims(entry: int = 656) -> AC.Dims:
    return AC.Dims(L=512, R=64, P=128, V=128, N=16, entry_bytes=entry, act_bytes=2)


def test_cost_model_crossover_is_the_flop_count_with_one_rate():
    assert AC.flop_crossover(512, 128, 128) == pytest.approx(512 * 256 / 768)  # 170.7
    rates = AC.STATED["cuda"]
    d = _v3_tp8_dims()
    x = AC.crossover_new_tokens(d, 65536, rates)
    # Near the FLOP count: the up-projection's bytes (gather, its output, K/V reads)
    # move it up a little, the per-query absorb / un-absorb GEMMs down.
    assert 160 <= x <= 200, x
    assert AC.crossover_new_tokens(d, 4096, rates) <= x
    assert AC.choose(d, [32768], [1], rates).path == "absorbed"
    assert AC.choose(d, [32768], [4096], rates).path == "up_project"
    # A chunk mixing requests: pairs, not the sum of queries times the rows, decide.
    assert AC.choose(d, [30000, 2000], [4, 100], rates).path == "absorbed"
    up, ab = AC.path_costs(d, [4096], [64], rates)
    assert up.flops == pytest.approx(2 * 4096 * 512 * 16 * 256 + 2 * 4096 * 64 * 16 * 320)
    assert ab.flops == pytest.approx(2 * 64 * 16 * 128 * 512 + 2 * 4096 * 64 * 16 * 1088 + 2 * 64 * 16 * 512 * 128)
    # A slower latent kernel moves the crossover down, proportionally.
    slow = AC.Rates(rates.gemm_flops, rates.attention_flops, rates.latent_flops / 2, rates.bytes_per_s,
                    rates.launch_s, "test")
    assert AC.crossover_new_tokens(d, 65536, slow) < x / 2 + 10


def test_measured_rates_come_from_the_device_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_EXT_DISPATCH_TABLES", str(tmp_path))
    AC.clear_rates_cache()
    try:
        assert AC.rates_for("cpu").source.endswith("no measurement for cpu")
        path = str(tmp_path / "cpu.json")
        rates = dict(gemm_flops=2e11, attention_flops=1e11, latent_flops=4e10, bytes_per_s=2e10, launch_s=1e-5)
        AC.write_rates(path, "cpu", rates, {"T=1/C=4096": {"order": ["absorbed", "up_project"],
                                                           "us": {"absorbed": 10.0, "up_project": 30.0}}},
                       source="test")
        got = AC.rates_for("cpu")
        assert got.latent_flops == 4e10 and got.source.startswith("measured:")
        from mla_ext import dispatch as D

        data, err = D.read_table(path)  # still a valid dispatch table (other ops keep working)
        assert err is None and data["ops"][AC.OP]["rates"]["gemm_flops"] == 2e11
        # A broken rates section falls back to the stated defaults, saying why.
        data["ops"][AC.OP]["rates"]["launch_s"] = -1
        with open(path, "w") as f:
            json.dump(data, f)
        D.clear_table_cache()
        AC.clear_rates_cache()
        with pytest.warns(D.TableWarning, match="rates must be finite and > 0"):  # one warning names the file
            assert "must be finite and > 0" in AC.rates_for("cpu").source
        with pytest.raises(ValueError, match=r"rates: expected finite numbers > 0 for \['latent_flops'\]"):
            AC.write_rates(path, "cpu", dict(rates, latent_flops=0))
    finally:
        AC.clear_rates_cache()
        monkeypatch.delenv("MLA_EXT_DISPATCH_TABLES")
        AC.clear_rates_cache()


# -- context parallelism -----------------------------------------------------------------

def _cp_worker(rank: int, world: int) -> None:
    from mla_ext.prefill.layer import ContextParallel
    from helpers.prefill import TINY, Batch, fill_local_cache, make_weight

    batch = Batch(ctx_lens=[70, 0, 21, 1, 40], q_lens=[3, 2, 1, 2, 4], seed=3)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=torch.Generator().manual_seed(9))
    w /= math.sqrt(TINY.L)
    cfg = CacheConfig(kv_cache_dtype="fp8_ds_mla", block_size=BLOCK)
    single = MLAPrefill(TINY, cfg, make_weight("fp8_block", w), layer=1, workspace_rows_override=32,
                        max_num_seqs=8, context_attention="up_project")
    want = single(batch.q, batch.kv_c_new, batch.k_pe_new, batch.fill_cache(single, None),
                  PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens))
    cp = ContextParallel(group=None, cp_size=world, rank=rank, interleave=8)
    layer = MLAPrefill(TINY, cfg, make_weight("fp8_block", w), layer=1, workspace_rows_override=32,
                       max_num_seqs=8, context_parallel=cp, context_attention="absorbed")
    cache, table = fill_local_cache(batch, layer, None, world, rank, 8)
    got = layer(batch.q, batch.kv_c_new, batch.k_pe_new, cache, PrefillMetadata(table, batch.ctx_lens, batch.q_lens))
    assert rel_fro(got, want) <= 1e-2, (rank, rel_fro(got, want))


def test_absorbed_under_context_parallelism():
    from helpers.dist import run_on_gloo_ranks

    run_on_gloo_ranks(_cp_worker, world=2)


# -- compiled ahead of time (no GPU needed) ----------------------------------------------

_AOT = r"""
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from mla_ext.attention import triton_latent as TL

SMEM = {86: 99 * 1024, 90: 227 * 1024}
i32 = "i32"

def sig(dt, cache_t):
    return dict(ql_ptr=f"*{dt}", qp_ptr=f"*{dt}", c_ptr=f"*{cache_t}", c32_ptr="*fp32", c16_ptr="*bf16",
                bt_ptr="*i32", cu_q_ptr="*i32", cu_k_ptr="*i32", st_ptr="*i32", ks_ptr="*fp32",
                o_ptr=f"*{dt}", lse_ptr="*fp32", qk_scale_log2="fp32", N=i32, num_blocks=i32,
                block_size=i32, max_blocks=i32, split_len=i32, ql_st=i32, ql_sh=i32, qp_st=i32, qp_sh=i32,
                c_blk=i32, c_ent=i32, bt_s0=i32, bt_s1=i32, o_ss=i32, o_st=i32, o_sh=i32, lse_ss=i32,
                lse_sh=i32)

# The tile each device gets (sm_86: 99 KB, mma.sync; sm_90: 227 KB, wgmma) for every decoder at
# 16 heads: it fits the shared memory stated for it, and on sm_90 the 16-bit kernel's dots are
# wgmma with its cache-row loads pipelined (cp.async); fp32 keeps IEEE FMA dots.
for cc in (86, 90):
    for mode, dt, cache_t in ((TL.MODE_DS_MLA, "bf16", "u8"), (TL.MODE_NVFP4_DS_MLA, "bf16", "u8"),
                              (TL.MODE_E4M3, "bf16", "u8"), (TL.MODE_NATIVE, "bf16", "bf16"),
                              (TL.MODE_NATIVE, "fp32", "fp32")):
        tile = TL.gpu_config(dt == "fp32", (cc // 10, cc % 10) in TL.WGMMA_CAPABILITIES, SMEM[cc], mode, 16)
        bm, bn, warps, stages = tile
        cfg = dict(L=512, R=64, MODE=mode, HAS_STARTS=True, LOWP_DOT=dt != "fp32", IEEE_FP32=dt == "fp32",
                   BLOCK_M=bm, BLOCK_H=16, BLOCK_N=bn, BLOCK_L=512, BLOCK_R=64, SLICE=TL.latent_slice(512))
        s = dict(sig(dt, cache_t), **{k: "constexpr" for k in cfg})
        params = list(sig(dt, cache_t))
        aligned = [n for n in params if n.endswith("_ptr") or n in ("ql_st", "ql_sh", "qp_st", "qp_sh", "c_blk",
                                                                    "c_ent", "o_st", "o_sh", "N", "block_size")]
        attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in aligned}  # what a real launch sees
        k = triton.compile(ASTSource(fn=TL._latent_attn_kernel, signature=s, constexprs=cfg, attrs=attrs),
                           target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
        ptx = k.asm["ptx"]
        assert k.metadata.shared <= min(SMEM[cc], TL.TILE_SMEM[tile]), (cc, mode, dt, k.metadata.shared, tile)
        if cc < 89:  # sm_86 has no fp8 types: the loaders decode bytes with integer ops
            assert "e4m3" not in ptx, (cc, mode)
        if dt == "fp32":
            assert "mma" not in ptx, (cc, mode)
        elif cc == 90:
            assert tile == TL.WGMMA_TILE and "wgmma.mma_async" in ptx and "cp.async" in ptx, (mode, tile)
        else:
            assert "mma.sync" in ptx and "wgmma" not in ptx and "cp.async" in ptx, (cc, mode, tile)
print("AOT-OK")
"""


def test_triton_latent_kernel_compiles_for_sm86_and_sm90_within_shared_memory():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _AOT], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stderr[-3000:]


# -- CUDA ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_absorbed_equals_up_projection(fmt):
    """On a GPU the absorbed path runs the Triton kernel straight from the paged cache."""
    m = MLAModelConfig(name="v3-tp8-ish", L=512, R=64, P=128, V=128, num_heads=16, num_layers=2,
                       max_model_len=4096)
    cfg = CacheConfig(kv_cache_dtype=fmt, block_size=64)
    w = torch.randn(m.num_heads * (m.P + m.V), m.L, generator=torch.Generator().manual_seed(1)) / math.sqrt(m.L)
    layers = {mode: MLAPrefill(m, cfg, W.Fp8BlockWeight.from_dense(w, torch.bfloat16).to("cuda"), layer=0,
                               context_attention=mode, max_num_seqs=8) for mode in ("absorbed", "up_project")}
    batch = SyntheticBatch(m, [3000, 0, 517, 64], [4, 3, 1, 2], 64, "cuda", seed=2)
    kv_c, k_pe = batch.layer_context(0)
    ks = torch.tensor([float(kv_c.float().abs().max()) / 448], device="cuda") if fmt.startswith("fp8") else None
    if fmt == "fp8_e5m2":
        ks = ks * 448 / 57344
    layer = layers["absorbed"]
    cache = batch.fill_cache(layer, kv_c, k_pe, ks)
    meta = batch.metadata(ks)
    c = meta.plan(layer.workspace_rows, layer.chunk_alignment).chunks[0]
    t = meta.chunk_tensors(c, "cuda")
    T = c.token_end - c.token_start
    probe = A.LatentInputs(torch.empty(m.num_heads, T, m.L, dtype=torch.bfloat16, device="cuda"),
                           torch.empty(T, m.num_heads, m.R, dtype=torch.bfloat16, device="cuda"), cache, fmt,
                           meta.block_table, t.cu_seqlens_q, t.cu_seq_lens, t.seq_starts, ks, 0.1,
                           c.cu_seqlens_q, c.cu_seq_lens)
    assert A.LATENT.choose(probe).name == "triton", A.LATENT.explain(probe)
    outs = {mode: lay(batch.q, batch.kv_c_new, batch.k_pe_new, cache, meta) for mode, lay in layers.items()}
    kv, pe = batch.cached_rows(layer, cache, ks.cpu() if ks is not None else None)
    ref = mla_prefill_reference(batch.q.cpu(), batch.kv_c_new.cpu(), batch.k_pe_new.cpu(), kv, pe, batch.q_lens,
                                layer.kv_b_proj.weight_format.dequantize_fp32().cpu(), m.P, m.V, layer.softmax_scale)
    for mode, out in outs.items():
        assert rel_fro(out.cpu(), ref) <= 1e-2, (mode, rel_fro(out.cpu(), ref))
    assert rel_fro(outs["absorbed"], outs["up_project"]) <= 1e-2


# -- the benchmark (CPU smoke run: the script and its report, not speed) ----------------------

def _bench():
    return load_benchmark("bench_absorbed")


def test_bench_measured_crossover_interpolates_where_the_ratio_crosses_one():
    b = _bench()
    rows = [dict(path="absorbed", new_tokens=t, ratio_abs_over_up=r) for t, r in ((1, 0.1), (64, 0.5), (256, 2.0))]
    x, how = b.measured_crossover(rows)
    assert 64 < x < 256 and x == pytest.approx(128.0) and "faster at 64, not at 256" in how
    assert b.measured_crossover(rows[:2])[0] == math.inf
    assert b.measured_crossover([dict(rows[2])])[0] == 0.0


def test_bench_runs_and_writes_rows_report_and_rates(tmp_path, monkeypatch):
    b = _bench()
    monkeypatch.setenv("MLA_EXT_DISPATCH_TABLES", "off")
    AC.clear_rates_cache()
    try:
        rc = b.main(["--quick", "--out", str(tmp_path), "--context", "256", "--new-tokens", "1", "128",
                     "--reps", "1"])
    finally:
        monkeypatch.delenv("MLA_EXT_DISPATCH_TABLES")
        AC.clear_rates_cache()
    assert rc == 0
    import csv

    rows = list(csv.DictReader(open(tmp_path / "absorbed_cpu.csv")))
    assert [(r["new_tokens"], r["path"], r["status"]) for r in rows] == [
        ("1", "up_project", "ok"), ("1", "absorbed", "ok"), ("128", "up_project", "ok"), ("128", "absorbed", "ok")]
    assert all(float(r["rel_err"]) <= 2e-2 and float(r["ms"]) > 0 for r in rows)
    text = (tmp_path / "absorbed_crossovers_cpu.txt").read_text()
    assert "fp8_ds_mla C=256: measured crossover" in text and "predicted" in text
    table = json.load(open(tmp_path / "dispatch_table_cpu.json"))
    rates = table["ops"]["context_attention"]["rates"]
    assert set(AC.RATE_KEYS) <= set(rates) and rates["latent_flops_by_format"]["fp8_ds_mla"] > 0
