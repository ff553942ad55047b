"""Fuzz cases of the raw DSA index-cache ops (csrc/sparse/): index_cache_format_info,
index_cache_write and index_cache_gather. Valid calls are compared bit for bit with the torch
reference (mla_ext.sparse.index_cache_torch._write_torch / _gather_torch), which also defines the
out-of-range results (skipped slots; zero rows for the compiled gather, where the torch
gather refuses); every tensor sits in a guarded buffer (nothing written outside it)."""
from __future__ import annotations

import torch

from fuzz_harness import QUICK, Call, add
from helpers.numeric import assert_same_bits
from mla_ext.sparse import index_cache as ic
from mla_ext.sparse import index_cache_torch as ict
from mla_ext.sparse.index_cache_backends import IndexGatherInputs, IndexWriteInputs

OP_INFO = "torch.ops.mla_ext.index_cache_format_info"
OP_WRITE = "torch.ops.mla_ext.index_cache_write"
OP_GATHER = "torch.ops.mla_ext.index_cache_gather"
D, B, NB = 32, 4, 3
I32 = torch.int32


def ops():
    return torch.ops.mla_ext


def _info_case(name, args, expect="reject", bad=(), check=None):
    add(OP_INFO, name, lambda g: Call(lambda: ops().index_cache_format_info(*args), check), expect, bad,
        timeout=QUICK)


def _info_check(fmt, Q):
    f = ic.get_index_format(fmt)

    def check(got):
        assert list(got)[1:3] == [f.bytes_per_token(D, Q), f.page_bytes(B, D, Q)], list(got)
    return check


for _fmt in ("bfloat16", "float32", "fp8"):
    _info_case(f"valid_{_fmt}", (_fmt, D, 8, B), "accept", check=_info_check(_fmt, 8))
_info_case("unknown_format", ("fp4", D, 8, B), bad=("index_cache_dtype",))
_info_case("head_dim_odd", ("fp8", 30, 10, B), bad=("head_dim",))
_info_case("q_not_divisor", ("fp8", D, 12, B), bad=("quant_block_size",))
_info_case("q_zero", ("fp8", D, 0, B), bad=("quant_block_size",))
_info_case("block_size_zero", ("fp8", D, 8, 0), bad=("block_size",))
_info_case("head_dim_2e40", ("bf16", 2**40, 8, B), bad=("head_dim",))


def _cache(fmt, Q):
    c = ic.get_index_format(fmt).empty(NB, B, D, Q)
    return c.fill_(0x5A) if c.dtype == torch.uint8 else c.fill_(0.5)


