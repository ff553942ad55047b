"""Backends of the DSA index-key cache writer and gather (mla_ext.dispatch's pattern).

Stated order: the compiled CUDA kernels (csrc/sparse/index_cache.cu), the Triton kernels
(triton_index_cache.py), the compiled CPU kernels (csrc/sparse/index_cache_cpu.cpp), then
torch (index_cache.py's `_write_torch` / `_gather_torch`, the reference every other backend
is tested against). All produce the same bytes / float32 rows for in-range inputs.
`MLA_EXT_FORCE_INDEX_WRITE=<name>` / `MLA_EXT_FORCE_INDEX_GATHER=<name>` or `.force()` pick
one; Triton on CPU tensors (TRITON_INTERPRET=1) runs only when forced (a heuristic, not a
capability: the interpreter is far slower than the compiled CPU kernel).

The public wrappers (index_cache.write_index_cache / gather_index_keys /
cp_gather_indexer_k_quant_cache) check the arguments (ValueError) and, on the CPU, the slot
and block-id ranges and the offsets (cu_seq_lens, seq_starts, the output's rows) before
dispatching; on CUDA no host check is made (no sync) and the kernels skip out-of-range slots,
write no row outside cu_seq_lens and read zeros for out-of-range block ids. The compiled CPU
gather op checks the offsets itself too (it is callable as torch.ops.mla_ext.index_cache_gather).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext import _ext
from mla_ext.config.index_formats import FORMATS
from mla_ext.dispatch import Backend, Dispatcher, report_device
from mla_ext.sparse.index_cache_torch import _gather_torch, _write_torch

_NATIVE = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class IndexWriteInputs:
    """Checked arguments of write_index_cache (Q: the cache's quant block size, fp8 only)."""

    k: Tensor
    cache: Tensor
    slot_mapping: Tensor
    fmt: object  # index_cache.IndexCacheFormat
    quant_block_size: int | None
    scale_fmt: str | None

    @property
    def device(self) -> torch.device:
        return self.cache.device


@dataclass(frozen=True)
class IndexGatherInputs:
    """Checked arguments of a gather: float32 keys into `out`, or (dst_scale given, fp8 only)
    the raw e4m3 bytes into `out` (uint8 [T, D]) and the scale bytes into dst_scale."""

    cache: Tensor
    block_table: Tensor
    cu_seq_lens: Tensor
    fmt: object
    seq_starts: Tensor | None
    head_dim: int
    out: Tensor
    dst_scale: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.cache.device


def _compiled_reasons(inp, op: str, device_type: str) -> list[str]:
    if not _ext.available():
        return [str(_ext.load_error())]
    why = []
    if not hasattr(torch.ops.mla_ext, op):
        why.append(f"the compiled library has no {op} op (rebuild mla_ext)")
    if inp.device.type != device_type:
        why.append(f"tensors are on {inp.device}, not {device_type.upper() if device_type == 'cuda' else 'the CPU'}")
    elif device_type == "cuda":
        ok, reason = _ext.cuda_kernels_usable()
        if not ok:
            why.append(reason)
    return why


def _write_compiled_reasons(inp: IndexWriteInputs, device_type: str) -> list[str]:
    why = _compiled_reasons(inp, "index_cache_write", device_type)
    if inp.k.dtype not in _NATIVE:
        why.append(f"k: the compiled writer takes bf16/fp16/fp32 keys, got {inp.k.dtype}")
    if inp.k.device != inp.cache.device or inp.slot_mapping.device != inp.cache.device:
        why.append("k / slot_mapping: the compiled writer needs them on the cache's device")
    return why


def _gather_compiled_reasons(inp: IndexGatherInputs, device_type: str) -> list[str]:
    why = _compiled_reasons(inp, "index_cache_gather", device_type)
    if inp.out.device != inp.cache.device:
        why.append(f"out: on {inp.out.device}, not the cache's device {inp.cache.device}")
    if inp.dst_scale is None and inp.out.dtype != torch.float32:
        why.append(f"out: the compiled gather writes float32 keys, got {inp.out.dtype}")
    if inp.dst_scale is not None and (inp.out.dtype != torch.uint8
                                      or inp.dst_scale.dtype not in (torch.uint8, torch.float32)):
        why.append(f"dst_k / dst_scale: the compiled raw gather writes uint8 bytes and uint8/float32 scales, got "
                   f"{inp.out.dtype} / {inp.dst_scale.dtype}")
    return why


def _int32(t: Tensor | None, device) -> Tensor | None:
    return None if t is None else t.to(device=device, dtype=torch.int32).contiguous()


def _run_compiled_write(inp: IndexWriteInputs) -> None:
    torch.ops.mla_ext.index_cache_write(inp.k, inp.cache, inp.slot_mapping, inp.fmt.name,
                                        inp.quant_block_size or 0, inp.scale_fmt or "")


def _run_compiled_gather(inp: IndexGatherInputs) -> None:
    dev = inp.cache.device
    torch.ops.mla_ext.index_cache_gather(inp.cache, inp.out, _int32(inp.block_table, dev),
                                         _int32(inp.cu_seq_lens, dev), inp.fmt.name, inp.head_dim,
                                         _int32(inp.seq_starts, dev), inp.dst_scale)


def _triton_device_reasons(t: Tensor) -> list[str]:
    from mla_ext.sparse import triton_index_cache

    return triton_index_cache.not_supported_reasons(t)


def _triton_heuristic(inp) -> list[str]:
    if inp.device.type == "cpu":
        return ["CPU tensors: the Triton interpreter runs only when forced (the compiled CPU kernel is faster)"]
    return []


def _triton_write_reasons(inp: IndexWriteInputs) -> list[str]:
    from mla_ext.attention.triton_latent import _pad  # Triton is optional

    why = _triton_device_reasons(inp.cache)
    D = inp.k.shape[1]
    if inp.fmt.quantized and _pad(D) % (inp.quant_block_size or D):
        why.append(f"quant_block_size: the Triton writer needs Q={inp.quant_block_size} to divide the padded "
                   f"head {_pad(D)}")
    return why


def _run_triton_write(inp: IndexWriteInputs) -> None:
    from mla_ext.sparse.triton_index_cache import write_index_cache_triton

    write_index_cache_triton(inp.k, inp.cache, inp.slot_mapping, inp.fmt, quant_block_size=inp.quant_block_size,
                             scale_fmt=inp.scale_fmt)


def _triton_gather_reasons(inp: IndexGatherInputs) -> list[str]:
    why = _triton_device_reasons(inp.cache)
    if inp.dst_scale is not None:
        why.append("the Triton gather dequantizes; the raw (bytes + scales) gather is not in Triton")
    if inp.out.dtype != torch.float32 or inp.out.stride(-1) != 1:
        why.append("out: the Triton gather writes float32 rows with a unit last stride")
    return why


def _run_triton_gather(inp: IndexGatherInputs) -> None:
    from mla_ext.sparse.triton_index_cache import gather_index_keys_triton

    gather_index_keys_triton(inp.cache, inp.block_table, inp.cu_seq_lens, inp.fmt, seq_starts=inp.seq_starts,
                             head_dim=inp.head_dim, out=inp.out)


def _run_torch_write(inp: IndexWriteInputs) -> None:
    _write_torch(inp)


def _run_torch_gather(inp: IndexGatherInputs) -> None:
    _gather_torch(inp)


INDEX_WRITE = Dispatcher("index_write", [
    Backend("cuda", lambda inp: _write_compiled_reasons(inp, "cuda"), _run_compiled_write),
    Backend("triton", _triton_write_reasons, _run_triton_write, heuristic=_triton_heuristic),
    Backend("cpu", lambda inp: _write_compiled_reasons(inp, "cpu"), _run_compiled_write),
    Backend("torch", lambda inp: [], _run_torch_write),
])
INDEX_GATHER = Dispatcher("index_gather", [
    Backend("cuda", lambda inp: _gather_compiled_reasons(inp, "cuda"), _run_compiled_gather),
    Backend("triton", _triton_gather_reasons, _run_triton_gather, heuristic=_triton_heuristic),
    Backend("cpu", lambda inp: _gather_compiled_reasons(inp, "cpu"), _run_compiled_gather),
    Backend("torch", lambda inp: [], _run_torch_gather),
])


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] of the index-cache writer and gather for a probe on `device`
    (default: CUDA if visible), in the form `python -m mla_ext info` shows."""
    dev = report_device(device)
    fmt = FORMATS["bfloat16"]
    cache = torch.empty(1, 16, 128, dtype=torch.bfloat16, device=dev)
    i32 = torch.zeros(2, dtype=torch.int32, device=dev)
    write = IndexWriteInputs(cache[0, :1], cache, i32[:1].long(), fmt, None, None)
    gather = IndexGatherInputs(cache, i32.view(2, 1), i32, fmt, None, 128,
                               torch.empty(0, 128, dtype=torch.float32, device=dev))
    return ([(INDEX_WRITE.op, b.name, b.not_supported_reasons(write)) for b in INDEX_WRITE.backends]
            + [(INDEX_GATHER.op, b.name, b.not_supported_reasons(gather)) for b in INDEX_GATHER.backends])
