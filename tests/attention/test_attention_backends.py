"""PyTorch's own attention kernels as varlen_attention backends, and split MLA keys.

- flex_attention: on the CPU it runs eagerly (torch.compile on the CPU returns
  no LSE), so its document mask, causal convention and LSE conversion are
  checked here against the fp64 reference; its BlockMask (built from the
  offsets) is checked block by block against the brute-force mask. The
  compiled CUDA path is CUDA-marked.
- varlen_attn (FlashAttention-2): CUDA only; the CPU checks its reasons.
- split keys (k = k_nope [Tk, N, P], k_rope [Tk, R]): every backend against
  the reference over the assembled keys, and the scratch buffers reused.

Inputs are random (never zeros); outputs are compared within SPEC §9
(fp32 1e-4, bf16 1e-2, fp16 5e-3 relative Frobenius error), rows without a
visible key must be o = 0, lse = -inf.
"""
from __future__ import annotations

import math

import pytest
import torch

from mla_ext.attention import ATTENTION, backend_report, varlen_attention
from mla_ext.attention import torch_backends as tb
from mla_ext.attention.api import AttentionInputs
from mla_ext.attention.reference import varlen_attention_ref
from mla_ext.attention.scratch import AttentionScratch
from helpers.numeric import rel_fro
from helpers.benchmarks import load_benchmark

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (q_lens, k_lens, causal): empty requests, zero keys, causal with k_len > q_len
# (bottom-right) and k_len < q_len (leading rows see no key).
CASES = [
    ([17, 0, 70, 3], [40, 5, 70, 0], False),
    ([17, 70, 3], [17, 70, 3], True),
    ([5, 33], [20, 90], True),
    ([12, 4], [5, 0], True),
    ([6, 9], [0, 0], False),
]


def cu(lens, device="cpu"):
    out = [0]
    for x in lens:
        out.append(out[-1] + x)
    return torch.tensor(out, dtype=torch.int32, device=device)


