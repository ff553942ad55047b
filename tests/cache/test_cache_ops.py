"""C++ CPU (and, with a GPU, CUDA) cache ops against mla_ext.cache.reference.

Every comparison is bitwise: the kernels round exactly like the reference
(same fp8 decode, same fp32 products, round-to-nearest-even), which is
stricter than the SPEC §9 tolerances. Outputs are poisoned first, and guard
regions around dst prove that nothing outside it is written.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mla_ext import _ext
from mla_ext.cache import api, reference as ref
from mla_ext.config.formats import get_format
from helpers.gather import make_batch, make_cache, poisoned_dst
from helpers.numeric import same_bits

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FORMATS = ["auto", "fp8", "fp8_e5m2", "fp8_ds_mla"]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _dst_dtypes(fmt_name):
    fmt = get_format(fmt_name)
    if fmt.is_native:
        return [torch.bfloat16]
    return [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def _dst_width(fmt_name, dst_dtype, L, R, entry):
    if get_format(fmt_name).quant_mode == 2 and dst_dtype != torch.uint8:
        return L + R
    return entry


def _run_gather_case(device, fmt_name, dst_dtype, num_reqs, block_size, L, R, strided, seed,
                     long_req, with_starts):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if get_format(fmt_name).quant_mode == 2:
        L = 512
    num_blocks = rng.randint(2, max(3, 512 // block_size))
    max_blocks = max(1, min(num_blocks * 2, 1024 // block_size))
    cache, k_scale = make_cache(fmt_name, num_blocks, block_size, L, R, strided=strided, gen=gen)
    lens = None
    if long_req:
        cap = max_blocks * block_size
        lens = [rng.choice([0, 1, rng.randint(0, 8)]) for _ in range(num_reqs)]
        lens[rng.randrange(num_reqs)] = rng.randint(cap // 2, cap)
    bt, cu, starts = make_batch(rng, num_reqs, num_blocks, block_size, max_blocks, lens=lens)
    if not with_starts:
        starts = None
        # Without starts every request reads from token 0: keep lengths inside the table.
        cap = max_blocks * block_size
        lens = [min(int(cu[i + 1] - cu[i]), cap) for i in range(num_reqs)]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    entry = cache.shape[2]
    width = _dst_width(fmt_name, dst_dtype, L, R, entry)
    if dst_dtype == torch.uint8:
        dst_dtype = cache.dtype
    total = int(cu[-1])
    dst, buf = poisoned_dst(total + 2, width, dst_dtype)  # 2 spare rows stay untouched
    want = buf.clone()
    ref.gather_ref(cache, want[3:3 + total + 2], bt, cu, num_reqs, fmt_name, k_scale, starts)
    dev = torch.device(device)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    buf_d = buf.to(dev)
    api.gather_and_maybe_dequant_cache(to(cache), buf_d[3:3 + total + 2], to(bt), to(cu), num_reqs,
                                       fmt_name, to(k_scale), to(starts), validate=True)
    assert same_bits(buf_d.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@given(
    fmt_name=st.sampled_from(FORMATS),
    dst_i=st.integers(0, 3),
    num_reqs=st.integers(1, 64),
    block_size=st.sampled_from([1, 16, 64]),
    LR=st.sampled_from([(512, 64), (256, 64)]),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    long_req=st.booleans(),
    with_starts=st.booleans(),
)
@SETTINGS
def test_gather_matches_reference(device, fmt_name, dst_i, num_reqs, block_size, LR, strided, seed,
                                  long_req, with_starts):
    dtypes = _dst_dtypes(fmt_name)
    _run_gather_case(device, fmt_name, dtypes[dst_i % len(dtypes)], num_reqs, block_size, *LR,
                     strided, seed, long_req, with_starts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt_name", ["fp8", "fp8_ds_mla", "auto"])
def test_gather_out_of_range_ids_give_zero_rows(device, fmt_name):
    rng = random.Random(7)
    cache, k_scale = make_cache(fmt_name, 8, 16, 512, 64, gen=torch.Generator().manual_seed(1))
    bt, cu, starts = make_batch(rng, 6, 8, 16, 4, bad_ids=True, lens=[40, 0, 1, 64, 17, 33])
    bt = bt[:, :3]  # some requests now also run past the table width
    dtype = torch.bfloat16
    dst, buf = poisoned_dst(int(cu[-1]), 576, dtype)
    want = buf.clone()
    ref.gather_ref(cache, want[3:-3], bt, cu, 6, fmt_name, k_scale, starts)
    dev = torch.device(device)
    buf_d = buf.to(dev)
    api.gather_and_maybe_dequant_cache(cache.to(dev), buf_d[3:-3], bt.to(dev), cu.to(dev), 6, fmt_name,
                                       k_scale.to(dev), starts.to(dev))
    assert same_bits(buf_d.cpu(), want)
    assert (want[3:-3] == 0).all(dim=1).any()  # the case really has zero rows
    with pytest.raises(ValueError, match=r"request \d+.*block"):
        api.gather_and_maybe_dequant_cache(cache.to(dev), buf_d[3:-3], bt.to(dev), cu.to(dev), 6,
                                           fmt_name, k_scale.to(dev), starts.to(dev), validate=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt_name", ["fp8", "fp8_e5m2", "fp8_ds_mla", "auto"])
@pytest.mark.parametrize("col", [8, 1])
def test_gather_column_guards_and_alignment(device, fmt_name, col):
    """dst as a column slice of a wider poisoned buffer: pad columns stay untouched.

    col=1 also misaligns dst rows and the cache entries (odd byte padding), so
    the kernels' element-by-element paths run, not only the vectorised ones.
    """
    gen = torch.Generator().manual_seed(3)
    cache, k_scale = make_cache(fmt_name, 6, 16, 512, 64, strided=True, gen=gen)
    if col == 1:  # re-home the cache at an odd byte offset with odd entry padding
        nb, B, E = cache.shape
        raw = torch.full((nb * B * (E + 3) + 5,), 0x5A, dtype=torch.uint8)
        view = raw[1:1 + nb * B * (E + 3)].view(nb, B, E + 3)[:, :, :E] if cache.element_size() == 1 else None
        if view is not None:
            view.copy_(cache.view(torch.uint8))
            cache = view.view(cache.dtype)
    bt, cu, starts = make_batch(random.Random(3), 5, 6, 16, 6)
    total = int(cu[-1])
    width = 576
    dtype = torch.bfloat16
    buf = torch.full((total, width + 40), float("nan"), dtype=dtype)
    want = buf.clone()
    ref.gather_ref(cache, want[:, col:col + width], bt, cu, 5, fmt_name, k_scale, starts)
    dev = torch.device(device)
    buf_d = buf.to(dev)
    api.gather_and_maybe_dequant_cache(cache.to(dev) if device == "cpu" else _to_device_keep_layout(cache, dev),
                                       buf_d[:, col:col + width], bt.to(dev), cu.to(dev), 5, fmt_name,
                                       k_scale.to(dev), starts.to(dev))
    assert same_bits(buf_d.cpu(), want)


def _to_device_keep_layout(t: torch.Tensor, dev) -> torch.Tensor:
    """Copy a strided view to `dev` keeping its strides and storage offset."""
    base = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(base).to(dev)
    return torch.empty(0, dtype=t.dtype, device=dev).set_(
        whole.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_cp_gather_copies_raw_bytes(device, fmt_name):
    cache, _ = make_cache(fmt_name, 10, 16, 512, 64, strided=True, gen=torch.Generator().manual_seed(5))
    bt, cu, starts = make_batch(random.Random(5), 9, 10, 16, 8)
    dst, buf = poisoned_dst(int(cu[-1]), cache.shape[2], cache.dtype)
    want = buf.clone()
    ref.cp_gather_ref(cache, want[3:-3], bt, cu, 9, starts)
    dev = torch.device(device)
    buf_d = buf.to(dev)
    api.cp_gather_cache(cache.to(dev), buf_d[3:-3], bt.to(dev), cu.to(dev), 9, starts.to(dev), validate=True)
    assert same_bits(buf_d.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@given(
    fmt_name=st.sampled_from(FORMATS),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    T=st.integers(0, 200),
    R=st.sampled_from([64, 0]),
    strided=st.booleans(),
    scale=st.sampled_from([1.0, 0.0137, 3.5]),
    seed=st.integers(0, 2**31 - 1),
)
@SETTINGS
def test_write_matches_reference(device, fmt_name, in_dtype, T, R, strided, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    fmt = get_format(fmt_name)
    L = 512
    num_blocks, B = 16, 16
    cache_dtype = in_dtype if fmt.is_native else torch.uint8
    entry = fmt.entry_elems(L, R)
    if strided:
        base = torch.randint(0, 255, (2, num_blocks, B + 1, entry + 16), generator=gen, dtype=torch.uint8)
        base = base.view(torch.uint8)
        if cache_dtype != torch.uint8:
            base = torch.randn(2, num_blocks, B + 1, entry + 16, generator=gen).to(cache_dtype)
        cache = base[1, :, :B, :entry]
    else:
        base = torch.randn(num_blocks, B, entry, generator=gen).to(cache_dtype) if cache_dtype != torch.uint8 \
            else torch.randint(0, 255, (num_blocks, B, entry), generator=gen, dtype=torch.uint8)
        cache = base
    kv_c = (torch.randn(T, L, generator=gen) * 40).to(in_dtype)
    k_pe = (torch.randn(T, R, generator=gen) * 3).to(in_dtype)
    if T:
        kv_c[0, :7] = torch.tensor([0.0, -0.0, 1e-9, 6e4, -6e4, 448.0, 1e-3])  # saturation, subnormals (finite in fp16)
    slots = torch.randperm(num_blocks * B + 8, generator=gen)[:T] - 4  # some -ve / past the end
    slots = torch.where(slots < 0, torch.full_like(slots, -1), slots)
    k_scale = torch.tensor([scale], dtype=torch.float32)
    want = base.clone()
    want_cache = want[1, :, :B, :entry] if strided else want
    ref.concat_and_cache_mla_ref(kv_c, k_pe, want_cache, slots, fmt_name, k_scale)
    dev = torch.device(device)
    got = base.to(dev)
    got_cache = got[1, :, :B, :entry] if strided else got
    api.concat_and_cache_mla(kv_c.to(dev), k_pe.to(dev), got_cache, slots.to(dev), fmt_name, k_scale.to(dev))
    assert same_bits(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt_name", ["fp8", "fp8_e5m2", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compute_kv_scale_matches_reference(device, fmt_name, dtype):
    gen = torch.Generator().manual_seed(11)
    kv_c = (torch.randn(333, 512, generator=gen) * 7).to(dtype)
    k_pe = (torch.randn(333, 64, generator=gen) * 20).to(dtype)
    k_pe[5, 3] = float("nan")  # ignored
    kv_c[2, 1] = float("inf")  # ignored
    want = ref.compute_kv_scale_ref(kv_c, k_pe, fmt_name)
    got = api.compute_kv_scale(kv_c.to(device), k_pe.to(device), fmt_name).cpu()
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert torch.equal(got, want)
    if fmt_name != "fp8_ds_mla":
        zeros = torch.zeros(4, 512, dtype=dtype, device=device)
        s = api.compute_kv_scale(zeros, zeros[:, :64], fmt_name)
        assert float(s) == ref.MIN_KV_SCALE or float(s) == pytest.approx(ref.MIN_KV_SCALE)


def test_compute_kv_scale_refuses_native_layers():
    x = torch.randn(2, 512)
    for name in ("auto", "bfloat16", "float16"):
        with pytest.raises(ValueError, match="not quantized"):
            api.compute_kv_scale(x, x[:, :64], name)
        with pytest.raises(ValueError, match="not quantized"):
            ref.compute_kv_scale_ref(x, x[:, :64], name)


def test_validate_write_names_token_and_slot():
    cache = torch.zeros(2, 16, 576, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(3, 512), torch.randn(3, 64)
    with pytest.raises(ValueError, match="token 1 has slot 32"):
        api.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 32, -1]), "fp8", torch.ones(1),
                                 validate=True)
    api.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 32, -1]), "fp8", torch.ones(1))
    assert (cache[0, 1:] == 0).all() and (cache[1] == 0).all()


def _gather_args(**over):
    args = dict(
        src_cache=torch.zeros(4, 16, 576, dtype=torch.uint8),
        dst=torch.zeros(8, 576, dtype=torch.bfloat16),
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        cu_seq_lens=torch.tensor([0, 4, 8], dtype=torch.int32),
        num_reqs=2, kv_cache_dtype="fp8", k_scale=torch.ones(1),
        seq_starts=None,
    )
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(kv_cache_dtype="fp9"), "unknown KV-cache format"),
    (dict(src_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16), kv_cache_dtype="auto",
          dst=torch.zeros(8, 576, dtype=torch.float16)), "native"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table"),
    (dict(cu_seq_lens=torch.tensor([0, 4], dtype=torch.int32)), "num_reqs"),
    (dict(dst=torch.zeros(8, 570, dtype=torch.bfloat16)), "dst: expected 576 columns"),
    (dict(dst=torch.zeros(8, 576, dtype=torch.int16)), "dst"),
    (dict(k_scale=torch.tensor([float("nan")])), "k_scale"),
    (dict(k_scale=torch.tensor([0.0])), "k_scale"),
    (dict(k_scale=torch.ones(2)), "k_scale"),
    (dict(src_cache=torch.zeros(4, 16, 1152, dtype=torch.uint8)[:, :, ::2]), "contiguous"),
    (dict(src_cache=torch.zeros(4, 16, 576, dtype=torch.uint8), kv_cache_dtype="fp8_ds_mla"), "656"),
    (dict(block_table=torch.zeros(1, 2, dtype=torch.int32)), "block_table"),
])
def test_gather_argument_errors(over, match):
    with pytest.raises(ValueError, match=match):
        api.gather_and_maybe_dequant_cache(**_gather_args(**over))


def test_gather_errors_from_the_op_itself():
    """Direct torch.ops callers get the same class of error from the C++ checks."""
    ops = _ext.ops()
    a = _gather_args(src_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16), kv_cache_dtype="auto",
                     dst=torch.zeros(8, 576, dtype=torch.float16))
    with pytest.raises(ValueError, match="native"):
        ops.gather_and_maybe_dequant_cache(*a.values())
    a = _gather_args(kv_cache_dtype="nope")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ops.gather_and_maybe_dequant_cache(*a.values())
    with pytest.raises(ValueError, match="same dtype|cache's dtype"):
        ops.cp_gather_cache(torch.zeros(2, 4, 576, dtype=torch.uint8), torch.zeros(4, 576), torch.zeros(1, 1, dtype=torch.int32),
                            torch.tensor([0, 4], dtype=torch.int32), 1)


def test_zero_tokens_is_a_noop():
    a = _gather_args(cu_seq_lens=torch.tensor([0, 0, 0], dtype=torch.int32))
    a["dst"].fill_(7)
    api.gather_and_maybe_dequant_cache(**a)
    assert (a["dst"] == 7).all()
    api.gather_and_maybe_dequant_cache(**_gather_args(num_reqs=0, dst=torch.zeros(0, 576, dtype=torch.bfloat16)))


def test_backend_report_and_explain():
    rows = api.backend_report("cpu")
    ops = {op for op, _, _ in rows}
    assert ops == {"gather", "cp_gather", "write", "kv_scale"}
    cpu = [r for op, b, r in rows if b == "cpu"]
    assert all(r == [] for r in cpu)
    cuda = [r for op, b, r in rows if b.startswith("cuda")]
    assert len(cuda) == 4 and all(cuda)  # one CUDA kernel per op; CPU tensors: each states why not
    inp = api._probe_inputs(torch.device("cpu"))["gather"][1]
    assert "uses 'cpu'" in api.explain("gather", inp)


def test_fake_kernels_trace_under_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        kv = torch.empty(4, 512)
        s = torch.ops.mla_ext.compute_kv_scale(kv, kv[:, :64], "fp8")
        assert s.shape == (1,) and s.dtype == torch.float32
        a = _gather_args()
        a = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        torch.ops.mla_ext.gather_and_maybe_dequant_cache(*a.values())


def test_dispatcher_forces_triton_and_states_reasons():
    """The gather dispatcher can be forced to the Triton backend (interpreter on CPU)."""
    from mla_ext.dispatch import NoBackendError

    cache, k_scale = make_cache("fp8_ds_mla", 4, 16, 512, 64, gen=torch.Generator().manual_seed(9))
    bt, cu, starts = make_batch(random.Random(9), 3, 4, 16, 4, lens=[20, 1, 9])
    dst, buf = poisoned_dst(int(cu[-1]), 576, torch.float32)
    want = buf.clone()
    ref.gather_ref(cache, want[3:-3], bt, cu, 3, "fp8_ds_mla", k_scale, starts)
    inp = api.GatherInputs(cache, dst, bt, cu, 3, "fp8_ds_mla", k_scale, starts)
    if api.GATHER.get("triton_paged").not_supported_reasons(inp):
        pytest.skip("Triton cannot run here: " + "; ".join(api.GATHER.get("triton_paged").not_supported_reasons(inp)))
    dst.fill_(float("nan"))
    with api.GATHER.force("triton_paged"):
        assert "uses 'triton_paged'" in api.explain("gather", inp)
        api.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 3, "fp8_ds_mla", k_scale, starts)
    assert same_bits(buf, want)
    with api.GATHER.force("cuda_paged"), pytest.raises(NoBackendError, match="cuda"):
        api.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 3, "fp8_ds_mla", k_scale, starts)


@pytest.mark.cuda
def test_cuda_gather_is_graph_capturable():
    cache, k_scale = make_cache("fp8", 8, 16, 512, 64, gen=torch.Generator().manual_seed(4), device="cuda")
    bt, cu, starts = make_batch(random.Random(4), 4, 8, 16, 8, lens=[30, 0, 17, 50])
    bt, cu, starts = bt.cuda(), cu.cuda(), starts.cuda()
    dst = torch.full((int(cu[-1].item()), 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    api.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 4, "fp8", k_scale, starts)  # warm-up
    dst.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        api.gather_and_maybe_dequant_cache(cache, dst, bt, cu, 4, "fp8", k_scale, starts)
    g.replay()
    torch.cuda.synchronize()
    want = torch.empty(dst.shape, dtype=dst.dtype)
    ref.gather_ref(cache.cpu(), want, bt.cpu(), cu.cpu(), 4, "fp8", k_scale.cpu(), starts.cpu())
    assert same_bits(dst.cpu(), want)


@pytest.mark.parametrize("op", ["gather", "cp_gather"])
def test_validate_rejects_rows_past_dst(op):
    """Checked mode: cu_seq_lens past dst would silently drop context rows (the
    kernels clip at dst.size(0)); validate=True names the request instead."""
    a = _gather_args(dst=torch.zeros(6, 576, dtype=torch.bfloat16))
    if op == "cp_gather":
        a["dst"] = torch.zeros(6, 576, dtype=torch.uint8)
        del a["kv_cache_dtype"], a["k_scale"]
        fn = api.cp_gather_cache
    else:
        fn = api.gather_and_maybe_dequant_cache
    with pytest.raises(ValueError, match=r"cu_seq_lens: request 1 ends at row 8 .* dst has 6 rows"):
        fn(**a, validate=True)
    fn(**a)  # unchecked: the documented clip, no error


def test_explain_unknown_op_lists_the_ops():
    with pytest.raises(ValueError, match="op: unknown 'foo'; expected one of"):
        api.explain("foo", None)


def test_upstream_style_gather_call_is_an_error_not_a_wrong_gather():
    """Upstream passes (…, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype, …);
    here that slot is num_reqs: a ported call must fail loudly."""
    a = _gather_args()
    token_to_seq = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache_dtype|num_reqs"):
        api.gather_and_maybe_dequant_cache(a["src_cache"], a["dst"], a["block_table"], a["cu_seq_lens"],
                                           token_to_seq, 8, "fp8", a["k_scale"])
