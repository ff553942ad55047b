"""Seeded inputs for vLLM 0.33's DeepSeek-V3.2 fused_norm_rope / fused_q and mla_ext's
(mla_ext/vllm/dsa_model_ops.py): the same case rebuilt from its name gives identical tensors
(views, strides and poisoned outputs included), so vLLM's kernels (in a subprocess, the Triton
interpreter) and mla_ext's ops each get a fresh copy."""
from __future__ import annotations

import torch

T = 6  # tokens
Q_DIM, KV_DIM, ROPE, IDX_DIM = 96, 512, 64, 128  # q_lora (not a power of two: vLLM's masked path)
MAX_POS = 40
NUM_BLOCKS = 3
POISON_TOPK = 7

# name: (dtype, mla cache dtype, has_indexer, interleave, own outputs, caches, block_size, shuffled, cos dtype)
NORM_ROPE_CASES = {
    "bf16-auto-neox": (torch.bfloat16, "auto", True, False, "kv", True, 4, False, torch.float32),
    "bf16-ds_mla-interleave": (torch.bfloat16, "fp8_ds_mla", True, True, "all", True, 4, False, torch.bfloat16),
    "fp32-fp8-shuffled": (torch.float32, "fp8", True, False, "kv", True, 16, True, torch.float32),
    "bf16-fp8-skipscale": (torch.bfloat16, "fp8", True, True, "none", True, 4, False, torch.float32),
    "bf16-shared-layer": (torch.bfloat16, "bfloat16", False, False, "kv", True, 4, False, torch.float32),
    "bf16-no-caches": (torch.bfloat16, "auto", True, False, "all", False, 4, False, torch.float32),
}
# name: (dtype, heads, index heads, has_indexer, interleave, quantize_mqa, q_scale)
Q_CASES = {
    "bf16-fp8q-neox": (torch.bfloat16, 4, 4, True, False, True, 0.25),
    "bf16-bf16q-interleave": (torch.bfloat16, 3, 4, True, True, False, 1.0),
    "fp32-fp8q-shared": (torch.float32, 5, 2, False, False, True, 0.5),
    "fp32-fp8q-indexer": (torch.float32, 2, 3, True, True, True, 2.0),
}
L_NOPE = 64  # ql_nope width in the fused_q tests (512 in DeepSeek-V3.2; any width is served)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cos_sin(g, dtype):
    ang = torch.rand(MAX_POS, ROPE // 2, generator=g) * 6.0
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype)