def make(q_lens, k_lens, n, p, r, dv, dtype, device="cpu", seed=0):
    """q [Tq,N,P+R]; split keys as the MLA path has them (k_nope and v views of
    one [Tk, N, P+V] up-projection, k_rope [Tk, R] a column slice of a wider
    workspace); the assembled keys for the reference."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    q = torch.randn(tq, n, p + r, generator=g).to(dtype).to(device)
    kv = torch.randn(tk, n, p + dv, generator=g).to(dtype).to(device)
    ws = torch.randn(tk, 16 + r, generator=g).to(dtype).to(device)
    k_nope, v, k_rope = kv[..., :p], kv[..., p:], ws[:, 16:]
    keys = torch.cat([k_nope, k_rope[:, None, :].expand(tk, n, r)], dim=-1)
    return q, k_nope, k_rope, v, keys


def check(o, lse, ref_o, ref_lse, dtype):
    o, lse = o.cpu(), lse.cpu()
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys differ"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        atol = 1e-4 if dtype == torch.float32 else 2e-3
        assert (lse[fin] - ref_lse[fin].float()).abs().max() <= atol
    assert (o.transpose(0, 1)[~fin] == 0).all(), "rows with no key must be 0"
    if ref_o.abs().sum() > 0:
        assert rel_fro(o, ref_o) <= TOL[dtype]


def run(backend, q, k, v, q_lens, k_lens, causal, scale, **kw):
    dev = q.device
    with ATTENTION.force(backend):
        return varlen_attention(q, k, v, cu(q_lens, dev), cu(k_lens, dev), max(q_lens, default=0),
                                max(k_lens, default=0), scale, causal, **kw)


# ---------------------------------------------------------------------------
# flex_attention on the CPU (eager)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("split", [False, True])
def test_flex_cpu_matches_reference(dtype, case, split):
    q_lens, k_lens, causal = CASES[case]
    q, k_nope, k_rope, v, keys = make(q_lens, k_lens, 2, 128, 64, 128, dtype, seed=case)
    scale = 1 / math.sqrt(192)
    ref = varlen_attention_ref(q, keys, v, cu(q_lens), cu(k_lens), scale, causal, torch.float64)
    if split:
        o, lse = run("flex_attention", q, k_nope, v, q_lens, k_lens, causal, scale, k_rope=k_rope)
    else:
        o, lse = run("flex_attention", q, keys, v, q_lens, k_lens, causal, scale)
    check(o, lse, *ref, dtype)


def test_flex_cpu_rows_outside_every_request_are_empty():
    """Rows before cu_seqlens_q[0] and past cu_seqlens_q[-1] (and keys outside
    cu_seqlens_k) take no part: o = 0, lse = -inf."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(14, 2, 40, generator=g)
    k = torch.randn(12, 2, 40, generator=g)
    v = torch.randn(12, 2, 24, generator=g)
    cq = torch.tensor([2, 6, 11], dtype=torch.int32)
    ck = torch.tensor([1, 5, 10], dtype=torch.int32)
    with ATTENTION.force("flex_attention"):
        o, lse = varlen_attention(q, k, v, cq, ck, 5, 5, 0.3, causal=False)
    ref_o, ref_lse = varlen_attention_ref(q, k, v, cq, ck, 0.3, False, torch.float64)
    check(o, lse, ref_o, ref_lse, torch.float32)
    assert torch.isneginf(lse[:, :2]).all() and torch.isneginf(lse[:, 11:]).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_document_block_mask_matches_the_brute_force_mask(causal, seed):
    """Block by block: every visible pair lies in a partial or full block, every
    full block is visible throughout, and mask_mod is the exact mask."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 6, (1,), generator=g))
    q_lens = torch.randint(0, 40, (b,), generator=g).tolist()
    k_lens = q_lens if (causal and seed % 2 == 0) else torch.randint(0, 40, (b,), generator=g).tolist()
    lead_q, lead_k, tail_q, tail_k = (int(x) for x in torch.randint(0, 5, (4,), generator=g))
    cq = torch.tensor([lead_q + x for x in cu(q_lens).tolist()], dtype=torch.int32)
    ck = torch.tensor([lead_k + x for x in cu(k_lens).tolist()], dtype=torch.int32)
    tq, tk = int(cq[-1]) + tail_q, int(ck[-1]) + tail_k
    if tq == 0 or tk == 0:
        tq, tk = tq + 1, tk + 1
    blk = 8
    bm = tb.document_block_mask(cq, ck, tq, tk, causal, block=blk)

    want = torch.zeros(tq, tk, dtype=torch.bool)
    for r in range(b):
        q0, q1, k0, k1 = int(cq[r]), int(cq[r + 1]), int(ck[r]), int(ck[r + 1])
        for i in range(q0, q1):
            for j in range(k0, k1):
                want[i, j] = (not causal) or (j - k1 <= i - q1)
    got = bm.mask_mod(0, 0, torch.arange(tq)[:, None], torch.arange(tk)[None, :])
    assert torch.equal(got, want)

    nq, nk = -(-tq // blk), -(-tk // blk)

    def dense(num, idx):
        d = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            for t in range(int(num[0, 0, i])):
                d[i, int(idx[0, 0, i, t])] = True
        return d

    partial = dense(bm.kv_num_blocks, bm.kv_indices)
    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (partial & full).any()
    for i in range(nq):
        for j in range(nk):
            tile = want[i * blk:(i + 1) * blk, j * blk:(j + 1) * blk]
            if tile.any():
                assert partial[i, j] or full[i, j], (i, j)
            if full[i, j]:
                assert tile.all() and tile.shape == (blk, blk), (i, j)
            elif not tile.any():
                pass  # a partial block with nothing visible costs time, not correctness


def test_document_block_mask_skips_blocks_of_one_long_causal_request():
    """One 1,000-token request, causal: about half the blocks are skipped and the
    diagonal blocks are the only partial ones."""
    c = torch.tensor([0, 1000], dtype=torch.int32)
    bm = tb.document_block_mask(c, c, 1000, 1000, True, block=100)
    assert int(bm.kv_num_blocks.sum()) == 10  # diagonal blocks: partial
    assert int(bm.full_kv_num_blocks.sum()) == 45  # strictly below the diagonal: full


def test_flex_cpu_reason_caps_the_unfused_score_matrix():
    small = AttentionInputs(torch.empty(64, 2, 8), torch.empty(64, 2, 8), torch.empty(64, 2, 8),
                            cu([64]), cu([64]), 64, 64, 1.0, False)
    assert tb.flex_reasons(small) == []
    big = AttentionInputs(torch.empty(8192, 16, 8), torch.empty(8192, 16, 8), torch.empty(8192, 16, 8),
                          cu([8192]), cu([8192]), 8192, 8192, 1.0, False)
    (why,) = tb.flex_reasons(big)
    assert "unfused" in why and "4096 MiB" in why
    meta = AttentionInputs(*(torch.empty(4, 2, 8, device="meta") for _ in range(3)),
                           cu([4]), cu([4]), 4, 4, 1.0, False)
    assert any("meta" in r for r in tb.flex_reasons(meta))


# ---------------------------------------------------------------------------
# varlen_attn (FA2): reasons here, results on CUDA
# ---------------------------------------------------------------------------

def test_varlen_attn_reasons_on_the_cpu():
    x = AttentionInputs(torch.empty(4, 2, 192, dtype=torch.float32), torch.empty(4, 2, 192),
                        torch.empty(4, 2, 128), cu([4]), cu([4]), 4, 4, 1.0, True)
    why = " | ".join(tb.varlen_reasons(x))
    api_why = tb._varlen_api()[3]
    if api_why:  # this torch has no usable varlen_attn: that is the only reason
        assert why == api_why
    else:
        assert "CUDA only" in why and "bfloat16 or float16" in why
        # Causal with distinct offsets is refused whatever the device.
        x2 = AttentionInputs(x.q, x.k, x.v, cu([4]), cu([4]), 4, 4, 1.0, True)
        assert "new-token pass" in " | ".join(tb.varlen_reasons(x2))
        assert "new-token pass" not in " | ".join(
            tb.varlen_reasons(AttentionInputs(x.q, x.k, x.v, x2.cu_seqlens_q, x2.cu_seqlens_q, 4, 4, 1.0, True)))
        x3 = AttentionInputs(torch.empty(4, 2, 100, dtype=torch.bfloat16), torch.empty(4, 2, 100),
                             torch.empty(4, 2, 128), cu([4]), cu([4]), 4, 4, 1.0, False)
        why3 = " | ".join(tb.varlen_reasons(x3))
        assert "multiples of 8" in why3 and "padded to the QK dim" in why3


def test_backends_are_registered_in_the_stated_order_and_reported():
    assert [b.name for b in ATTENTION.backends] == ["triton", "flex_attention", "varlen_attn", "torch"]
    small = AttentionInputs(torch.empty(8, 2, 16), torch.empty(8, 2, 16), torch.empty(8, 2, 16),
                            cu([8]), cu([8]), 8, 8, 1.0, False)
    assert ATTENTION.get("flex_attention").heuristic_reasons(small)  # CPU: slower than the reference
    rows = {(op, name): why for op, name, why in backend_report("cpu")}
    assert rows[("attention", "flex_attention")] == []
    assert rows[("attention", "varlen_attn")]  # never on the CPU
    assert rows[("attention", "torch")] == []


def test_dispatch_by_the_measured_table(tmp_path, monkeypatch):
    """ATTENTION reads the device's dispatch table (mla_ext.dispatch): without an
    entry the stated order decides (on the CPU: never eager flex, a heuristic);
    with one, its measured-fastest usable backend (varlen_attn cannot run on the
    CPU, so flex_attention), for the call's bucket or one within two octaves."""
    from mla_ext import dispatch as D

    q, k_nope, k_rope, v, keys = make([5, 9], [30, 41], 2, 32, 64, 32, torch.float32, seed=4)
    x = AttentionInputs(q, k_nope, v, cu([5, 9]), cu([30, 41]), 9, 41, 0.2, False,
                        k_rope[:, None, :].expand(-1, 2, -1))
    device, buckets = ATTENTION.table_key(x)
    assert device == "cpu" and buckets[0] == "float32/N=2/qk=96/v=32/full/k=split/Tq=16/Tk=128"
    monkeypatch.setenv(D.TABLES_ENV, str(tmp_path))
    D.clear_table_cache()
    try:
        with ATTENTION.force(None):
            assert ATTENTION.decide(x).backend.name in ("triton", "torch")
            assert "no measurement for cpu" in ATTENTION.explain(x)
            D.write_table_entries(D.table_path("cpu", str(tmp_path)), "cpu", "attention", {
                "float32/N=2/qk=96/v=32/full/k=split/Tq=32/Tk=128": {   # one octave away in Tq
                    "order": ["varlen_attn", "flex_attention", "torch"], "us": {"flex_attention": 5.0}}})
            d = ATTENTION.decide(x)
            assert d.backend.name == "flex_attention" and "nearest measured bucket" in d.how
            o, lse = varlen_attention(q, k_nope, v, cu([5, 9]), cu([30, 41]), 9, 41, 0.2, False, k_rope=k_rope)
        check(o, lse, *varlen_attention_ref(q, keys, v, cu([5, 9]), cu([30, 41]), 0.2, False, torch.float64),
              torch.float32)
    finally:
        D.clear_table_cache()


