"""Fuzz cases of the paged-cache stage: the public ops of mla_ext.cache.api and
the raw torch.ops.mla_ext cache ops (SPEC §2, §6).

Every case starts from a valid call (a filled cache, a block table with
shuffled ids, unaligned seq_starts, a request without context) and changes
one thing. Accepted calls are compared bit for bit with
mla_ext.cache.reference, which also defines the out-of-range results (zero
rows, skipped slots); `validate=True` must refuse those inputs instead.
"""
from __future__ import annotations

import torch

from fuzz_harness import BIG, QUICK, Call, add, report_rows_case
from helpers.gather import make_cache
from helpers.numeric import assert_same_bits, assert_within_one_ulp
from mla_ext.cache import api
from mla_ext.cache import reference as ref
from mla_ext.config.formats import FORMATS, QuantMode, get_format

L, R = 512, 64
BF16 = torch.bfloat16
I32 = torch.int32
META = torch.device("meta")

API = "mla_ext.cache.api"
GATHER = f"{API}:gather_and_maybe_dequant_cache"
CP_GATHER = f"{API}:cp_gather_cache"
WRITE = f"{API}:concat_and_cache_mla"
KV_SCALE = f"{API}:compute_kv_scale"
OP_GATHER = "torch.ops.mla_ext.gather_and_maybe_dequant_cache"
OP_CP_GATHER = "torch.ops.mla_ext.cp_gather_cache"
OP_WRITE = "torch.ops.mla_ext.concat_and_cache_mla"
OP_KV_SCALE = "torch.ops.mla_ext.compute_kv_scale"


# Every registered format that can hold DeepSeek's dims (a new format gets the valid cases).
FORMAT_NAMES = tuple(f.name for f in FORMATS if f.supports_dims(L, R))


def ops():
    return torch.ops.mla_ext


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------
# Gathers
# ---------------------------------------------------------------------------

GATHER_ARGS = ("src_cache", "dst", "block_table", "cu_seq_lens", "num_reqs", "kv_cache_dtype", "k_scale",
               "seq_starts")


