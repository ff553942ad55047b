"""Sparse latent attention over vLLM's flat physical slots (mla_ext/sparse/slot_attention.py) against
the float64 reference (sparse_latent_attention_slots_reference): both backends (Triton under the
interpreter), native (bf16 / fp16 / fp32) and fp8_ds_mla caches, -1 padding, all-padding rows,
slots that name no row (never read: the cache is poisoned there), K not a multiple of the tile,
split-K on and off, a cache whose blocks are more than block_size rows apart; poisoned outputs;
the argument errors. CUDA tests (kernel vs reference, CUDA-graph capture and replay) need a GPU."""
import pytest
import torch

from mla_ext.cache import api as cache_api
from mla_ext.config.formats import get_format
from mla_ext.sparse import slot_attention as SA
from mla_ext.sparse.reference import sparse_latent_attention_slots_reference as reference
from mla_ext.sparse.sparse_attention import sparse_latent_attention_slots
from helpers.numeric import rel_fro

L, R, B = 512, 64, 16
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}  # SPEC section 9
CASES = [("auto", torch.bfloat16), ("auto", torch.float16), ("auto", torch.float32), ("fp8_ds_mla", torch.bfloat16),
         ("fp8_ds_mla", torch.float16)]


def _cache(fmt, dtype, g, num_blocks=6, gap=0, R_=R):
    """A poisoned cache (NaN / e4m3 NaN bytes) of `num_blocks` blocks whose rows 0..B-1 are
    written; `gap` extra rows per block sit between blocks (other layers' pages in vLLM)."""
    f = get_format(fmt)
    width = f.entry_elems(L, R_)
    full = torch.full((num_blocks, B + gap, width), 0x7F if f.is_quantized else float("nan"),
                      dtype=f.storage_dtype(dtype))
    cache = full[:, :B]
    rows = B + gap
    slots = (torch.arange(num_blocks)[:, None] * rows + torch.arange(B)[None, :]).flatten()
    kv = (torch.randn(len(slots), L, generator=g) * 2).to(cache.dtype if not f.is_quantized else torch.bfloat16)
    pe = torch.randn(len(slots), R_, generator=g).to(kv.dtype)
    flat = full.view(-1, width)[:, None, :]  # the writer's [rows, 1, entry] view of the whole tensor
    cache_api.concat_and_cache_mla(kv, pe, flat, slots, fmt, torch.tensor([1.0]))
    return cache, slots


def _slots(g, valid, T, K, num_blocks, rows):
    """int32 [T, K]: random valid slots, -1 padding, an all-padding row (1) and slots that name
    no row: past num_blocks, offsets past block_size (when rows > B), large negatives."""
    s = valid[torch.randint(0, len(valid), (T, K), generator=g)].to(torch.int32)
    s[0, K // 2:] = -1
    s[1] = -1
    bad = [num_blocks * rows + 3, -7, 2 ** 31 - 1]
    if rows > B:
        bad.append(rows + B)  # a row between block 1 and block 2 (never written: poisoned)
    for t in range(2, T):
        s[t, :len(bad)] = torch.tensor(bad, dtype=torch.int32)
    return s


def _check(fmt, dtype, backend, *, T=5, H=3, K=37, gap=0, splits=None, seed=0, R_=R):
    g = torch.Generator().manual_seed(seed)
    cache, valid = _cache(fmt, dtype, g, gap=gap, R_=R_)
    slots = _slots(g, valid, T, K, cache.shape[0], B + gap)
    q = (torch.randn(T, H, L, generator=g) * 0.05).to(dtype)
    qp = torch.randn(T, H, R + R_, generator=g).to(dtype)[..., R:]  # strided, as vLLM splits q
    out = torch.full((T, H, L), float("nan"), dtype=dtype)  # poisoned: every element must be written
    with SA.SPARSE_SLOTS.force(backend):
        o, lse = sparse_latent_attention_slots(q, qp, cache, fmt, slots, 0.07, out=out, splits=splits)
    ro, rl = reference(q, qp, cache, fmt, slots, 0.07)
    assert o is out and o.dtype == dtype and lse.shape == (T, H) and lse.dtype == torch.float32
    assert torch.isfinite(o).all()
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.isneginf(lse[1]).all()  # no key: 0, -inf
    assert rel_fro(o.float(), ro) <= TOL[dtype], rel_fro(o.float(), ro)
    assert torch.allclose(lse, rl, atol=1e-3, rtol=0), (lse - rl).abs().nan_to_num().max()
    return o, lse


@pytest.mark.parametrize("fmt,dtype", CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in CASES])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_slot_attention_matches_the_reference(fmt, dtype, backend):
    _check(fmt, dtype, backend)