# ---------------------------------------------------------------------------
# split keys: Triton (fused loads), torch (split scores), flex (assembled)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(128, 64, 128), (32, 64, 32), (192, 64, 128)])
@pytest.mark.parametrize("rope_form", ["shared_2d", "shared_3d", "per_head"])
@pytest.mark.parametrize("backend", ["triton", "torch", "flex_attention"])
@pytest.mark.parametrize("case", [0, 2])
def test_split_keys_match_the_assembled_keys(dims, rope_form, backend, case):
    """P 128 + R 64 and P 32 + R 64 are read split; P 192 + R 64 pads less
    assembled (one 256 tile), so Triton assembles it in the scratch."""
    p, r, dv = dims
    q_lens, k_lens, causal = CASES[case]
    dtype = torch.float32 if backend == "triton" else torch.bfloat16
    q, k_nope, k_rope, v, keys = make(q_lens, k_lens, 2, p, r, dv, dtype, seed=p + case)
    if backend == "triton":
        why = ATTENTION.get("triton").not_supported_reasons(
            AttentionInputs(q, keys, v, cu(q_lens), cu(k_lens), 1, 1, 1.0, causal))
        if why:
            pytest.skip("the Triton backend cannot run here: " + "; ".join(why))
    if rope_form == "shared_3d":
        k_rope = k_rope[:, None, :]
    elif rope_form == "per_head":
        k_rope = torch.randn(k_rope.shape[0], 2, r, generator=torch.Generator().manual_seed(p)).to(dtype)
        keys = torch.cat([k_nope, k_rope], dim=-1)
    scale = 0.7 / math.sqrt(p + r)
    scratch = AttentionScratch()
    o, lse = run(backend, q, k_nope, v, q_lens, k_lens, causal, scale, k_rope=k_rope, scratch=scratch)
    ref = varlen_attention_ref(q, keys, v, cu(q_lens), cu(k_lens), scale, causal, torch.float64)
    check(o, lse, *ref, dtype)
    from mla_ext.attention.triton_attention import split_keys_pad_less

    assembled = backend == "flex_attention" or (backend == "triton" and not split_keys_pad_less(p, r))
    assert (scratch.nbytes() > 0) == assembled