def _poisoned(g, shape, dtype):
    """Random bytes viewed as `dtype` (never zeros); bf16/fp32 bytes may be NaN patterns."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def mla_entry(cache_dtype: str) -> int:
    return 656 if cache_dtype == "fp8_ds_mla" else KV_DIM + ROPE


def norm_rope_case(name: str):
    """(args, kwargs) of fused_norm_rope for case `name`."""
    dtype, cdt, has_idx, inter, outs, caches, B, shuffled, cos_dtype = NORM_ROPE_CASES[name]
    g = _g(sum(map(ord, name)))
    positions = torch.randint(0, MAX_POS, (T,), generator=g)
    qkv = torch.randn(T, Q_DIM + KV_DIM + ROPE, generator=g).to(dtype) * 2
    q_c, kv_c, k_pe = qkv.split([Q_DIM, KV_DIM, ROPE], dim=-1)  # strided views, as vLLM's
    kw = (torch.randn(T, IDX_DIM + 8, generator=g) * 3 + 0.5).to(dtype)
    index_k = kw[:, :IDX_DIM]
    q_w, kv_w = (torch.rand(Q_DIM, generator=g) + 0.5).to(dtype), (torch.rand(KV_DIM, generator=g) + 0.5).to(dtype)
    ik_w, ik_b = torch.rand(IDX_DIM, generator=g) + 0.5, torch.randn(IDX_DIM, generator=g) * 0.1
    k_cs, i_cs = _cos_sin(g, cos_dtype), _cos_sin(g, cos_dtype)
    topk = torch.full((T + 2, 20), POISON_TOPK, dtype=torch.int32)
    nslots = NUM_BLOCKS * B
    slots = torch.randperm(nslots, generator=g)[:T]
    slots[2] = -1  # padding token
    islots = torch.randperm(nslots, generator=g)[:T]
    islots[2] = -1
    kwargs = dict(has_indexer=has_idx, index_rope_interleave=inter, mla_kv_cache_dtype=cdt)
    if caches:
        mla_dtype = dtype if cdt in ("auto", "bfloat16") else torch.uint8
        kwargs.update(
            slot_mapping=slots, indexer_slot_mapping=islots if name.startswith("bf16-ds") else None,
            indexer_k_cache=_poisoned(g, (NUM_BLOCKS, B, IDX_DIM + 4), torch.uint8),
            indexer_cache_shuffled=shuffled,
            mla_kv_cache=_poisoned(g, (NUM_BLOCKS, B, mla_entry(cdt)), mla_dtype),
            mla_k_scale=torch.tensor(0.01 if cdt == "fp8" else 1.0),  # 0.01: some values saturate
            skip_scale=name.endswith("skipscale"))
    if outs in ("kv", "all"):
        kwargs.update(kv_c_out=torch.full_like(kv_c, float("nan")), k_pe_out=torch.full_like(k_pe, float("nan")))
    if outs == "all":
        kwargs.update(index_k_out=torch.full(index_k.shape, float("nan"), dtype=dtype),
                      q_c_out=torch.full(q_c.shape, float("nan"), dtype=dtype))
    args = [positions, q_c, q_w, 1e-6, kv_c, kv_w, 1e-6, k_pe, k_cs, index_k if has_idx else None,
            ik_w if has_idx else None, ik_b if has_idx else None, 1e-6, i_cs if has_idx else None, topk]
    return args, kwargs


def q_case(name: str):
    """(args, kwargs) of fused_q for case `name`."""
    dtype, H, NI, has_idx, inter, quant, q_scale = Q_CASES[name]
    g = _g(sum(map(ord, name)) + 1)
    positions = torch.randint(0, MAX_POS, (T,), generator=g)
    q = torch.randn(T, H, 32 + ROPE, generator=g).to(dtype)
    q_pe = q[..., 32:]  # a strided view, as vLLM's q.split
    ql_nope = (torch.randn(H, T, L_NOPE, generator=g) * 60).to(dtype).transpose(0, 1)  # bmm(...).transpose
    index_q = (torch.randn(T, NI, IDX_DIM, generator=g) * torch.rand(T, NI, 1, generator=g) * 4).to(dtype)
    w_full = torch.randn(T, IDX_DIM + NI, generator=g).to(dtype)
    args = [positions, q_pe, _cos_sin(g, torch.float32), index_q if has_idx else None,
            _cos_sin(g, torch.float32) if has_idx else None, ql_nope, torch.tensor([q_scale]),
            w_full[:, IDX_DIM:] if has_idx else None, IDX_DIM ** -0.5, NI ** -0.5]
    return args, dict(has_indexer=has_idx, index_rope_interleave=inter, quantize_mqa=quant)


# -- comparisons shared by the vLLM-oracle and the reference tests --------------------

MAX_NEAR = 0.01  # share of reduction-derived values allowed one ulp/code off


def _near_floats(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """bf16/fp16: equal up to one ulp at a few elements; fp32: within 8 ulps (the whole row moves
    with the norm's reduction order). NaN where both are NaN."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, what
    a, b = ours.float(), theirs.float()
    assert torch.equal(a.isnan(), b.isnan()), what
    a, b = a.nan_to_num(), b.nan_to_num()
    ulps = 8 if ours.dtype == torch.float32 else 1
    ulp = torch.finfo(ours.dtype).eps * torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    assert bool(((a - b).abs() <= ulps * ulp).all()), f"{what}: max diff {(a - b).abs().max()}"
    assert ours.dtype == torch.float32 or (a != b).float().mean() <= MAX_NEAR, what


def _near_e4m3(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """e4m3 bytes equal, or the same sign and one code apart, at a few bytes."""
    a, b = ours.view(torch.uint8).int(), theirs.view(torch.uint8).int()
    off = a != b
    assert bool(((a & 0x80) == (b & 0x80))[off].all()) and bool(((a & 0x7F) - (b & 0x7F)).abs().le(1).all()), what
    assert off.float().mean() <= MAX_NEAR, what


def _check_mla_cache(ours, theirs, poison, slots, cdt):
    ob, tb, pb = (c.view(torch.uint8).reshape(-1, c.shape[2] * c.element_size()) for c in (ours, theirs, poison))
    written = slots[slots >= 0]
    untouched = torch.ones(ob.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(ob[untouched], pb[untouched]) and torch.equal(tb[untouched], pb[untouched])
    o, t = ob[written], tb[written]
    if cdt == "fp8_ds_mla":
        _near_e4m3(o[:, :512], t[:, :512], "fp8_ds_mla values")
        assert torch.equal(o[:, 512:], t[:, 512:]), "fp8_ds_mla scales and bf16 rope"
    elif cdt == "fp8":
        _near_e4m3(o[:, :512], t[:, :512], "fp8 latent")
        assert torch.equal(o[:, 512:], t[:, 512:]), "fp8 rope"
    else:
        o, t = o.view(ours.dtype), t.view(ours.dtype)
        _near_floats(o[:, :512], t[:, :512], "native latent")
        assert torch.equal(o[:, 512:], t[:, 512:]), "native rope"


def _check_index_cache(ours, theirs, poison, B):
    """Whole pages: scales exact, values within one code; bytes neither run wrote stay poison."""
    D = IDX_DIM
    ob, tb, pb = (c.reshape(c.shape[0], -1) for c in (ours, theirs, poison))
    assert torch.equal(ob[:, B * D:], tb[:, B * D:]), "index cache scales"
    _near_e4m3(ob[:, :B * D], tb[:, :B * D], "index cache values")
    same = (ob == pb) & (tb == pb)
    changed_ours = (ob != pb).sum()
    assert changed_ours <= (tb != pb).sum() + (ob != tb).sum() and bool(same.any())


def _check_elementwise(a: torch.Tensor, b: torch.Tensor, what: str, exact: bool) -> None:
    """Element-wise results: bit-identical to vLLM's kernel (exact), else near (the reference)."""
    if exact:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what
    elif a.dtype in (torch.float8_e4m3fn, torch.uint8):
        _near_e4m3(a, b, what)
    else:
        _near_floats(a, b, what)


def compare_norm_rope(name: str, ret, args, kwargs, other: dict, exact: bool) -> None:
    """Our fused_norm_rope run (ret, its args/kwargs after the call) against another run of the
    same case (vLLM's kernel, exact=True for its element-wise results; or the reference)."""
    _, poison_kw = norm_rope_case(name)
    ok, tk = kwargs, other["kwargs"]
    _near_floats(ret, other["ret"], "q_c_out")
    if "q_c_out" in ok:
        assert ret is ok["q_c_out"]
    for out in ("kv_c_out", "index_k_out"):
        if out in ok:
            _near_floats(ok[out], tk[out], out)
    if "k_pe_out" in ok:
        _check_elementwise(ok["k_pe_out"], tk["k_pe_out"], "k_pe_out (element-wise RoPE)", exact)
    if "index_k_out" in ok and "slot_mapping" in ok:  # rows of padding slots are not written
        assert bool(ok["index_k_out"][ok["slot_mapping"] < 0].isnan().all())
    topk, has_idx = args[-1], ok["has_indexer"]
    assert torch.equal(topk, other["args"][-1])
    assert bool((topk[:T] == (-1 if has_idx else POISON_TOPK)).all())
    assert bool((topk[T:] == POISON_TOPK).all())
    if "mla_kv_cache" in ok:
        _check_mla_cache(ok["mla_kv_cache"], tk["mla_kv_cache"], poison_kw["mla_kv_cache"], ok["slot_mapping"],
                         ok["mla_kv_cache_dtype"])
        if has_idx:
            _check_index_cache(ok["indexer_k_cache"], tk["indexer_k_cache"], poison_kw["indexer_k_cache"],
                               ok["indexer_k_cache"].shape[1])
        else:
            assert torch.equal(ok["indexer_k_cache"], poison_kw["indexer_k_cache"])
    fresh = norm_rope_case(name)[0]
    for i in (1, 4, 7, 9):  # inputs are read only
        if args[i] is not None:
            assert torch.equal(args[i], fresh[i])


def compare_q(args, kwargs, ours, theirs, exact: bool) -> None:
    """Our fused_q outputs against another run's (vLLM's kernel: exact; or the reference)."""
    for o, t in zip(ours, theirs):
        assert o.dtype == t.dtype and o.shape == t.shape
    iq, w, mqa = ours
    if kwargs["has_indexer"]:  # element-wise (RoPE, max, power-of-two scale)
        _check_elementwise(iq, theirs[0], "index_q_fp8", exact)
        if exact:
            assert torch.equal(w, theirs[1]), "index_weights_out"
        else:
            _near_floats(w, theirs[1], "index_weights_out")
    _check_elementwise(mqa, theirs[2], "mqa_q", exact)
    if kwargs["quantize_mqa"] and args[6].item() <= 0.5:  # ql_nope * 60 / q_scale: some saturate at 448
        assert bool((mqa.view(torch.uint8)[..., :L_NOPE] & 0x7F == 0x7E).any())
