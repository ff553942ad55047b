"""Sparse latent attention over physical cache slots: what vLLM's sparse MLA impl needs
(mla_ext/vllm/sparse_backend.py, the kernel hook of SparseMLACommonImpl).

Token t attends, in latent space (mla_ext/attention/latent.py), exactly the cache rows listed
in slots[t]: vLLM's physical top-k slots (request-local top-k positions already converted
through the block table, causal masking already applied, -1 padded). A slot is a row of the
cache viewed flat, as vLLM's flat_kv_row_view does: block s // block_rows, offset
s % block_rows, where block_rows is the cache's block stride in rows (kv_cache.stride(0) //
kv_cache.stride(1): block_size, or more when other layers' pages sit between this layer's
blocks). Rows are decoded from every cache format in the loader (native bf16/fp16/fp32,
per-tensor fp8 with k_scale, fp8_ds_mla's 656-byte rows, nvfp4_ds_mla).

Slots that are no key: -1 (padding), any negative value, an offset at or past block_size and a
block at or past num_blocks. They are masked where they are loaded (checking them on the host
would synchronise, which a CUDA graph cannot): they are never read and take no part in the
softmax. A token with no valid slot gets out = 0 and lse = -inf (the identity of an LSE merge,
as vLLM's DCP combine expects). Duplicate slots count twice (top-k never repeats one).

Returns (out [T, H, L] in q's dtype, lse [T, H] float32 natural log): the layout vLLM's sparse
MLA impls return from `_forward_mqa_kernel` (FlashMLA sparse: lse "(T, H)" for the DCP merge,
`lse_base_on_e = True`).

Backends (`SPARSE_SLOTS` dispatcher; force with `SPARSE_SLOTS.force(name)` or
MLA_EXT_FORCE_SPARSE_LATENT_ATTENTION_SLOTS=name):
  triton  mla_ext/sparse/triton_sparse.py's flat-slot kernel (software e4m3 decode: no fp8 PTX
          types below sm_89), split-K with an LSE merge for decode-sized grids; CUDA, or the
          CPU under TRITON_INTERPRET=1 only when forced (the interpreter is for tests);
  torch   per block of tokens, decode the block's distinct valid rows once
          (mla_ext.cache.reference.decode_cache_rows, every format), fp32 matmuls; the workspace
          is bounded by MAX_ROW_BYTES whatever K.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.attention import triton_latent as TL
from mla_ext.cache.checks import check_cache_dtype
from mla_ext.config.formats import QuantMode, get_format
from mla_ext.dispatch import Backend, Dispatcher, report_device
from mla_ext.sparse.torch_rows import attend, decode_entries

MAX_ROW_BYTES = 64 << 20  # torch backend: decoded rows per block of tokens
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class SlotInputs:
    q_lat: Tensor  # [T, H, L]
    q_pe: Tensor  # [T, H, R]
    kv_cache: Tensor  # [num_blocks, block_size, entry], uint8 / native (float8 viewed as uint8)
    kv_cache_dtype: str
    slots: Tensor  # int32 [T, K]
    block_rows: int  # the cache's block stride in rows
    k_scale: Tensor | None
    softmax_scale: float
    out: Tensor  # [T, H, L]
    lse: Tensor  # [T, H] float32
    splits: int | None  # triton: split-K count (None: by the grid)

    @property
    def device(self) -> torch.device:
        return self.q_lat.device


def _triton_reasons(x: SlotInputs) -> list[str]:
    if x.device.type == "cpu" and SPARSE_SLOTS._forced_name() != "triton":
        return ["input is on the CPU: the Triton interpreter runs only when this backend is forced"]
    why = TL.not_supported_reasons(x.kv_cache, x.q_lat, x.kv_cache_dtype)
    if x.q_lat.stride(-1) != 1 or x.q_pe.stride(-1) != 1 or x.out.stride(-1) != 1:
        why.append("q_lat / q_pe / out: the kernel needs a contiguous last dimension")
    return why


def _triton_run(x: SlotInputs) -> None:
    from mla_ext.sparse.triton_sparse import slot_attention_triton

    slot_attention_triton(x.q_lat, x.q_pe, x.kv_cache, x.kv_cache_dtype, x.slots, x.block_rows, x.k_scale,
                          x.softmax_scale, x.out, x.lse, splits=x.splits)


def valid_slots(slots: Tensor, num_blocks: int, block_size: int, block_rows: int) -> Tensor:
    """bool [T, K]: which slots name a row of the cache (module docstring)."""
    s = slots.to(torch.int64)
    return (s >= 0) & (s % block_rows < block_size) & (s // block_rows < num_blocks)


def _rows(x: SlotInputs, t0: int, t1: int) -> tuple[Tensor, Tensor]:
    """(decoded rows [t1-t0, K, L+R] fp32, valid [t1-t0, K]) for tokens t0..t1."""
    nb, B = x.kv_cache.shape[:2]
    valid = valid_slots(x.slots[t0:t1], nb, B, x.block_rows)
    width = x.q_lat.shape[-1] + x.q_pe.shape[-1]
    rows = decode_entries(x.kv_cache, x.slots[t0:t1], valid, x.block_rows, x.kv_cache_dtype, x.k_scale, width)
    return rows, valid


def _torch_run(x: SlotInputs) -> None:
    T, H, L = x.q_lat.shape
    K = x.slots.shape[1]
    step = max(1, MAX_ROW_BYTES // max(1, K * (L + x.q_pe.shape[-1]) * 4))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        rows, valid = _rows(x, t0, t1)  # [tq, K, L+R], [tq, K]
        o, lse = attend(x.q_lat[t0:t1], x.q_pe[t0:t1], rows, valid, x.softmax_scale)
        x.out[t0:t1] = o.to(x.out.dtype)
        x.lse[t0:t1] = lse


SPARSE_SLOTS = Dispatcher(
    "sparse_latent_attention_slots",
    [
        Backend("triton", _triton_reasons, _triton_run),
        Backend("torch", lambda x: [], _torch_run),
    ],
)


def _check(q_lat, q_pe, kv_cache, kv_cache_dtype, slots, softmax_scale, k_scale, out) -> tuple[int, float]:
    """The arguments' ValueErrors; (block_rows, softmax_scale)."""
    if not isinstance(q_lat, Tensor) or q_lat.dim() != 3:
        raise ValueError(f"q_lat: expected a tensor [T, H, L], got {getattr(q_lat, 'shape', type(q_lat))}")
    T, H, L = q_lat.shape
    if q_lat.dtype not in Q_DTYPES:
        raise ValueError(f"q_lat: expected bfloat16, float16 or float32, got {q_lat.dtype}")
    if not (isinstance(q_pe, Tensor) and q_pe.dim() == 3 and q_pe.shape[:2] == (T, H)):
        raise ValueError(f"q_pe: expected [T={T}, H={H}, R], got {tuple(getattr(q_pe, 'shape', ()))}")
    if q_pe.dtype != q_lat.dtype:
        raise ValueError(f"q_pe: expected q_lat's dtype {q_lat.dtype}, got {q_pe.dtype}")
    R = q_pe.shape[2]
    fmt = get_format(kv_cache_dtype)
    fmt.check_dims(L, R)
    if not isinstance(kv_cache, Tensor) or kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, entry], got "
                         f"{tuple(getattr(kv_cache, 'shape', ()))}")
    entry = fmt.entry_elems(L, R)
    if kv_cache.shape[2] != entry:
        raise ValueError(f"kv_cache: kv_cache_dtype {fmt.name!r} with L={L}, R={R} needs rows of {entry} elements, "
                         f"got {kv_cache.shape[2]}")
    check_cache_dtype(kv_cache, fmt)
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) < entry or kv_cache.stride(0) % kv_cache.stride(1):
        raise ValueError(f"kv_cache: expected contiguous rows and a block stride that is a whole number of rows "
                         f"(a vLLM paged cache), got strides {kv_cache.stride()}")
    if not (isinstance(slots, Tensor) and slots.dtype == torch.int32 and slots.dim() == 2 and slots.shape[0] == T):
        raise ValueError(f"slots: expected int32 [T={T}, K] physical slot ids, got "
                         f"{getattr(slots, 'dtype', type(slots))} {tuple(getattr(slots, 'shape', ()))}")
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        if not (isinstance(k_scale, Tensor) and k_scale.numel() == 1):
            raise ValueError(f"k_scale: {fmt.name!r} needs a float32 tensor of 1 element")
    if isinstance(softmax_scale, Tensor) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    if out is not None:
        if not isinstance(out, Tensor) or out.shape != q_lat.shape or out.dtype != q_lat.dtype:
            raise ValueError(f"out: expected {q_lat.dtype} [T={T}, H={H}, L={L}], got "
                             f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
    check_no_meta(q_lat=q_lat, q_pe=q_pe, kv_cache=kv_cache, slots=slots, k_scale=k_scale, out=out)
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("slots", slots), ("out", out)):
        if t is not None and t.device != q_lat.device:
            raise ValueError(f"{name}: expected device {q_lat.device} (q_lat's), got {t.device}")
    return kv_cache.stride(0) // kv_cache.stride(1), float(softmax_scale)