def test_qk_segments_pad_less_than_one_tile():
    from mla_ext.attention.triton_attention import qk_segments, split_keys_pad_less

    assert qk_segments(192) == (128, 128, 64, 64)  # MLA: nothing padded (one tile: 256)
    assert qk_segments(256) == (256, 256, 0, 0)
    assert qk_segments(128) == (128, 128, 0, 0)
    assert qk_segments(40) == (32, 32, 8, 16)  # 48 wide, not 64
    assert qk_segments(24) == (24, 32, 0, 0)  # 16 + 16 would not pad less
    assert qk_segments(8) == (8, 16, 0, 0)  # tl.dot needs 16
    assert qk_segments(192, 128) == (128, 128, 64, 64)
    assert qk_segments(96, 32) == (32, 32, 64, 64)
    assert split_keys_pad_less(128, 64) and split_keys_pad_less(32, 64)
    assert not split_keys_pad_less(192, 64)  # 256 + 64 > one 256 tile


def test_scratch_is_reused_across_calls():
    """Backends that assemble keys (and FA2's padded V) write into the caller's
    scratch: one allocation sized by min_rows, then the same memory."""
    scratch = AttentionScratch(min_rows=200)
    ptrs = set()
    for seed, (q_lens, k_lens) in enumerate([([4, 9], [30, 60]), ([7], [150]), ([3, 3], [1, 5])]):
        q, k_nope, k_rope, v, keys = make(q_lens, k_lens, 2, 32, 64, 32, torch.float32, seed=seed)
        o, lse = run("flex_attention", q, k_nope, v, q_lens, k_lens, False, 0.2, k_rope=k_rope, scratch=scratch)
        check(o, lse, *varlen_attention_ref(q, keys, v, cu(q_lens), cu(k_lens), 0.2, False, torch.float64),
              torch.float32)
        ptrs.add(scratch.take("keys", (1, 2, 96), torch.float32, "cpu").data_ptr())
    assert scratch.allocations == 1 and len(ptrs) == 1
    assert scratch.nbytes() == 200 * 2 * 96 * 4
    # A request above min_rows grows it once.
    big = scratch.take("keys", (300, 2, 96), torch.float32, "cpu")
    assert scratch.allocations == 2 and big.shape == (300, 2, 96)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.update(k_rope=a["k_rope"].double()), "k_rope: expected dtype torch.float32"),
    (lambda a: a.update(k_rope=a["k_rope"][:-1]), "k_rope: expected 12 tokens"),
    (lambda a: a.update(k_rope=a["k_rope"][:, :5]), r"k, k_rope: expected head dims summing to 24 \(q's\), got 16 \+ 5"),
    (lambda a: a.update(k_rope=a["k_rope"][:, None].expand(12, 3, 8)), "k_rope: expected 1 or 2 heads"),
    (lambda a: a.update(k_rope=torch.randn(8, 12).t()), "k_rope: the head dim must be contiguous"),
    (lambda a: a.update(k_rope=a["k_rope"][None, None]), "k_rope: expected a tensor"),
    (lambda a: a.update(k_rope=[1.0]), "k_rope: expected a tensor"),
    (lambda a: a.update(scratch={}), "scratch: expected an mla_ext.attention.scratch.AttentionScratch"),
])
def test_split_key_arguments_are_checked(mutate, match):
    g = torch.Generator().manual_seed(0)
    a = dict(q=torch.randn(6, 2, 24, generator=g), k=torch.randn(12, 2, 16, generator=g),
             v=torch.randn(12, 2, 8, generator=g), k_rope=torch.randn(12, 8, generator=g))
    mutate(a)
    with pytest.raises(ValueError, match=match):
        varlen_attention(a["q"], a["k"], a["v"], cu([6]), cu([12]), 6, 12, 0.1, False,
                         k_rope=a["k_rope"], scratch=a.get("scratch"))


