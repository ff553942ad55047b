"""The Triton path of mla_ext's fused_norm_rope / fused_q (mla_ext/vllm/triton_dsa_model_ops.py),
forced on the CPU under TRITON_INTERPRET=1, against the torch path (dsa_model_ops' CPU backend) on
the seeded cases of dsa_fused_cases.py: the same caches and bf16 / e4m3 outputs byte for byte
(element-wise math in the same order; the norms' sums in another order happen to round alike
here), fp32 outputs within 8 ulps (the reduction order); every output element written (poisoned
outputs), padding slots and slots past a cache untouched. CUDA: the same on a GPU, one kernel per
op, CUDA-graph capture. No vLLM needed."""
from __future__ import annotations

import pytest
import torch

from clients import dsa_fused_cases as cases
from mla_ext.vllm import dsa_model_ops as M

TRITON = "triton"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _to(obj, dev):
    return obj.to(dev) if isinstance(obj, torch.Tensor) else obj


def _norm_rope_pair(name: str, dev: str = "cpu"):
    """(torch path on the CPU, Triton path on dev) runs of case `name`: [ret, args, kwargs] each."""
    runs = []
    for backend, dev in (("torch", "cpu"), (TRITON, dev)):
        args, kwargs = cases.norm_rope_case(name)
        args, kwargs = [_to(a, dev) for a in args], {k: _to(v, dev) for k, v in kwargs.items()}
        with M.NORM_ROPE.force(backend):
            ret = M.fused_norm_rope(*args, **kwargs)
        runs.append([ret, args, kwargs])
    return runs


def _check_norm_rope(name: str, dev: str = "cpu") -> None:
    (r0, a0, k0), (r1, a1, k1) = _norm_rope_pair(name, dev)
    cpu = lambda t: t.cpu()  # noqa: E731
    args, kwargs = [_to(a, "cpu") for a in a1], {k: _to(v, "cpu") for k, v in k1.items()}
    other = {"ret": cpu(r0), "args": [_to(a, "cpu") for a in a0], "kwargs": {k: _to(v, "cpu") for k, v in k0.items()}}
    cases.compare_norm_rope(name, cpu(r1), args, kwargs, other, exact=True)  # NaN poison gone, slots, topk
    if dev != "cpu":  # a GPU's sums may round a row's rstd one ulp apart: compare_norm_rope's bounds
        return
    for key in ("mla_kv_cache", "indexer_k_cache"):  # whole caches: written rows equal, the rest poison
        if key in k0:
            assert torch.equal(_bytes(k0[key]), _bytes(k1[key])), key
    outs = [("ret", r0, r1)] + [(k, k0[k], k1[k]) for k in ("kv_c_out", "k_pe_out", "index_k_out") if k in k0]
    for what, a, b in outs:
        if a.dtype != torch.float32:
            assert torch.equal(_bytes(a), _bytes(b)), what


@pytest.mark.parametrize("name", list(cases.NORM_ROPE_CASES))
def test_norm_rope_triton_matches_the_torch_path(name):
    _check_norm_rope(name)


@pytest.mark.parametrize("name", list(cases.Q_CASES))
def test_fused_q_triton_matches_the_torch_path_bytewise(name):
    args, kwargs = cases.q_case(name)
    want = M.fused_q(*args, **kwargs)
    with M.FUSED_Q.force(TRITON):
        got = M.fused_q(*cases.q_case(name)[0], **kwargs)
    cases.compare_q(args, kwargs, got, want, exact=True)
    for i, (g, w) in enumerate(zip(got, want)):
        if kwargs["has_indexer"] or i == 2:
            assert torch.equal(_bytes(g), _bytes(w)), i


def test_fused_q_triton_writes_every_output_element():
    """The outputs fused_q allocates, poisoned (NaN / 0xFF bytes) before the Triton launch."""
    for name in ("bf16-fp8q-neox", "bf16-bf16q-interleave"):
        args, kwargs = cases.q_case(name)
        iq, w, mqa = M.fused_q(*args, **kwargs)
        outs = [torch.full_like(_bytes(mqa), 0x7F).view(mqa.dtype), torch.full_like(_bytes(iq), 0xFF).view(iq.dtype),
                torch.full_like(w, float("nan"))]
        x = M.QInputs(*args, kwargs["has_indexer"], kwargs["index_rope_interleave"], kwargs["quantize_mqa"], *outs)
        with M.FUSED_Q.force(TRITON):
            M.FUSED_Q(x)
        for got, want in zip(outs, (mqa, iq, w)):
            assert torch.equal(_bytes(got), _bytes(want)), name


def test_norm_rope_triton_fp16_outputs_fp16_cache_int32_slots():
    runs = []
    for backend in ("torch", TRITON):
        args, kw = cases.norm_rope_case("bf16-auto-neox")
        for key, like in (("kv_c_out", args[4]), ("k_pe_out", args[7]), ("q_c_out", args[1])):
            kw[key] = torch.full(like.shape, float("nan"), dtype=torch.float16)
        kw["mla_kv_cache"] = torch.randn(kw["mla_kv_cache"].shape, generator=torch.Generator().manual_seed(1)).half()
        kw["slot_mapping"] = kw["slot_mapping"].int()
        with M.NORM_ROPE.force(backend):
            M.fused_norm_rope(*args, **kw)
        runs.append(kw)
    for key in ("kv_c_out", "k_pe_out", "q_c_out", "mla_kv_cache", "indexer_k_cache"):
        assert torch.equal(_bytes(runs[0][key]), _bytes(runs[1][key])), key
        assert not runs[1][key].view(torch.uint8 if key == "indexer_k_cache" else torch.float16).isnan().any()