def _write_setup(g, fmt="fp8", Q=8, scale_fmt="ue8m0", slots=(0, 5, -1, 11, 99), kdtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(len(slots))
    k = (torch.randn(len(slots), D, generator=gen) * 3).to(kdtype)
    slot = torch.tensor(slots, dtype=torch.int64)
    want = _cache(fmt, Q)
    ict._write_torch(IndexWriteInputs(k, want, slot, ic.get_index_format(fmt), Q, scale_fmt))
    return (g.put(k, "k"), g.put(_cache(fmt, Q), "cache", writable=True), g.put(slot, "slot_mapping"),
            fmt, Q, scale_fmt or ""), want


def _write_case(name, expect="accept", bad=(), change=None, **kw):
    def build(g):
        args, want = _write_setup(g, **kw)
        args = list(args)
        if change is not None:
            change(g, args)

        def check(_):
            assert_same_bits(args[1], want, "cache")
        return Call(lambda: ops().index_cache_write(*args), check if expect == "accept" else None)
    add(OP_WRITE, name, build, expect, bad)


for _fmt, _q, _s in (("bfloat16", 8, None), ("float32", 8, None), ("fp8", 8, "ue8m0"), ("fp8", 32, None)):
    _write_case(f"valid_{_fmt}_q{_q}_{_s}", fmt=_fmt, Q=_q, scale_fmt=_s)
_write_case("valid_fp16_keys", kdtype=torch.float16)
_write_case("wrong_q", "reject", ("quant_block_size",), change=lambda g, a: a.__setitem__(4, 16))
_write_case("scale_fmt_bad", "reject", ("scale_fmt",), change=lambda g, a: a.__setitem__(5, "mxfp8"))
_write_case("format_unknown", "reject", ("index_cache_dtype",), change=lambda g, a: a.__setitem__(3, "fp4"))
_write_case("k_float64", "reject", ("k",), change=lambda g, a: a.__setitem__(0, g.put(a[0].double(), "k64")))
_write_case("k_head_dim", "reject", ("cache", "head_dim"),
            change=lambda g, a: a.__setitem__(0, g.put(a[0][:, :16].contiguous(), "k16")))
_write_case("slots_short", "reject", ("slot_mapping",), change=lambda g, a: a.__setitem__(2, a[2][:2]))
_write_case("slots_float", "reject", ("slot_mapping",),
            change=lambda g, a: a.__setitem__(2, g.put(a[2].float(), "fslots")))
_write_case("cache_int8", "reject", ("cache",), change=lambda g, a: a.__setitem__(1, a[1].view(torch.int8)))
_write_case("cache_overlaps_k", "reject", ("cache", "k"),
            change=lambda g, a: a.__setitem__(0, a[1].view(torch.bfloat16).view(-1)[:5 * D].view(5, D)))


def _gather_setup(g, fmt="fp8", Q=8, raw=False, table=((2, 0), (1, 7)), cu=(0, 6, 11), starts=None):
    gen = torch.Generator().manual_seed(3)
    cache = _cache(fmt, Q)
    ict._write_torch(IndexWriteInputs(torch.randn(NB * B, D, generator=gen), cache, torch.arange(NB * B),
                                     ic.get_index_format(fmt), Q, None))
    bt, cul = torch.tensor(table, dtype=I32), torch.tensor(cu, dtype=I32)
    st = None if starts is None else torch.tensor(starts, dtype=I32)
    rows = cu[-1]
    if raw:
        dst, scale = torch.zeros(rows, D, dtype=torch.uint8), torch.zeros(rows, 4 * (D // Q), dtype=torch.uint8)
    else:
        dst, scale = torch.zeros(rows, D), None
    # the reference: in-range rows from torch, the rest zero (the compiled kernels' policy)
    want_dst, want_scale = dst.clone(), None if scale is None else scale.clone()
    for r in range(len(cu) - 1):
        for i in range(cu[r], cu[r + 1]):
            tok = (0 if starts is None else starts[r]) + i - cu[r]
            blk = table[r][tok // B] if tok // B < len(table[r]) else -1
            if 0 <= blk < NB:
                one = torch.tensor([[blk]], dtype=I32)
                inp = IndexGatherInputs(cache, one, torch.tensor([0, 1], dtype=I32), ic.get_index_format(fmt),
                                        torch.tensor([tok % B], dtype=I32), D, want_dst[i:i + 1],
                                        None if scale is None else want_scale[i:i + 1])
                ict._gather_torch(inp)
    args = [g.put(cache, "cache"), g.put(dst, "dst", writable=True), g.put(bt, "block_table"),
            g.put(cul, "cu_seq_lens"), fmt, D, None if st is None else g.put(st, "seq_starts"),
            None if scale is None else g.put(scale, "dst_scale", writable=True)]
    return args, (want_dst, want_scale)


def _gather_case(name, expect="accept", bad=(), change=None, **kw):
    def build(g):
        args, (want, want_scale) = _gather_setup(g, **kw)
        if change is not None:
            change(g, args)

        def check(_):
            assert_same_bits(args[1], want, "dst")
            if want_scale is not None:
                assert_same_bits(args[7], want_scale, "dst_scale")
        return Call(lambda: ops().index_cache_gather(*args), check if expect == "accept" else None)
    add(OP_GATHER, name, build, expect, bad)


for _fmt in ("bfloat16", "float32", "fp8"):
    _gather_case(f"valid_{_fmt}_block_id_past_cache", fmt=_fmt)
_gather_case("valid_fp8_raw", raw=True)
_gather_case("valid_seq_starts_past_table", starts=(3, 2), cu=(0, 5, 9))
_gather_case("negative_block_id", table=((-1, 0), (1, 2)))
_gather_case("dst_float16", "reject", ("dst",),
             change=lambda g, a: a.__setitem__(1, g.put(torch.zeros(11, D, dtype=torch.float16), "d16", writable=True)))
_gather_case("dst_width", "reject", ("dst",),
             change=lambda g, a: a.__setitem__(1, g.put(torch.zeros(11, D + 1), "dw", writable=True)))
_gather_case("scale_on_bf16", "reject", ("dst_scale",), fmt="bfloat16",
             change=lambda g, a: a.__setitem__(7, g.put(torch.zeros(11, 16, dtype=torch.uint8), "s", writable=True)))
_gather_case("scale_width", "reject", ("dst_scale",), raw=True,
             change=lambda g, a: a.__setitem__(7, g.put(torch.zeros(11, 3, dtype=torch.uint8), "s3", writable=True)))
_gather_case("table_int64", "reject", ("block_table",),
             change=lambda g, a: a.__setitem__(2, g.put(a[2].long(), "bt64")))
_gather_case("seq_starts_short", "reject", ("seq_starts",),
             change=lambda g, a: a.__setitem__(6, g.put(torch.zeros(1, dtype=I32), "st1")))
_gather_case("head_dim_wrong", "reject", ("head_dim", "cache"), change=lambda g, a: a.__setitem__(5, 16))
_gather_case("dst_overlaps_cache", "reject", ("dst",), fmt="float32",
             change=lambda g, a: a.__setitem__(1, a[0].view(-1)[:11 * D].view(11, D)))