def sparse_latent_attention_slots(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, kv_cache_dtype: str, slots: Tensor, softmax_scale: float, *,
    k_scale: Tensor | None = None, out: Tensor | None = None, splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [T, H, L] q_lat's dtype, lse [T, H] float32 natural log): token t attends exactly the
    cache rows slots[t] (module docstring: flat physical slots, -1 / out of range = no key; a
    token without a key gets 0 and -inf).

    q_lat [T, H, L] absorbed queries (token-major, any strides); q_pe [T, H, R]; kv_cache
    [num_blocks, block_size, entry] in `kv_cache_dtype` (uint8 656-byte rows for fp8_ds_mla;
    a float8 cache of a per-tensor format is read as its bytes); slots int32 [T, K]; k_scale
    fp32 [1] for per-tensor fp8 formats; out: written in place when given. `splits` forces the
    Triton backend's split-K count (tests; None picks it from the grid)."""
    block_rows, scale = _check(q_lat, q_pe, kv_cache, kv_cache_dtype, slots, softmax_scale, k_scale, out)
    if splits is not None and not (isinstance(splits, int) and splits >= 1):
        raise ValueError(f"splits: expected a positive int or None, got {splits!r}")
    if out is None:
        out = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    lse = torch.empty(q_lat.shape[:2], dtype=torch.float32, device=q_lat.device)
    cache = kv_cache.view(torch.uint8) if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else kv_cache
    if q_lat.shape[0] and q_lat.shape[1]:
        SPARSE_SLOTS.run(SlotInputs(q_lat, q_pe, cache, kv_cache_dtype, slots, block_rows, k_scale, scale, out, lse,
                                    splits))
    return out, lse


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for a probe on `device` (default: CUDA if visible), the form
    `python -m mla_ext info` shows."""
    dev = report_device(device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.empty(1, 1, 512, dtype=dt, device=dev)
    x = SlotInputs(q, q.new_empty(1, 1, 64), q.new_empty(1, 64, 576), "auto",
                   torch.zeros(1, 1, dtype=torch.int32, device=dev), 64, None, 1.0, q, q.new_empty(1, 1).float(), None)
    return [(SPARSE_SLOTS.op, b.name, b.not_supported_reasons(x)) for b in SPARSE_SLOTS.backends]