@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
def test_blocks_further_apart_than_block_size(fmt):
    """vLLM's flat rows when other layers' pages sit between this cache's blocks: block stride
    B + 5 rows; a slot in the gap is no key."""
    for backend in ("torch", "triton"):
        _check(fmt, torch.bfloat16, backend, gap=5, seed=1)


def test_split_k_equals_one_split():
    """K = 150 over 64-slot tiles: 3 splits merged by LSE give the one-split answer."""
    one, lse1 = _check("fp8_ds_mla", torch.bfloat16, "triton", K=150, splits=1, seed=2)
    three, lse3 = _check("fp8_ds_mla", torch.bfloat16, "triton", K=150, splits=3, seed=2)
    assert rel_fro(three.float(), one.float()) <= 1e-2 and torch.allclose(lse1, lse3, atol=1e-4)
    _check("auto", torch.float32, "triton", K=150, splits=7, seed=3)  # more splits than tiles


def test_nope_model_and_per_tensor_fp8_on_the_torch_path():
    _check("auto", torch.bfloat16, "torch", R_=0, seed=4)
    g = torch.Generator().manual_seed(5)
    cache = torch.full((4, B, L + R), 0x7F, dtype=torch.uint8)
    slots_w = torch.arange(4 * B)
    ks = torch.tensor([0.04])
    cache_api.concat_and_cache_mla(torch.randn(4 * B, L, generator=g), torch.randn(4 * B, R, generator=g), cache,
                                   slots_w, "fp8", ks)
    slots = torch.randint(-1, 4 * B, (3, 20), generator=g, dtype=torch.int32)
    q, qp = torch.randn(3, 2, L, generator=g) * 0.05, torch.randn(3, 2, R, generator=g)
    for backend in ("torch", "triton"):
        with SA.SPARSE_SLOTS.force(backend):
            o, lse = sparse_latent_attention_slots(q, qp, cache.view(torch.float8_e4m3fn), "fp8", slots, 0.1,
                                                   k_scale=ks)
        ro, rl = reference(q, qp, cache, "fp8", slots, 0.1, k_scale=ks)
        assert rel_fro(o, ro) <= 1e-5 and torch.allclose(lse, rl, atol=1e-5)


def test_empty_batch_and_no_slots():
    q = torch.randn(0, 2, L)
    o, lse = sparse_latent_attention_slots(q, torch.randn(0, 2, R), torch.zeros(2, B, L + R), "auto",
                                           torch.zeros(0, 4, dtype=torch.int32), 0.1)
    assert o.shape == (0, 2, L) and lse.shape == (0, 2)
    for backend in ("torch", "triton"):
        with SA.SPARSE_SLOTS.force(backend):
            o, lse = sparse_latent_attention_slots(torch.randn(2, 2, L), torch.randn(2, 2, R),
                                                   torch.randn(2, B, L + R), "auto",
                                                   torch.zeros(2, 0, dtype=torch.int32), 0.1)
        assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def _args(**over):
    a = dict(q_lat=torch.randn(2, 3, L, dtype=torch.bfloat16), q_pe=torch.randn(2, 3, R, dtype=torch.bfloat16),
             kv_cache=torch.zeros(2, B, L + R, dtype=torch.bfloat16), kv_cache_dtype="auto",
             slots=torch.zeros(2, 4, dtype=torch.int32), softmax_scale=0.1)
    a.update(over)
    kw = {k: a.pop(k) for k in ("k_scale", "out", "splits") if k in a}
    return a, kw