def gather_setup(g, fmt: str = "fp8", *, raw: bool = False, lens=(20, 0, 33), starts=(3, 0, 17),
                 num_blocks: int = 6, B: int = 16, width: int = 4, seed: int = 0, dst_dtype=None,
                 dst_width=None, extra_rows: int = 2, cache_kw=None, dst_kw=None, table_kw=None) -> dict:
    """Valid arguments of a gather (dict in the op's argument order), every tensor guarded."""
    gen = _gen(seed)
    f = get_format(fmt)
    cache, k_scale = make_cache(fmt, num_blocks, B, L, R, gen=gen)
    table = torch.randint(0, num_blocks, (len(lens), width), generator=gen, dtype=I32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
    if dst_dtype is None:
        dst_dtype = cache.dtype if (raw or f.is_native) else BF16
    if dst_width is None:
        # Formats with their own row layout (scales inside the row) dequantize to L + R columns.
        own_layout = f.quant_mode not in (QuantMode.NONE, QuantMode.FP8_PER_TENSOR)
        dst_width = L + R if own_layout and dst_dtype != cache.dtype else cache.shape[2]
    rows = sum(lens) + extra_rows
    dst0 = torch.randint(0, 256, (rows, dst_width * torch.empty((), dtype=dst_dtype).element_size()),
                         generator=gen, dtype=torch.uint8).view(dst_dtype)
    if dst_dtype.is_floating_point and dst_dtype.itemsize > 1:
        dst0 = torch.randn(rows, dst_width, generator=gen).to(dst_dtype)
    return dict(
        src_cache=g.put(cache, "src_cache", **(cache_kw or {})),
        dst=g.put(dst0, "dst", writable=True, **(dst_kw or {})),
        block_table=g.put(table, "block_table", **(table_kw or {})),
        cu_seq_lens=g.put(cu, "cu_seq_lens"),
        num_reqs=len(lens),
        kv_cache_dtype=fmt,
        k_scale=g.put(k_scale, "k_scale"),
        seq_starts=g.put(torch.tensor(starts, dtype=I32), "seq_starts"),
    )


def gather_reference(a: dict, raw: bool) -> torch.Tensor:
    c = {k: _clone(v) for k, v in a.items()}
    want = c["dst"]
    if raw:
        ref.cp_gather_ref(c["src_cache"], want, c["block_table"], c["cu_seq_lens"], c["num_reqs"], c["seq_starts"])
    else:
        ref.gather_ref(c["src_cache"], want, c["block_table"], c["cu_seq_lens"], c["num_reqs"],
                       c["kv_cache_dtype"], c["k_scale"], c["seq_starts"])
    return want


def gather_call(a: dict, via: str, *, raw: bool = False, validate: bool = False, check: bool = True) -> Call:
    """The call under test through `via`: "api", "op" (torch.ops) or "triton" (API, forced backend).

    check=False: no reference (refused inputs, or inputs without a defined result,
    where only the guard bytes and the absence of a crash are checked)."""
    want = gather_reference(a, raw) if check else None
    kw = {"validate": True} if validate else {}
    if raw:
        pos = [a[k] for k in ("src_cache", "dst", "block_table", "cu_seq_lens", "num_reqs", "seq_starts")]
        fn_api, fn_op = api.cp_gather_cache, ops().cp_gather_cache
    else:
        pos = [a[k] for k in GATHER_ARGS]
        fn_api, fn_op = api.gather_and_maybe_dequant_cache, ops().gather_and_maybe_dequant_cache

    if via == "op":
        def fn():
            return fn_op(*pos)
    elif via == "triton":
        def fn():
            with api.GATHER.force("triton_paged"):
                return fn_api(*pos, **kw)
    else:
        def fn():
            return fn_api(*pos, **kw)

    def verify(_):
        if via == "triton":
            assert_within_one_ulp(a["dst"], want, "dst")
        else:
            assert_same_bits(a["dst"], want, "dst")

    return Call(fn, verify if check else None)


def _gather_cases(entry: str, via: str, raw: bool) -> None:
    """The bad-input matrix of one gather entry point."""
    api_only = via != "op"

    def G(name, expect, args=(), mutate=None, *, fmt="fp8", validate=False, setup=None, timeout=None,
          reference=True, **kw):
        def build(g):
            a = gather_setup(g, fmt, raw=raw, **(setup or {}))
            if mutate is not None:
                mutate(g, a)
            return gather_call(a, via, raw=raw, validate=validate, check=reference and expect != "reject")
        add(entry, name, build, expect, args, timeout=timeout or 60.0, **kw)

    # -- valid calls of every format (and layouts) -----------------------------
    for fmt in FORMAT_NAMES:
        G(f"valid_{fmt}", "accept", fmt=fmt)
    if not raw:
        G("valid_fp8_to_fp32", "accept", setup=dict(dst_dtype=torch.float32))
        G("valid_fp8_to_fp16", "accept", setup=dict(dst_dtype=torch.float16))
        G("valid_fp8_raw_passthrough", "accept", setup=dict(dst_dtype=torch.uint8))
        G("valid_ds_mla_r0_512_cols", "accept", fmt="fp8_ds_mla", setup=dict(dst_width=L))
        G("valid_ds_mla_to_fp32", "accept", fmt="fp8_ds_mla", setup=dict(dst_dtype=torch.float32))
    G("padded_strides_everywhere", "accept",
      setup=dict(cache_kw=dict(pad=8), dst_kw=dict(pad=24), table_kw=dict(pad=3)))
    G("misaligned_pointers", "accept", setup=dict(cache_kw=dict(misalign=1), dst_kw=dict(misalign=1)))
    G("misaligned_ds_mla", "accept", fmt="fp8_ds_mla",
      setup=dict(cache_kw=dict(misalign=3), dst_kw=dict(misalign=1)))
    G("cache_blocks_aliased_stride0", "either", ("src_cache",),
      lambda g, a: a.update(src_cache=a["src_cache"][:1].expand(6, -1, -1)))
    G("single_block_size1", "accept", setup=dict(B=1, num_blocks=40, width=40, lens=(7, 0, 20), starts=(30, 0, 1)))

    # -- zero tokens: a no-op --------------------------------------------------
    G("zero_tokens", "accept", setup=dict(lens=(0, 0, 0), starts=(0, 0, 0)))
    G("zero_requests", "accept", mutate=lambda g, a: a.update(num_reqs=0))
    G("zero_dst_rows", "accept", setup=dict(lens=(0, 0, 0), starts=(0, 0, 0), extra_rows=0))

    # -- dtypes ----------------------------------------------------------------
    G("dst_int32", "reject", ("dst",), lambda g, a: a.update(dst=g.put(torch.zeros(55, 576, dtype=I32), "dst2",
                                                                   writable=True)))
    if raw:
        G("raw_dtype_mismatch", "reject", ("dst",), setup=dict(dst_dtype=BF16, dst_width=L + R))
    else:
        G("native_into_other_dtype", "reject", ("dst",), fmt="auto",
          setup=dict(dst_dtype=torch.float32, dst_width=L + R))
    G("block_table_int64", "reject", ("block_table",), lambda g, a: a.update(block_table=a["block_table"].long()))
    G("cu_seq_lens_int64", "reject", ("cu_seq_lens",), lambda g, a: a.update(cu_seq_lens=a["cu_seq_lens"].long()))
    G("seq_starts_float", "reject", ("seq_starts",), lambda g, a: a.update(seq_starts=a["seq_starts"].float()))
    if not raw:
        G("cache_int16", "reject", ("src_cache",),
          lambda g, a: a.update(src_cache=g.put(torch.zeros(6, 16, 576, dtype=torch.int16), "cache16")))
        G("k_scale_float64", "reject", ("k_scale",), lambda g, a: a.update(k_scale=a["k_scale"].double()))
        G("k_scale_two_elements", "reject", ("k_scale",),
          lambda g, a: a.update(k_scale=g.put(torch.tensor([0.5, 0.5]), "k_scale2")))
        G("unknown_format", "reject", ("kv_cache_dtype",), lambda g, a: a.update(kv_cache_dtype="fp9"))
        G("format_case_and_space", "reject", ("kv_cache_dtype",), lambda g, a: a.update(kv_cache_dtype=" FP8"))
        G("ds_mla_on_576_entries", "reject", ("src_cache",), lambda g, a: a.update(kv_cache_dtype="fp8_ds_mla"))
        G("fp8_on_bf16_cache", "reject", ("src_cache", "dst"), fmt="auto",
          mutate=lambda g, a: a.update(kv_cache_dtype="fp8"))
        G("fp8_e4m3_cache_named_e5m2", "reject", ("src_cache",),
          lambda g, a: a.update(src_cache=a["src_cache"].view(torch.float8_e4m3fn), kv_cache_dtype="fp8_e5m2"))
        G("bfloat16_format_fp16_cache", "reject", ("src_cache",), fmt="auto",
          mutate=lambda g, a: a.update(src_cache=a["src_cache"].view(torch.float16), kv_cache_dtype="bfloat16",
                                       dst=a["dst"].view(torch.float16)))
    # -- shapes ----------------------------------------------------------------
    G("dst_3d", "reject", ("dst",), lambda g, a: a.update(dst=a["dst"].unsqueeze(0)))
    G("dst_wrong_width", "reject", ("dst",), lambda g, a: a.update(dst=a["dst"][:, :100]))
    G("block_table_1d", "reject", ("block_table",), lambda g, a: a.update(block_table=a["block_table"][0]))
    G("block_table_fewer_rows", "reject", ("block_table", "num_reqs"),
      lambda g, a: a.update(block_table=a["block_table"][:2]))
    G("cu_seq_lens_2d", "reject", ("cu_seq_lens",), lambda g, a: a.update(cu_seq_lens=a["cu_seq_lens"][None]))
    G("seq_starts_short", "reject", ("seq_starts",), lambda g, a: a.update(seq_starts=a["seq_starts"][:2]))
    G("cache_2d", "reject", ("src_cache",), lambda g, a: a.update(src_cache=a["src_cache"][0]))
    G("cache_block_size0", "reject", ("src_cache",), lambda g, a: a.update(src_cache=a["src_cache"][:, :0]))
    G("num_reqs_too_big", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs=4))
    G("num_reqs_negative", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs=-1))
    G("num_reqs_huge", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs=2**40), timeout=QUICK)
    # -- strides and overlap ---------------------------------------------------
    G("dst_last_dim_strided", "reject", ("dst",),
      lambda g, a: a.update(dst=g.put(None, "dst2", writable=True, shape=(55, 576), dtype=a["dst"].dtype,
                                      strides=(1152, 2))))
    G("dst_expanded_rows", "reject", ("dst",), lambda g, a: a.update(dst=a["dst"][:1].expand(55, -1)))
    G("cache_last_dim_strided", "reject", ("src_cache",),
      lambda g, a: a.update(src_cache=g.put(None, "cache2", shape=(6, 16, 576), dtype=a["src_cache"].dtype,
                                            strides=(16 * 1152, 1152, 2))))
    G("block_table_last_dim_strided", "reject", ("block_table",),
      lambda g, a: a.update(block_table=g.put(None, "bt2", shape=(3, 4), dtype=I32, strides=(8, 2)).fill_(0)))
    G("block_table_expanded_rows", "either", ("block_table",),
      lambda g, a: a.update(block_table=a["block_table"][:1].expand(3, -1)))
    G("block_table_huge_expanded", "reject", ("block_table",),
      lambda g, a: a.update(block_table=a["block_table"][:, :1].expand(3, 2**31)), timeout=QUICK)
    G("cu_seq_lens_strided", "reject", ("cu_seq_lens",),
      lambda g, a: a.update(cu_seq_lens=g.put(a["cu_seq_lens"], "cu2", strides=(2,))))
    G("seq_starts_strided", "reject", ("seq_starts",),
      lambda g, a: a.update(seq_starts=g.put(a["seq_starts"], "ss2", strides=(3,))))
    G("cu_seq_lens_expanded", "reject", ("cu_seq_lens",),
      lambda g, a: a.update(cu_seq_lens=a["cu_seq_lens"][:1].expand(2**31), num_reqs=3), timeout=QUICK)

    def dst_over_cache_rows(g, a):
        # dst overlaps cache block 5 (rows of dst are cache entries).
        cache = a["src_cache"]
        a.update(dst=cache[4:].reshape(-1, cache.shape[2])[:20])
        a.update(cu_seq_lens=g.put(torch.tensor([0, 10, 10, 20], dtype=I32), "cu2"))
    G("dst_overlaps_cache_blocks", "reject", ("dst", "src_cache"), dst_over_cache_rows, fmt="auto")

    def dst_over_block_table(g, a):
        buf = g.raw(64 + 55 * 576 * 2, "shared")
        a.update(block_table=buf[:48].view(I32).view(3, 4).copy_(a["block_table"]),
                 dst=buf[32:32 + 55 * 576 * 2].view(BF16).view(55, 576))
    if not raw:
        G("dst_overlaps_block_table", "reject", ("dst", "block_table"), dst_over_block_table)

        def dst_over_k_scale(g, a):
            buf = g.raw(55 * 576 * 2, "shared")
            a.update(dst=buf.view(BF16).view(55, 576), k_scale=buf[:4].view(torch.float32).fill_(0.25))
        G("dst_overlaps_k_scale", "reject", ("dst", "k_scale"), dst_over_k_scale)

    def dst_over_cu(g, a):
        buf = g.raw(55 * a["dst"].shape[1] * a["dst"].element_size() + 64, "shared")
        a.update(cu_seq_lens=buf[:16].view(I32).copy_(a["cu_seq_lens"]),
                 dst=buf[:-64].view(a["dst"].dtype).view(55, -1))
    G("dst_overlaps_cu_seq_lens", "reject", ("dst", "cu_seq_lens"), dst_over_cu)
    # -- devices ---------------------------------------------------------------
    G("block_table_on_meta", "reject", ("block_table",),
      lambda g, a: a.update(block_table=a["block_table"].to(META)))
    G("dst_on_meta", "reject", ("dst",), lambda g, a: a.update(dst=a["dst"].to(META)))
    G("cache_on_meta", "reject", ("src_cache", "dst", "block_table", "cu_seq_lens"),
      lambda g, a: a.update(src_cache=a["src_cache"].to(META)))
    G("seq_starts_on_meta", "reject", ("seq_starts",), lambda g, a: a.update(seq_starts=a["seq_starts"].to(META)))
    if not raw:
        G("k_scale_on_meta", "reject", ("k_scale",), lambda g, a: a.update(k_scale=a["k_scale"].to(META)))
        G("k_scale_on_meta_native", "reject", ("k_scale",), fmt="auto",
          mutate=lambda g, a: a.update(k_scale=a["k_scale"].to(META)))
    # -- values: out-of-range ids are zero rows (SPEC §6), validate=True refuses
    def bad_ids(g, a):
        bt = a["block_table"]
        bt[0, 0], bt[0, 2], bt[2, 1], bt[2, 3] = -1, 6, 2**31 - 1, -(2**31)
    G("block_ids_out_of_range", "either", ("block_table",), bad_ids)

    def narrow_table(g, a):
        a.update(block_table=a["block_table"][:, :1].contiguous())  # 16 tokens wide, lens up to 33+17
    G("table_narrower_than_lens", "either", ("block_table",), narrow_table)
    G("cu_past_dst_rows", "either", ("cu_seq_lens", "dst"),
      lambda g, a: a.update(dst=a["dst"][:40]))
    # Overlapping request ranges have no defined result (which request owns a
    # row?): only no crash and no write outside dst.
    G("cu_decreasing", "either", ("cu_seq_lens",),
      lambda g, a: a["cu_seq_lens"].copy_(torch.tensor([0, 30, 10, 53], dtype=I32)), reference=False)
    G("cu_negative_start", "either", ("cu_seq_lens",),
      lambda g, a: a["cu_seq_lens"].copy_(torch.tensor([-5, 15, 15, 48], dtype=I32)))
    G("seq_starts_negative", "either", ("seq_starts",),
      lambda g, a: a["seq_starts"].copy_(torch.tensor([-3, 0, -40], dtype=I32)))
    G("seq_starts_int32_max", "either", ("seq_starts",),
      lambda g, a: a["seq_starts"].copy_(torch.tensor([2**31 - 1, 0, 2**31 - 30], dtype=I32)))
    G("cu_int32_extremes", "either", ("cu_seq_lens",),
      lambda g, a: a["cu_seq_lens"].copy_(torch.tensor([-(2**31), 2**31 - 1, -(2**31), 2**31 - 1], dtype=I32)),
      timeout=QUICK)
    if api_only:
        for name, mutate in (("ids", bad_ids), ("narrow_table", narrow_table)):
            G(f"validate_refuses_{name}", "reject", ("block_table",), mutate, validate=True)
        G("validate_refuses_cu_past_dst", "reject", ("cu_seq_lens",),
          lambda g, a: a.update(dst=a["dst"][:40]), validate=True)
        G("validate_refuses_negative_start", "reject", ("seq_starts",),
          lambda g, a: a["seq_starts"].copy_(torch.tensor([-3, 0, 1], dtype=I32)), validate=True)
        G("validate_refuses_decreasing_cu", "reject", ("cu_seq_lens",),
          lambda g, a: a["cu_seq_lens"].copy_(torch.tensor([0, 30, 10, 53], dtype=I32)), validate=True)
    if not raw:
        for label, v in (("nan", float("nan")), ("zero", 0.0), ("negative", -0.5), ("inf", float("inf")),
                         ("neg_zero", -0.0), ("subnormal_ok", 1e-40)):
            expect = "either" if label == "subnormal_ok" else "reject"
            G(f"k_scale_{label}", expect, ("k_scale",),
              lambda g, a, v=v: a["k_scale"].fill_(v))
            G(f"k_scale_{label}_e5m2", expect, ("k_scale",), fmt="fp8_e5m2",
              mutate=lambda g, a, v=v: a["k_scale"].fill_(v))
        G("k_scale_nan_ignored_by_native", "either", ("k_scale",), fmt="auto",
          mutate=lambda g, a: a["k_scale"].fill_(float("nan")))
        G("k_scale_nan_ignored_by_ds_mla", "either", ("k_scale",), fmt="fp8_ds_mla",
          mutate=lambda g, a: a["k_scale"].fill_(float("nan")))
    if not raw and api_only:  # None where the format ignores the value (the op takes a tensor;
        # the raw op's schema refuses None itself, before any check of ours)
        G("k_scale_none_ds_mla", "reject", ("k_scale",), fmt="fp8_ds_mla",
          mutate=lambda g, a: a.update(k_scale=None))
    # -- non-tensor arguments (the raw op's schema refuses these itself) --------
    G("cache_is_a_list", "reject", ("src_cache",), lambda g, a: a.update(src_cache=[[0.0]]))
    G("dst_is_none", "reject", ("dst",), lambda g, a: a.update(dst=None))
    G("block_table_is_a_list", "reject", ("block_table",), lambda g, a: a.update(block_table=[[0, 1]]))
    G("num_reqs_float", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs=3.0))
    if api_only:
        G("num_reqs_bool", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs=True))
        G("num_reqs_str", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs="3"))
        G("num_reqs_tensor", "reject", ("num_reqs",), lambda g, a: a.update(num_reqs=torch.tensor(3)))
    if not raw:
        G("kv_cache_dtype_none", "reject", ("kv_cache_dtype",), lambda g, a: a.update(kv_cache_dtype=None))
    if not raw and api_only:  # torch's schema turns bytes into str for the raw op
        G("kv_cache_dtype_bytes", "reject", ("kv_cache_dtype",), lambda g, a: a.update(kv_cache_dtype=b"fp8"))
        G("k_scale_float", "reject", ("k_scale",), lambda g, a: a.update(k_scale=0.5))