def test_scratch_rejects_bad_min_rows():
    with pytest.raises(ValueError, match="min_rows: expected an int >= 0"):
        AttentionScratch(min_rows=-1)
    with pytest.raises(ValueError, match="min_rows: expected an int >= 0"):
        AttentionScratch(min_rows=True)


# ---------------------------------------------------------------------------
# CUDA: compiled flex_attention and varlen_attn
# ---------------------------------------------------------------------------

def _cuda_cases():
    # Long query requests (> 128 rows) too: newer torch sends those to cuDNN
    # inside varlen_attn.
    return CASES + [([300, 0, 200], [500, 100, 0], False), ([260, 140], [260, 140], True)]


N_CUDA_CASES = len(CASES) + 2
# Sized for gpu_check.sh (90 s per test file): every case in bf16, two per other
# dtype (each dtype is one flex_attention compile); split keys on odd cases.
CUDA_PARAMS = ([(torch.bfloat16, c) for c in range(N_CUDA_CASES)]
               + [(dt, c) for dt in (torch.float32, torch.float16) for c in (0, 3)])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, case", CUDA_PARAMS)
def test_flex_cuda_compiled_matches_reference(dtype, case):
    split = case % 2 == 1
    q_lens, k_lens, causal = _cuda_cases()[case]
    q, k_nope, k_rope, v, keys = make(q_lens, k_lens, 4, 128, 64, 128, dtype, device="cuda", seed=case)
    x = AttentionInputs(q, keys, v, cu(q_lens, "cuda"), cu(k_lens, "cuda"), 1, 1, 1.0, causal)
    why = ATTENTION.get("flex_attention").not_supported_reasons(x)
    if why:
        pytest.skip("; ".join(why))
    scale = 1 / math.sqrt(192)
    if split:
        o, lse = run("flex_attention", q, k_nope, v, q_lens, k_lens, causal, scale, k_rope=k_rope)
    else:
        o, lse = run("flex_attention", q, keys, v, q_lens, k_lens, causal, scale)
    ref = varlen_attention_ref(q.cpu(), keys.cpu(), v.cpu(), cu(q_lens), cu(k_lens), scale, causal, torch.float64)
    check(o, lse, *ref, dtype)
    # Sequence lengths are dynamic: one compiled function per (dtype, heads, dims) bucket.
    buckets = [bk for bk in tb.flex_compiled_buckets() if bk[1] == dtype]
    assert len(buckets) == 1, buckets


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, case", [p for p in CUDA_PARAMS if p[0] != torch.float32])
def test_varlen_attn_cuda_matches_reference(dtype, case):
    split = case % 2 == 1
    q_lens, k_lens, causal = _cuda_cases()[case]
    q, k_nope, k_rope, v, keys = make(q_lens, k_lens, 4, 128, 64, 128, dtype, device="cuda", seed=case)
    cq = cu(q_lens, "cuda")
    ck = cq if q_lens == k_lens else cu(k_lens, "cuda")
    x = AttentionInputs(q, keys, v, cq, ck, max(q_lens), max(k_lens), 1.0, causal)
    why = ATTENTION.get("varlen_attn").not_supported_reasons(x)
    if why:
        if causal and q_lens != k_lens:
            assert any("new-token pass" in w for w in why)
        pytest.skip("; ".join(why))
    scale = 1 / math.sqrt(192)
    scratch = AttentionScratch()
    with ATTENTION.force("varlen_attn"):
        o, lse = varlen_attention(q, k_nope if split else keys, v, cq, ck, max(q_lens), max(k_lens), scale,
                                  causal, k_rope=k_rope if split else None, scratch=scratch)
    ref = varlen_attention_ref(q.cpu(), keys.cpu(), v.cpu(), cu(q_lens), cu(k_lens), scale, causal, torch.float64)
    check(o, lse, *ref, dtype)
    assert scratch.nbytes() > 0  # V padded to 192 (and the keys, split) in the scratch


