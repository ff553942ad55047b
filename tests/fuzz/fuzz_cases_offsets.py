"""The "offsets" fuzz class: every op that takes offset arguments gets negative, decreasing and
past-the-end cases by construction.

OFFSET_OPS declares each op once: a valid call (checked bit for bit against the torch
reference), its offset arguments by kind and its outputs. `_register` derives the bad cases
from the kinds, so a new op with offsets gets them all by adding one entry:

  cu          [num_reqs + 1] row offsets into the output (cu_seq_lens): entry 0 negative, an
              entry below the one before (a negative request length), the last past the output.
  starts      [num_reqs] first context token of each request (seq_starts): negative.
  row_starts  [num_reqs] first output row of each request, the last running to the output's end
              (vLLM's workspace_starts): negative, decreasing, past the output.

and every op gets `offsets_outputs_short`: its outputs a few rows shorter than the offsets
reach. Each must be refused naming the offset argument (or the output), before anything is
written. The ops run on CPU tensors, the host path that checks these (a CUDA op does not read
its offsets, which would sync; its kernels bound every row instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fuzz_harness import QUICK, Call, add
from helpers.numeric import assert_same_bits
from mla_ext.cache import api as cache_api
from mla_ext.cache import reference as ref
from mla_ext.sparse import index_cache as ic
from mla_ext.sparse import index_cache_torch as ict
from mla_ext.config.formats import QuantMode, get_format
from mla_ext.sparse.index_cache_backends import IndexGatherInputs, IndexWriteInputs

I32 = torch.int32
NB, B, D, Q = 6, 4, 32, 8  # cache blocks, block size, index head dim, fp8 quant block
TABLE = ((2, 0, 5), (1, 3, 4), (0, 5, 2))  # 3 requests x 3 logical blocks (12 tokens each at most)
CU = (0, 5, 9, 12)  # rows of requests of 5, 4 and 3 tokens
STARTS = (1, 2, 0)  # first token of each: every token stays inside its table row
ROWS = CU[-1]


@dataclass(frozen=True)
class OffsetOp:
    entry: str
    setup: Callable[[], tuple[dict, dict]]  # (arguments by name, wanted outputs by name) of a valid call
    call: Callable[[dict], Any]
    offsets: dict  # argument name -> kind ("cu", "starts", "row_starts")
    outputs: tuple[str, ...]  # written arguments (rows: dim 0)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def _index_cache(fmt: str) -> torch.Tensor:
    """An index cache of `fmt` with every slot written (the torch writer)."""
    f = ic.get_index_format(fmt)
    q = Q if f.quantized else None
    cache = f.empty(NB, B, D, q)
    k = torch.randn(NB * B, D, generator=torch.Generator().manual_seed(5)) * 3
    ict._write_torch(IndexWriteInputs(k, cache, torch.arange(NB * B), f, q, None))
    return cache


def _index_want(cache, fmt, starts, raw=False) -> dict:
    if raw:
        out, scale = torch.zeros(ROWS, D, dtype=torch.uint8), torch.zeros(ROWS, 4 * (D // Q), dtype=torch.uint8)
    else:
        out, scale = torch.zeros(ROWS, D), None
    ict._gather_torch(IndexGatherInputs(cache, _i32(TABLE), _i32(CU), ic.get_index_format(fmt),
                                       None if starts is None else _i32(starts), D, out, scale))
    return {"out": out, "scale": scale}


def _index_gather_setup(fmt="bfloat16", starts=STARTS):
    def setup():
        cache = _index_cache(fmt)
        want = _index_want(cache, fmt, starts)
        args = {"cache": cache, "block_table": _i32(TABLE), "cu_seq_lens": _i32(CU),
                "seq_starts": _i32(starts), "out": torch.zeros(ROWS, D)}
        return args, {"out": want["out"]}
    return setup


def _index_raw_setup(dst_name="dst_k"):
    def setup():
        cache = _index_cache("fp8")
        want = _index_want(cache, "fp8", None, raw=True)
        args = {"kv_cache": cache, dst_name: torch.zeros(ROWS, D, dtype=torch.uint8),
                "dst_scale": torch.zeros(ROWS, 4 * (D // Q), dtype=torch.uint8), "block_table": _i32(TABLE),
                "cu_seq_lens": _i32(CU)}
        return args, {dst_name: want["out"], "dst_scale": want["scale"]}
    return setup


def _latent_setup(fmt: str, width: int, raw: bool = False, starts=STARTS, workspace: bool = False):
    """A latent cache of `fmt` filled by the write op, and the reference gather of it."""
    def setup():
        gen = torch.Generator().manual_seed(9)
        L, R = (512, 64) if width == 576 else (width - 64, 64)
        f = get_format(fmt)
        if f.quant_mode == QuantMode.NONE:
            cache = torch.empty(NB, B, L + R, dtype=torch.bfloat16)
        else:
            cache = torch.empty(NB, B, f.entry_elems(L, R), dtype=torch.uint8)
        k_scale = torch.ones(1)
        kv_c = torch.randn(NB * B, L, generator=gen).to(torch.bfloat16)
        k_pe = torch.randn(NB * B, R, generator=gen).to(torch.bfloat16)
        cache_api.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(NB * B), fmt, k_scale)
        dst_dtype = cache.dtype if raw else torch.bfloat16
        want = torch.zeros(ROWS, width, dtype=dst_dtype)
        st = None if starts is None else _i32(starts)
        if raw:
            ref.cp_gather_ref(cache, want, _i32(TABLE), _i32(CU), 3, st)
        else:
            ref.gather_ref(cache, want, _i32(TABLE), _i32(CU), 3, fmt, k_scale, st)
        args = {"src_cache": cache, "dst": torch.zeros(ROWS, width, dtype=dst_dtype), "block_table": _i32(TABLE),
                "k_scale": k_scale}
        if workspace:
            args["workspace_starts"] = _i32(CU[:-1])
        else:
            args["cu_seq_lens"] = _i32(CU)
        if starts is not None:
            args["seq_starts"] = st
        return args, {"dst": want}
    return setup


def _vllm():
    from mla_ext.vllm import _custom_ops

    return _custom_ops


OFFSET_OPS = (
    OffsetOp("torch.ops.mla_ext.index_cache_gather", _index_gather_setup(),
             lambda a: torch.ops.mla_ext.index_cache_gather(a["cache"], a["out"], a["block_table"], a["cu_seq_lens"],
                                                            "bfloat16", D, a["seq_starts"]),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("out",)),
    OffsetOp("mla_ext.sparse.index_cache:gather_index_keys", _index_gather_setup("fp8"),
             lambda a: ic.gather_index_keys(a["cache"], a["block_table"], a["cu_seq_lens"], "fp8",
                                            seq_starts=a["seq_starts"], head_dim=D, out=a["out"]),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("out",)),
    OffsetOp("mla_ext.sparse.triton_index_cache:gather_index_keys_triton", _index_gather_setup(),
             lambda a: _triton().gather_index_keys_triton(a["cache"], a["block_table"], a["cu_seq_lens"], "bfloat16",
                                                          seq_starts=a["seq_starts"], head_dim=D, out=a["out"]),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("out",)),
    OffsetOp("mla_ext.sparse.index_cache:cp_gather_indexer_k_quant_cache", _index_raw_setup(),
             lambda a: ic.cp_gather_indexer_k_quant_cache(a["kv_cache"], a["dst_k"], a["dst_scale"],
                                                          a["block_table"], a["cu_seq_lens"]),
             {"cu_seq_lens": "cu"}, ("dst_k", "dst_scale")),
    OffsetOp("mla_ext.vllm._custom_ops:cp_gather_indexer_k_quant_cache", _index_raw_setup(),
             lambda a: _vllm().cp_gather_indexer_k_quant_cache(a["kv_cache"], a["dst_k"], a["dst_scale"],
                                                               a["block_table"], a["cu_seq_lens"]),
             {"cu_seq_lens": "cu"}, ("dst_k", "dst_scale")),
    OffsetOp("mla_ext.vllm._custom_ops:cp_gather_and_upconvert_fp8_kv_cache",
             _latent_setup("fp8_ds_mla", 576, workspace=True),
             lambda a: _vllm().cp_gather_and_upconvert_fp8_kv_cache(a["src_cache"], a["dst"], a["block_table"],
                                                                    a["workspace_starts"], 3, a["seq_starts"]),
             {"workspace_starts": "row_starts", "seq_starts": "starts"}, ("dst",)),
    OffsetOp("mla_ext.vllm._custom_ops:cp_gather_and_upconvert_nvfp4_kv_cache",
             _latent_setup("nvfp4_ds_mla", 576, starts=None, workspace=True),
             lambda a: _vllm().cp_gather_and_upconvert_nvfp4_kv_cache(a["src_cache"], a["dst"], a["block_table"],
                                                                      a["workspace_starts"], 3),
             {"workspace_starts": "row_starts"}, ("dst",)),
    OffsetOp("mla_ext.vllm._custom_ops:gather_and_maybe_dequant_cache", _latent_setup("fp8", 576),
             lambda a: _vllm().gather_and_maybe_dequant_cache(a["src_cache"], a["dst"], a["block_table"],
                                                              a["cu_seq_lens"], torch.zeros(ROWS, dtype=I32), 0,
                                                              "fp8", a["k_scale"], a["seq_starts"]),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("dst",)),
    OffsetOp("mla_ext.vllm._custom_ops:cp_gather_cache", _latent_setup("auto", 128, raw=True),
             lambda a: _vllm().cp_gather_cache(a["src_cache"], a["dst"], a["block_table"], a["cu_seq_lens"], 3,
                                               a["seq_starts"]),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("dst",)),
    # The latent gathers check the same offsets with validate=True (one checker:
    # mla_ext.cache.checks.check_block_ids).
    OffsetOp("mla_ext.cache.api:gather_and_maybe_dequant_cache", _latent_setup("fp8", 128),
             lambda a: cache_api.gather_and_maybe_dequant_cache(a["src_cache"], a["dst"], a["block_table"],
                                                                a["cu_seq_lens"], 3, "fp8", a["k_scale"],
                                                                a["seq_starts"], validate=True),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("dst",)),
    OffsetOp("mla_ext.cache.api:cp_gather_cache", _latent_setup("auto", 128, raw=True),
             lambda a: cache_api.cp_gather_cache(a["src_cache"], a["dst"], a["block_table"], a["cu_seq_lens"], 3,
                                                 a["seq_starts"], validate=True),
             {"cu_seq_lens": "cu", "seq_starts": "starts"}, ("dst",)),
)


def _triton():
    from mla_ext.sparse import triton_index_cache

    return triton_index_cache


def _set(args: dict, name: str, index: int, value: int) -> None:
    t = args[name].clone()
    t[index] = value
    args[name] = t


def _mutations(name: str, kind: str, outputs: tuple[str, ...]):
    """(case name, change of the arguments, the names a refusal may give) per offset kind."""
    last = {"cu": -1, "row_starts": -1}.get(kind)
    if kind in ("cu", "row_starts", "starts"):
        yield f"offsets_{name}_negative", lambda a: _set(a, name, 0, -1), (name,)
    if kind in ("cu", "row_starts"):
        # entry 1 above entry 2: request 1 has a negative length (cu) / starts after request 2 (row_starts)
        yield f"offsets_{name}_decreasing", lambda a: _set(a, name, 1, int(a[name][2]) + 1), (name,)
        yield f"offsets_{name}_past_end", lambda a: _set(a, name, last, ROWS + 2), (name,) + outputs
    assert kind in ("cu", "row_starts", "starts"), kind


def _shorten(outputs: tuple[str, ...]):
    def change(a):
        for name in outputs:
            a[name] = a[name][: CU[-2] - 1].clone()  # even the last request of row_starts starts past it
    return change


def _build(op: OffsetOp, change):
    def build(g):
        args, want = op.setup()
        if change is not None:
            change(args)
        put = {k: g.put(v, k, writable=k in op.outputs) if isinstance(v, torch.Tensor) else v
               for k, v in args.items()}

        def check(_):
            for k, w in want.items():
                assert_same_bits(put[k], w, k)
        return Call(lambda: op.call(put), check if change is None else None)
    return build


def _register(op: OffsetOp) -> None:
    add(op.entry, "offsets_valid", _build(op, None), "accept")
    for name, kind in op.offsets.items():
        for case_name, change, names in _mutations(name, kind, op.outputs):
            add(op.entry, case_name, _build(op, change), "reject", names, timeout=QUICK)
    add(op.entry, "offsets_outputs_short", _build(op, _shorten(op.outputs)), "reject",
        tuple(op.offsets) + op.outputs, timeout=QUICK)


for _op in OFFSET_OPS:
    _register(_op)