def test_norm_rope_triton_skips_slots_past_the_caches():
    """A slot at or past num_blocks * block_size writes nothing (the torch path's writers refuse it on
    the CPU; on CUDA nothing checks on the host, which would sync)."""
    args, kwargs = cases.norm_rope_case("bf16-ds_mla-interleave")
    _, poison = cases.norm_rope_case("bf16-ds_mla-interleave")
    nslots = cases.NUM_BLOCKS * kwargs["mla_kv_cache"].shape[1]
    kwargs["slot_mapping"] = torch.full((cases.T,), nslots, dtype=torch.int64)
    kwargs["indexer_slot_mapping"] = torch.full((cases.T,), nslots + 3, dtype=torch.int32)
    with M.NORM_ROPE.force(TRITON):
        M.fused_norm_rope(*args, **kwargs)
    for key in ("mla_kv_cache", "indexer_k_cache"):
        assert torch.equal(kwargs[key], poison[key]), key


def test_the_cpu_defaults_to_the_torch_path_and_reports_both():
    args, kwargs = cases.norm_rope_case("bf16-auto-neox")
    rows = M.backend_report("cpu")
    assert {(op, b) for op, b, _ in rows} == {("dsa_fused_norm_rope", "triton"), ("dsa_fused_norm_rope", "torch"),
                                               ("dsa_fused_q", "triton"), ("dsa_fused_q", "torch")}
    assert all(r for op, b, r in rows if b == "triton")  # the interpreter only when forced
    from mla_ext.dispatch import all_dispatchers

    assert {"dsa_fused_norm_rope", "dsa_fused_q"} <= {d.op for d in all_dispatchers()}


# -- CUDA ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(cases.NORM_ROPE_CASES))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_norm_rope_triton_on_cuda_matches_the_torch_path(name):
    _check_norm_rope(name, "cuda")


@pytest.mark.parametrize("name", list(cases.Q_CASES))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_q_triton_on_cuda_matches_the_torch_path(name):
    args, kwargs = cases.q_case(name)
    want = M.fused_q(*args, **kwargs)  # the CPU torch path
    got = M.fused_q(*[_to(a, "cuda") for a in cases.q_case(name)[0]], **kwargs)  # chosen on CUDA: Triton
    cases.compare_q(args, kwargs, [g.cpu() for g in got], want, exact=True)


def _kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_launch_per_op_and_cuda_graph_capture():
    """DeepSeek-V3.2's common configuration (fp8_ds_mla latent cache, fp8 index cache, fp8 MQA
    query): one kernel per op, captured in a CUDA graph and replayed to the eager bytes."""
    args, kwargs = cases.norm_rope_case("bf16-ds_mla-interleave")
    args, kwargs = [_to(a, "cuda") for a in args], {k: _to(v, "cuda") for k, v in kwargs.items()}
    qargs, qkw = cases.q_case("bf16-fp8q-neox")
    qargs = [_to(a, "cuda") for a in qargs]
    M.fused_norm_rope(*args, **kwargs)  # compile (the dispatcher picks Triton on CUDA)
    M.fused_q(*qargs, **qkw)
    assert _kernels(lambda: M.fused_norm_rope(*args, **kwargs)) == 1
    assert _kernels(lambda: M.fused_q(*qargs, **qkw)) == 1
    eager = {k: kwargs[k].clone() for k in ("mla_kv_cache", "indexer_k_cache")}
    eager_q = M.fused_q(*qargs, **qkw)
    for key in eager:
        kwargs[key].fill_(0x55)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        M.fused_norm_rope(*args, **kwargs)
        out_q = M.fused_q(*qargs, **qkw)
    graph.replay()
    torch.cuda.synchronize()
    slots, islots = kwargs["slot_mapping"], kwargs["indexer_slot_mapping"]
    rows = lambda c, s: c.view(-1, c.shape[-1])[s[(s >= 0) & (slots >= 0)]]  # noqa: E731 - written rows
    assert torch.equal(rows(kwargs["mla_kv_cache"], slots), rows(eager["mla_kv_cache"], slots))
    B, D = kwargs["indexer_k_cache"].shape[1], cases.IDX_DIM
    for s in islots[(islots >= 0) & (slots >= 0)].tolist():
        page, o = s // B, s % B
        for c in (kwargs["indexer_k_cache"], eager["indexer_k_cache"]):
            assert c[page].view(-1)[o * D:(o + 1) * D].ne(0x55).any()
        a, b = (c[page].view(-1) for c in (kwargs["indexer_k_cache"], eager["indexer_k_cache"]))
        assert torch.equal(a[o * D:(o + 1) * D], b[o * D:(o + 1) * D])
        assert torch.equal(a[B * D + 4 * o:B * D + 4 * o + 4], b[B * D + 4 * o:B * D + 4 * o + 4])
    for a, b in zip(out_q, eager_q):
        assert torch.equal(_bytes(a), _bytes(b))