@pytest.mark.cuda
def test_varlen_attn_cuda_rows_past_the_last_request_are_empty():
    q, _, _, v, keys = make([40], [40], 2, 128, 64, 128, torch.bfloat16, device="cuda", seed=7)
    q = torch.cat([q, torch.randn(5, 2, 192, device="cuda", dtype=torch.bfloat16)])
    c = cu([40], "cuda")
    x = AttentionInputs(q, keys, v, c, c, 40, 40, 1.0, True)
    why = ATTENTION.get("varlen_attn").not_supported_reasons(x)
    if why:
        pytest.skip("; ".join(why))
    with ATTENTION.force("varlen_attn"):
        o, lse = varlen_attention(q, keys, v, c, c, 40, 40, 0.1, causal=True)
    assert (o[40:] == 0).all() and torch.isneginf(lse[:, 40:]).all()
    ref = varlen_attention_ref(q.cpu(), keys.cpu(), v.cpu(), c.cpu(), c.cpu(), 0.1, True, torch.float64)
    check(o, lse, *ref, torch.bfloat16)


@pytest.mark.cuda
def test_varlen_attn_cuda_refuses_fp32():
    q, _, _, v, keys = make([8], [8], 2, 128, 64, 128, torch.float32, device="cuda")
    c = cu([8], "cuda")
    why = ATTENTION.get("varlen_attn").not_supported_reasons(AttentionInputs(q, keys, v, c, c, 8, 8, 1.0, False))
    assert any("bfloat16 or float16" in w for w in why) or tb._varlen_api()[3]


# ---------------------------------------------------------------------------
# benchmarks/bench_attention.py (CPU smoke run)
# ---------------------------------------------------------------------------

def test_bench_attention_cpu_smoke(tmp_path):
    """--quick on the CPU: peaks, SDPA, every usable backend side by side (flex
    included), merges; every row ok; the attention entries of the dispatch table."""
    import csv
    import json

    bench = load_benchmark("bench_attention", "bench_attention_smoke")
    assert bench.main(["--quick", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    with open(tmp_path / "bench_attention_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["status"] == "ok" for r in rows), rows
    seen = {(r["op"], r["backend"]) for r in rows}
    assert {("peak", "torch.matmul"), ("peak", "torch.copy_"), ("attention", "torch.sdpa"),
            ("attention", "torch"), ("attention", "flex_attention"), ("merge", "torch")} <= seen
    assert all(r["vs_peak"] for r in rows if r["op"] == "attention")
    table = json.loads((tmp_path / "dispatch_table_cpu.json").read_text())
    entries = table["ops"]["attention"]["entries"]
    assert len(entries) == 2 and all(set(e["order"]) == {"torch", "flex_attention"} for e in entries.values())