for _entry, _via, _raw in ((GATHER, "api", False), (OP_GATHER, "op", False), (CP_GATHER, "api", True),
                           (OP_CP_GATHER, "op", True)):
    _gather_cases(_entry, _via, _raw)

# The Triton gather (forced; under the interpreter on the CPU): layouts and the out-of-range policy.
for _fmt in ("auto", "fp8", "fp8_e5m2", "fp8_ds_mla"):
    add(GATHER, f"triton_valid_{_fmt}", lambda g, f=_fmt: gather_call(gather_setup(g, f), "triton"), "accept")
add(GATHER, "triton_padded_misaligned", lambda g: gather_call(
    gather_setup(g, "fp8_ds_mla", cache_kw=dict(pad=8, misalign=1), dst_kw=dict(pad=5, misalign=1)), "triton"),
    "accept")
add(GATHER, "triton_raw_fp8", lambda g: gather_call(gather_setup(g, "fp8", dst_dtype=torch.uint8), "triton"),
    "accept")


def _triton_bad_ids(g):
    a = gather_setup(g, "fp8", width=1)  # narrower than the lengths, too
    a["block_table"][1, 0] = 99
    a["block_table"][0, 0] = -7
    return gather_call(a, "triton")


add(GATHER, "triton_out_of_range_ids", _triton_bad_ids, "either", ("block_table",))
add(CP_GATHER, "triton_valid_raw", lambda g: gather_call(gather_setup(g, "fp8_ds_mla", raw=True), "triton",
                                                          raw=True), "accept")