@pytest.mark.parametrize("over,match", [
    (dict(q_lat=torch.randn(2, 3, L, dtype=torch.bfloat16)[0]), "q_lat: expected a tensor"),
    (dict(q_lat=torch.zeros(2, 3, L, dtype=torch.int32)), "q_lat: expected bfloat16"),
    (dict(q_pe=torch.randn(2, 4, R, dtype=torch.bfloat16)), "q_pe: expected"),
    (dict(q_pe=torch.randn(2, 3, R)), "q_pe: expected q_lat's dtype"),
    (dict(slots=torch.zeros(2, 4, dtype=torch.int64)), "slots: expected int32"),
    (dict(slots=torch.zeros(3, 4, dtype=torch.int32)), "slots: expected int32"),
    (dict(kv_cache=torch.zeros(2, B, 575, dtype=torch.bfloat16)), "kv_cache: kv_cache_dtype 'auto'"),
    (dict(kv_cache=torch.zeros(B, L + R, dtype=torch.bfloat16)), "kv_cache: expected"),
    (dict(kv_cache_dtype="fp8_ds_mla"), "kv_cache:"),
    (dict(kv_cache=torch.zeros(2, B, 656, dtype=torch.bfloat16), kv_cache_dtype="fp8_ds_mla"), "kv_cache:"),
    (dict(kv_cache=torch.zeros(2 * B * 576 + 16, dtype=torch.bfloat16).as_strided((2, B, 576), (B * 576 + 5, 576, 1))),
     "kv_cache: expected contiguous rows and a block stride"),
    (dict(kv_cache_dtype="fp8", kv_cache=torch.zeros(2, B, L + R, dtype=torch.uint8)), "k_scale"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
    (dict(softmax_scale=-1.0), "softmax_scale"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(out=torch.zeros(2, 3, L)), "out: expected"),
    (dict(splits=0), "splits"),
    (dict(q_lat=torch.randn(2, 3, L, dtype=torch.bfloat16, device="meta")), "meta"),
])
def test_errors_name_the_argument(over, match):
    a, kw = _args(**over)
    with pytest.raises(ValueError, match=match):
        sparse_latent_attention_slots(*a.values(), **kw)


# -- CUDA -------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_case(fmt, T, H, K, seed=0, num_blocks=80):
    g = torch.Generator().manual_seed(seed)
    cache, valid = _cache(fmt, torch.bfloat16, g, num_blocks=num_blocks)
    slots = _slots(g, valid, T, K, num_blocks, B)
    q = (torch.randn(T, H, L, generator=g) * 0.05).to(torch.bfloat16)
    qp = torch.randn(T, H, R, generator=g).to(torch.bfloat16)
    return q, qp, cache, slots


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("T,H,K", [(3, 16, 1024), (40, 128, 96)], ids=["decode-splitk", "prefill"])
def test_cuda_kernel_matches_the_reference(fmt, T, H, K):
    q, qp, cache, slots = _gpu_case(fmt, T, H, K)
    args = (q.cuda(), qp.cuda(), cache.cuda(), fmt, slots.cuda(), 0.07)
    x = SA.SlotInputs(args[0], args[1], args[2], fmt, args[4], B, None, 0.07, args[0], args[0][..., 0].float(), None)
    assert SA.SPARSE_SLOTS.choose(x).name == "triton", SA.SPARSE_SLOTS.explain(x)
    o, lse = sparse_latent_attention_slots(*args)
    ro, rl = reference(q, qp, cache, fmt, slots, 0.07)
    assert rel_fro(o.float().cpu(), ro) <= 1e-2
    assert torch.allclose(lse.cpu(), rl, atol=1e-2) and torch.isneginf(lse[1]).all()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
def test_cuda_graph_capture_and_replay(fmt):
    q, qp, cache, slots = (t.cuda() for t in _gpu_case(fmt, 4, 16, 2048, seed=3))
    eager, eager_lse = sparse_latent_attention_slots(q, qp, cache, fmt, slots, 0.07)
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        sparse_latent_attention_slots(q, qp, cache, fmt, slots, 0.07, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = sparse_latent_attention_slots(q, qp, cache, fmt, slots, 0.07, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    # New inputs in the same buffers: the replay follows them.
    q2, qp2, _, slots2 = _gpu_case(fmt, 4, 16, 2048, seed=4)
    q.copy_(q2)
    qp.copy_(qp2)
    slots.copy_(slots2)
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = sparse_latent_attention_slots(q, qp, cache, fmt, slots, 0.07)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