def _big_row_gather(via: str, raw: bool, block_id: int):
    """2**31-byte rows (real memory: MLA_EXT_FUZZ_BIG=1): a zero row (block id out of range)
    or a copied row must not crash (an int32 row size went negative and crashed)."""
    width = 2**31 + 64

    def build(g):
        cache = g.put(None, "src_cache", shape=(1, 1, width), dtype=torch.uint8)
        dst = g.put(None, "dst", writable=True, shape=(1, width), dtype=torch.uint8)
        bt = g.put(torch.tensor([[block_id]], dtype=I32), "block_table")
        cu = g.put(torch.tensor([0, 1], dtype=I32), "cu_seq_lens")
        if raw:
            fn_args = (cache, dst, bt, cu, 1, None)
            fn = (lambda: ops().cp_gather_cache(*fn_args)) if via == "op" else (lambda: api.cp_gather_cache(*fn_args))
        else:
            ks = g.put(torch.ones(1), "k_scale")
            fn_args = (cache, dst, bt, cu, 1, "fp8", ks, None)
            fn = (lambda: ops().gather_and_maybe_dequant_cache(*fn_args)) if via == "op" else (
                lambda: api.gather_and_maybe_dequant_cache(*fn_args))
        probe = (0, width // 2, width - 1)

        def check(_):
            if block_id < 0:
                nonzero = int(dst.count_nonzero())
                assert nonzero == 0, f"dst: {nonzero} bytes of the zero row are not zero"
            else:
                for i in probe:
                    assert int(dst[0, i]) == int(cache[0, 0, i]), f"dst[0, {i}] differs from the cache"
        return Call(fn, check)
    return build


if BIG:
    for _via in ("api", "op"):
        for _raw, _entry in ((True, CP_GATHER if _via == "api" else OP_CP_GATHER),
                             (False, GATHER if _via == "api" else OP_GATHER)):
            for _bid in (-1, 0):
                add(_entry, f"row_2e31_bytes_block{_bid}", _big_row_gather(_via, _raw, _bid), "either",
                    ("dst", "src_cache"), timeout=120.0, big=True)


def _zero_blocks(via: str):
    def build(g):
        cache = g.put(torch.zeros(0, 16, 576, dtype=torch.uint8), "src_cache")
        dst = g.put(torch.randn(4, 576).to(BF16), "dst", writable=True)
        bt = g.put(torch.zeros(1, 1, dtype=I32), "block_table")
        cu = g.put(torch.tensor([0, 3], dtype=I32), "cu_seq_lens")
        ks = g.put(torch.ones(1), "k_scale")
        want = dst.clone()
        want[:3] = 0  # every id is out of range: zero rows (SPEC §6)
        args = (cache, dst, bt, cu, 1, "fp8", ks, None)
        fn = (lambda: ops().gather_and_maybe_dequant_cache(*args)) if via == "op" else (
            lambda: api.gather_and_maybe_dequant_cache(*args))
        return Call(fn, lambda _: assert_same_bits(dst, want, "dst"))
    return build


add(GATHER, "cache_without_blocks", _zero_blocks("api"), "either", ("src_cache", "block_table"))
add(OP_GATHER, "cache_without_blocks", _zero_blocks("op"), "either", ("src_cache", "block_table"))


def _many_rows_zero_width(via: str):
    """dst [2**31, 0]: no bytes, but 2**31 rows; refused or a quick no-op (never a 2**31-row loop)."""
    def build(g):
        cache = g.put(torch.zeros(2, 16, 0, dtype=torch.uint8), "src_cache")
        dst = torch.empty(2**31, 0, dtype=torch.uint8)
        bt = g.put(torch.zeros(1, 1, dtype=I32), "block_table")
        cu = g.put(torch.tensor([0, 2**31 - 1], dtype=I32), "cu_seq_lens")
        args = (cache, dst, bt, cu, 1, None)
        fn = (lambda: ops().cp_gather_cache(*args)) if via == "op" else (lambda: api.cp_gather_cache(*args))
        return Call(fn)
    return build


add(CP_GATHER, "dst_2e31_rows_of_zero_bytes", _many_rows_zero_width("api"), "either", ("dst", "src_cache"),
    timeout=QUICK)
add(OP_CP_GATHER, "dst_2e31_rows_of_zero_bytes", _many_rows_zero_width("op"), "either", ("dst", "src_cache"),
    timeout=QUICK)


# ---------------------------------------------------------------------------
# Writes
# ---------------------------------------------------------------------------

def write_setup(g, fmt: str = "fp8", *, T: int = 6, num_blocks: int = 4, B: int = 16, in_dtype=BF16,
                seed: int = 1, Lw: int = L, Rw: int = R, cache_kw=None, kv_kw=None) -> dict:
    gen = _gen(seed)
    f = get_format(fmt)
    entry = f.entry_elems(Lw, Rw)
    if f.is_native:
        in_dtype = f.storage_dtype(in_dtype)  # "float16" takes fp16 inputs
    cache_dtype = in_dtype if f.is_native else torch.uint8
    if f.is_native:
        cache = torch.randn(num_blocks, B, entry, generator=gen).to(cache_dtype)
    else:
        cache = torch.randint(0, 256, (num_blocks, B, entry), generator=gen, dtype=torch.uint8)
    kv_c = (torch.randn(T, Lw, generator=gen) * 4).to(in_dtype)
    k_pe = (torch.randn(T, Rw, generator=gen) * 2).to(in_dtype)
    slots = torch.randperm(num_blocks * B, generator=gen)[:T]
    if T > 1:
        slots[1] = -1  # padding: skipped
    return dict(kv_c=g.put(kv_c, "kv_c", **(kv_kw or {})), k_pe=g.put(k_pe, "k_pe"),
                kv_cache=g.put(cache, "kv_cache", writable=True, **(cache_kw or {})),
                slot_mapping=g.put(slots, "slot_mapping"), kv_cache_dtype=fmt,
                k_scale=g.put(torch.tensor([0.05]), "k_scale"))


WRITE_ARGS = ("kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "k_scale")


def write_call(a: dict, via: str, *, validate: bool = False, check: bool = True) -> Call:
    want = None
    if check:
        c = {k: _clone(v) for k, v in a.items()}
        want = c["kv_cache"]
        ref.concat_and_cache_mla_ref(c["kv_c"], c["k_pe"], want, c["slot_mapping"], c["kv_cache_dtype"],
                                     c["k_scale"])
    pos = [a[k] for k in WRITE_ARGS]
    if via == "op":
        def fn():
            return ops().concat_and_cache_mla(*pos)
    else:
        def fn():
            return api.concat_and_cache_mla(*pos, **({"validate": True} if validate else {}))
    return Call(fn, (lambda _: assert_same_bits(a["kv_cache"], want, "kv_cache")) if check else None)


def _write_cases(entry: str, via: str) -> None:
    api_only = via == "api"

    def W(name, expect, args=(), mutate=None, *, fmt="fp8", setup=None, validate=False, timeout=60.0):
        def build(g):
            a = write_setup(g, fmt, **(setup or {}))
            if mutate is not None:
                mutate(g, a)
            return write_call(a, via, validate=validate, check=expect != "reject")
        add(entry, name, build, expect, args, timeout=timeout)

    for fmt in FORMAT_NAMES:
        W(f"valid_{fmt}", "accept", fmt=fmt)
    W("valid_fp32_inputs_fp8", "accept", setup=dict(in_dtype=torch.float32))
    W("valid_fp16_native", "accept", fmt="auto", setup=dict(in_dtype=torch.float16))
    W("valid_ds_mla_r0", "accept", fmt="fp8_ds_mla", setup=dict(Rw=0))
    W("valid_small_dims", "accept", setup=dict(Lw=7, Rw=3))
    W("padded_and_misaligned", "accept", setup=dict(cache_kw=dict(pad=8, misalign=1), kv_kw=dict(pad=5, misalign=1)))
    W("slots_int32", "accept", mutate=lambda g, a: a.update(slot_mapping=a["slot_mapping"].int()))
    W("slot_out_of_range_skipped", "either", ("slot_mapping",),
      lambda g, a: a["slot_mapping"].copy_(torch.tensor([0, 64, 2**40, -2, 5, -(2**40)])))
    W("zero_tokens", "accept", setup=dict(T=0))
    W("saturating_values", "accept", mutate=lambda g, a: a["kv_c"][0, :4].copy_(torch.tensor([1e30, -1e30, 3e38, 0.0])))
    W("saturating_values_ds_mla", "accept", fmt="fp8_ds_mla",
      mutate=lambda g, a: a["kv_c"][0, :4].copy_(torch.tensor([1e30, -1e30, 3e38, 1e-30])))
    if api_only:
        W("validate_refuses_bad_slot", "reject", ("slot_mapping",),
          lambda g, a: a["slot_mapping"].copy_(torch.tensor([0, 64, 1, 2, 5, 6])), validate=True)
    W("kv_c_int", "reject", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"].int()))
    W("k_pe_dtype_differs", "reject", ("k_pe",), lambda g, a: a.update(k_pe=a["k_pe"].float()))
    W("k_pe_rows_differ", "reject", ("k_pe",), lambda g, a: a.update(k_pe=a["k_pe"][:3]))
    W("kv_c_1d", "reject", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"][0]))
    W("kv_c_last_dim_strided", "reject", ("kv_c",),
      lambda g, a: a.update(kv_c=g.put(a["kv_c"], "kv_c2", strides=(2 * L, 2))))
    W("kv_c_expanded_last_dim", "reject", ("kv_c",),
      lambda g, a: a.update(kv_c=a["kv_c"][:, :1].expand(6, L)))
    W("kv_c_expanded_rows", "either", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"][:1].expand(6, L)))
    W("slot_mapping_float", "reject", ("slot_mapping",), lambda g, a: a.update(slot_mapping=a["slot_mapping"].float()))
    W("slot_mapping_2d", "reject", ("slot_mapping",), lambda g, a: a.update(slot_mapping=a["slot_mapping"][None]))
    W("slot_mapping_short", "reject", ("slot_mapping",), lambda g, a: a.update(slot_mapping=a["slot_mapping"][:2]))
    W("slot_mapping_strided", "reject", ("slot_mapping",),
      lambda g, a: a.update(slot_mapping=g.put(a["slot_mapping"], "sm2", strides=(2,))))
    W("cache_wrong_entry", "reject", ("kv_cache",), lambda g, a: a.update(kv_cache=a["kv_cache"][..., :500]))
    W("ds_mla_wrong_L", "reject", ("kv_c", "kv_cache", "kv_cache_dtype"), fmt="fp8_ds_mla",
      mutate=lambda g, a: a.update(kv_c=a["kv_c"][:, :256]))
    W("native_dtype_mismatch", "reject", ("kv_c",), fmt="auto",
      mutate=lambda g, a: a.update(kv_c=a["kv_c"].half(), k_pe=a["k_pe"].half()))
    W("cache_expanded", "reject", ("kv_cache",), lambda g, a: a.update(kv_cache=a["kv_cache"][:1].expand(4, -1, -1)))
    W("cache_last_dim_strided", "reject", ("kv_cache",),
      lambda g, a: a.update(kv_cache=g.put(None, "c2", writable=True, shape=(4, 16, 576), dtype=torch.uint8,
                                           strides=(16 * 1152, 1152, 2))))

    def cache_over_kv_c(g, a):
        buf = g.put(None, "shared", writable=True, shape=(5, 16, 576), dtype=BF16)
        buf.copy_(torch.randn(5, 16, 576))
        # kv_c/k_pe are rows 0-5 of cache block 3; the tokens go to rows 10-15 of that block.
        a.update(kv_cache=buf[:4], kv_c=buf[3, :6, :L], k_pe=buf[3, :6, L:], kv_cache_dtype="auto")
        a["slot_mapping"].copy_(torch.arange(6) + 58)
    W("cache_overlaps_kv_c", "reject", ("kv_cache", "kv_c"), cache_over_kv_c, fmt="auto")

    def cache_over_slots(g, a):
        buf = g.raw(4 * 16 * 576 + 64, "shared")
        a.update(kv_cache=buf[:4 * 16 * 576].view(4, 16, 576),
                 slot_mapping=buf[64:64 + 48].view(torch.int64).copy_(torch.tensor([0, 1, 2, 3, 4, 5])))
    W("cache_overlaps_slot_mapping", "reject", ("kv_cache", "slot_mapping"), cache_over_slots)

    def cache_over_scale(g, a):
        buf = g.raw(4 * 16 * 576, "shared")
        a.update(kv_cache=buf.view(4, 16, 576), k_scale=buf[:4].view(torch.float32).fill_(0.5))
    W("cache_overlaps_k_scale", "reject", ("kv_cache", "k_scale"), cache_over_scale)
    W("kv_c_on_meta", "reject", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"].to(META)))
    W("cache_on_meta", "reject", ("kv_cache", "kv_c", "k_pe", "slot_mapping"),
      lambda g, a: a.update(kv_cache=a["kv_cache"].to(META)))
    W("slot_mapping_on_meta", "reject", ("slot_mapping",),
      lambda g, a: a.update(slot_mapping=a["slot_mapping"].to(META)))
    W("k_scale_on_meta", "reject", ("k_scale",), lambda g, a: a.update(k_scale=a["k_scale"].to(META)))
    for label, v in (("nan", float("nan")), ("zero", 0.0), ("negative", -2.0), ("inf", float("inf"))):
        W(f"k_scale_{label}", "reject", ("k_scale",), lambda g, a, v=v: a["k_scale"].fill_(v))
    W("k_scale_two_elements", "reject", ("k_scale",),
      lambda g, a: a.update(k_scale=g.put(torch.tensor([0.5, 0.5]), "ks2")))
    W("k_scale_int", "reject", ("k_scale",), lambda g, a: a.update(k_scale=a["k_scale"].int()))
    for _fmt in ("fp8_ds_mla", "auto") if api_only else ():  # formats that ignore the value still
        # take a tensor (the raw op's schema refuses None itself)
        W(f"k_scale_none_{_fmt}", "reject", ("k_scale",), fmt=_fmt, mutate=lambda g, a: a.update(k_scale=None))
    W("unknown_format", "reject", ("kv_cache_dtype",), lambda g, a: a.update(kv_cache_dtype="int8"))
    W("kv_c_is_a_list", "reject", ("kv_c",), lambda g, a: a.update(kv_c=[[1.0]]))
    W("cache_is_none", "reject", ("kv_cache",), lambda g, a: a.update(kv_cache=None))
    W("huge_token_count_expanded", "reject", ("kv_c", "slot_mapping", "k_pe"),
      lambda g, a: a.update(kv_c=a["kv_c"][:1].expand(2**31, L), k_pe=a["k_pe"][:1].expand(2**31, R),
                            slot_mapping=a["slot_mapping"][:1].expand(2**31)), timeout=QUICK)
    if api_only:
        W("kv_cache_dtype_none", "reject", ("kv_cache_dtype",), lambda g, a: a.update(kv_cache_dtype=None))


_write_cases(WRITE, "api")
_write_cases(OP_WRITE, "op")


# ---------------------------------------------------------------------------
# compute_kv_scale
# ---------------------------------------------------------------------------

def kv_scale_setup(g, *, T: int = 9, dtype=BF16, seed: int = 2, kv_kw=None) -> dict:
    gen = _gen(seed)
    return dict(kv_c=g.put((torch.randn(T, L, generator=gen) * 9).to(dtype), "kv_c", **(kv_kw or {})),
                k_pe=g.put((torch.randn(T, R, generator=gen) * 30).to(dtype), "k_pe"))


def kv_scale_call(a: dict, fmt: str, via: str, check: bool = True) -> Call:
    want = ref.compute_kv_scale_ref(_clone(a["kv_c"]), _clone(a["k_pe"]), fmt) if check else None
    f = ops().compute_kv_scale if via == "op" else api.compute_kv_scale

    def verify(got):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == (1,), \
            f"expected a float32 [1] scale, got {got!r}"
        assert torch.equal(got, want), f"scale {float(got)} != reference {float(want)}"
    return Call(lambda: f(a["kv_c"], a["k_pe"], fmt), verify if check else None)


def _kv_scale_cases(entry: str, via: str) -> None:
    def S(name, expect, args=(), mutate=None, *, fmt="fp8", setup=None, timeout=60.0):
        def build(g):
            a = kv_scale_setup(g, **(setup or {}))
            if mutate is not None:
                mutate(g, a)
            return kv_scale_call(a, fmt, via, check=expect != "reject")
        add(entry, name, build, expect, args, timeout=timeout)

    for fmt in ("fp8", "fp8_e5m2", "fp8_ds_mla"):
        S(f"valid_{fmt}", "accept", fmt=fmt)
    S("valid_fp32", "accept", setup=dict(dtype=torch.float32))
    S("nan_inf_ignored", "accept", mutate=lambda g, a: a["kv_c"][0, :3].copy_(
        torch.tensor([float("nan"), float("inf"), -float("inf")])))
    S("all_nan", "accept", mutate=lambda g, a: (a["kv_c"].fill_(float("nan")), a["k_pe"].fill_(float("nan"))))
    S("zero_tokens", "accept", setup=dict(T=0))
    S("strided_rows", "accept", setup=dict(kv_kw=dict(pad=16, misalign=1)))
    S("kv_c_last_dim_expanded", "either", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"][:, :1].expand(9, L)))
    S("kv_c_last_dim_strided", "either", ("kv_c",),
      lambda g, a: a.update(kv_c=g.put(a["kv_c"], "kv_c2", strides=(2 * L, 2))))
    S("native_format", "reject", ("kv_cache_dtype",), fmt="auto")
    S("unknown_format", "reject", ("kv_cache_dtype",), fmt="fp4")
    S("kv_c_int", "reject", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"].int()))
    S("k_pe_dtype_differs", "reject", ("k_pe",), lambda g, a: a.update(k_pe=a["k_pe"].float()))
    S("k_pe_rows_differ", "reject", ("k_pe",), lambda g, a: a.update(k_pe=a["k_pe"][:4]))
    S("kv_c_1d", "reject", ("kv_c",), lambda g, a: a.update(kv_c=a["kv_c"][0]))
    S("kv_c_on_meta", "reject", ("kv_c", "k_pe"), lambda g, a: a.update(kv_c=a["kv_c"].to(META)))
    S("k_pe_on_meta", "reject", ("k_pe",), lambda g, a: a.update(k_pe=a["k_pe"].to(META)))
    S("kv_c_is_a_list", "reject", ("kv_c",), lambda g, a: a.update(kv_c=[[1.0]]))

    def build_huge_rows(g):
        # 2**31 tokens (expanded rows of token 0): refused, or the scale of token 0.
        a = kv_scale_setup(g)
        call = kv_scale_call({"kv_c": a["kv_c"][:1], "k_pe": a["k_pe"][:1]}, "fp8", via)
        kv_c, k_pe = a["kv_c"][:1].expand(2**31, L), a["k_pe"][:1].expand(2**31, R)
        f = ops().compute_kv_scale if via == "op" else api.compute_kv_scale
        return Call(lambda: f(kv_c, k_pe, "fp8"), call.check)
    add(entry, "huge_rows_expanded", build_huge_rows, "either", ("kv_c", "k_pe"), timeout=QUICK)

    def row_2e31_bytes(g, a):
        # One row of 2**31 bytes (bf16 [1, 2**30]): virtual memory only (untouched pages read as zero).
        kv = g.put(None, "kv_c_big", shape=(1, 2**30), dtype=BF16)
        a.update(kv_c=kv, k_pe=g.put(torch.zeros(1, R, dtype=BF16), "k_pe_big"))

    def build_big(g):
        a = kv_scale_setup(g)
        row_2e31_bytes(g, a)
        f = ops().compute_kv_scale if via == "op" else api.compute_kv_scale

        def verify(got):
            assert float(got) == float(torch.tensor(ref.MIN_KV_SCALE, dtype=torch.float32)), \
                f"scale of an all-zero row: {float(got)}, expected the minimum {ref.MIN_KV_SCALE}"
        return Call(lambda: f(a["kv_c"], a["k_pe"], "fp8"), verify)
    add(entry, "row_2e31_bytes", build_big, "either", ("kv_c",), timeout=90.0,
        note="an int32 row size of 2**31 bytes crashed the campaign's kernels")


_kv_scale_cases(KV_SCALE, "api")
_kv_scale_cases(OP_KV_SCALE, "op")


# ---------------------------------------------------------------------------
# Introspection of the cache stage
# ---------------------------------------------------------------------------

add(f"{API}:backend_report", "cpu", report_rows_case(api.backend_report, "cpu"), "accept")
add(f"{API}:backend_report", "default_device", report_rows_case(api.backend_report, None), "accept")
add(f"{API}:backend_report", "unknown_device", report_rows_case(api.backend_report, "tpu9"), "reject", ("device",))
add(f"{API}:backend_report", "device_is_int_list", report_rows_case(api.backend_report, [0]), "reject",
    ("device",))


def _explain(op, inputs):
    def build(g):
        inp = inputs(g) if callable(inputs) else inputs

        def check(text):
            assert isinstance(text, str) and "cpu" in text, text
        return Call(lambda: api.explain(op, inp), check)
    return build


def _gather_inputs(g):
    a = gather_setup(g, "fp8")
    return api.GatherInputs(a["src_cache"], a["dst"], a["block_table"], a["cu_seq_lens"], 3, "fp8",
                            a["k_scale"], a["seq_starts"])


add(f"{API}:explain", "gather", _explain("gather", _gather_inputs), "accept",
    also=(f"{API}:GatherInputs",))
add(f"{API}:explain", "write", _explain("write", lambda g: api.TensorInputs(tuple(write_setup(g).values()))),
    "accept", also=(f"{API}:TensorInputs",))
add(f"{API}:explain", "unknown_op", _explain("gemm", None), "reject", ("op",))
add(f"{API}:explain", "inputs_none", _explain("gather", None), "reject", ("inputs",))
add(f"{API}:explain", "inputs_wrong_kind", _explain("gather", lambda g: api.TensorInputs(())), "reject",
    ("inputs",))
