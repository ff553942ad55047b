"""Argument checks shared by every cache backend (C++ CPU, CUDA, Triton).

Errors are API: each raises ValueError naming the argument and what was
expected. The shape/dtype/stride and memory-overlap checks never read tensor
data (no host sync);
`check_offsets`, `check_row_starts`, `check_block_ids`, `check_slots` and
`check_scale_value` do read data and are used only when the caller asks for
`validate=True` or the data is on the CPU (the index-cache gathers and vLLM's
surface check offsets on CPU tensors by default; CUDA kernels bound every row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext.config.formats import QuantMode, get_format, CacheFormat

NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEQUANT_DST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_VIEW_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class GatherInfo:
    """What a validated gather does; backends read it to pick a kernel."""

    fmt: CacheFormat
    raw: bool  # bytes copied unchanged (native copy or fp8 passthrough)
    num_blocks: int
    block_size: int
    entry: int  # last dim of the cache
    width: int  # last dim of dst


def _tensor(x, arg: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{arg}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _same_device(t: Tensor, ref: Tensor, arg: str, ref_arg: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{arg}: expected a tensor on {ref.device} (the device of {ref_arg}), got {t.device}")


# -- memory overlap ------------------------------------------------------------
# An op must not write memory it also reads through another argument, nor one
# location twice. The rules below are exact for the layouts the ops take and
# conservative otherwise; csrc/common/torch_checks.h applies the same rules to the raw
# ops. They read addresses, never data (no host sync). Strides are >= 0
# (torch has no negative strides).

def _addressable(*tensors: Tensor) -> bool:
    """Real memory to compare: not while torch.compile traces, not meta tensors."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:  # a loop, not all(genexpr): this runs for every output of every op call
        if t.is_meta:
            return False
    return True


def has_internal_overlap(t: Tensor) -> bool:
    """True unless t's elements provably occupy distinct addresses.

    The dims of size > 1, by increasing stride, must each step past every
    offset the smaller ones reach; an expand()ed dim (stride 0) never does.
    """
    reach = 0
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _span_and_run(t: Tensor) -> tuple[int, int, int, list[int]]:
    """(first byte, end byte, run bytes, strides of the runs in bytes).

    A run is t's unit-stride last dim (or one element); the other dims place
    runs at multiples of their strides.
    """
    e = t.element_size()
    last = t.dim() - 1
    inner = last >= 0 and t.size(last) > 1 and t.stride(last) == 1
    reach, steps = 0, []
    for d in range(t.dim()):
        if t.size(d) > 1:
            reach += (t.size(d) - 1) * t.stride(d)
            if not (inner and d == last):
                steps.append(t.stride(d) * e)
    lo = t.data_ptr()
    return lo, lo + (reach + 1) * e, (t.size(last) * e if inner else e), steps


def may_overlap(a: Tensor, b: Tensor) -> bool:
    """True unless a and b provably share no byte.

    Disjoint byte spans never overlap. Otherwise, with P the gcd of every run
    stride of both tensors, each byte of a sits at a residue in
    [a0, a0 + run_a) mod P and each byte of b in [b0, b0 + run_b) mod P:
    disjoint residue ranges mean disjoint tensors (exact for column slices
    of one buffer and for interleaved rows).
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    # A tensor's bytes lie inside its storage's: disjoint storages (separate allocations, the
    # common case) never overlap, decided without walking the strides (a few calls, not ~40).
    sa, sb = a.untyped_storage(), b.untyped_storage()
    sa_lo, sb_lo = sa.data_ptr(), sb.data_ptr()
    if sa_lo + sa.nbytes() <= sb_lo or sb_lo + sb.nbytes() <= sa_lo:
        return False
    a_lo, a_hi, run_a, steps_a = _span_and_run(a)
    b_lo, b_hi, run_b, steps_b = _span_and_run(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    period = math.gcd(*steps_a, *steps_b)
    if period == 0:
        return True  # two single runs whose spans intersect
    d = (b_lo - a_lo) % period
    return not (run_a <= d and d + run_b <= period)


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def check_no_internal_overlap(t: Tensor, arg: str) -> None:
    if _addressable(t) and has_internal_overlap(t):
        raise ValueError(
            f"{arg}: its elements overlap in memory (shape {tuple(t.shape)}, strides {t.stride()}); "
            "expected a tensor whose elements are distinct, not an expand()ed or self-overlapping view"
        )


def check_no_overlap(written: Tensor, w_arg: str, read: Tensor | None, r_arg: str,
                     in_place: bool = False) -> None:
    """`written` (an output) must not share memory with `read` (an input);
    `in_place` allows the very same view (kernels that read a row before writing it)."""
    if read is None or not isinstance(read, Tensor) or not _addressable(written, read):
        return
    if in_place and _same_view(written, read):
        return
    if may_overlap(written, read):
        alias = " or exactly the same view" if in_place else ""
        raise ValueError(
            f"{w_arg} and {r_arg}: share memory (the op writes {w_arg} while it reads {r_arg}); "
            f"expected separate memory{alias}"
        )


def _int_tensor(t, arg: str, ndim: int, dtypes=(torch.int32,)) -> Tensor:
    t = _tensor(t, arg)
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{arg}: expected dtype {names}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{arg}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    return t


def _check_cache_layout(cache, arg: str) -> Tensor:
    cache = _tensor(cache, arg)
    if cache.dim() != 3:
        raise ValueError(f"{arg}: expected a 3-D [num_blocks, block_size, entry] tensor, got shape {tuple(cache.shape)}")
    if cache.size(2) > 1 and cache.stride(2) != 1:
        raise ValueError(f"{arg}: the last dim must be contiguous (stride 1), got strides {cache.stride()}")
    if cache.stride(0) < 0 or cache.stride(1) < 0:
        raise ValueError(f"{arg}: negative strides are not supported, got {cache.stride()}")
    if cache.size(1) < 1:
        raise ValueError(f"{arg}: block_size (dim 1) must be >= 1, got {cache.size(1)}")
    return cache


def check_cache_dtype(cache: Tensor, fmt: CacheFormat, arg: str = "kv_cache", typed: bool = True) -> None:
    """The cache's element type for `fmt` (no data read). A native format takes a bf16/fp16/fp32
    cache (the format's own dtype where its name gives one); a quantized format takes bytes:
    uint8, or (`typed`) the float8 type the format stores (fp8 -> float8_e4m3fn, fp8_e5m2 ->
    float8_e5m2). A float8 cache of the other type is refused naming kv_cache_dtype and the
    cache's dtype: its bytes would decode as the other format. (vLLM's layer views every fp8
    cache as float8_e4m3fn; mla_ext.vllm._custom_ops passes such caches as uint8 bytes, where
    the format string decides, as in vLLM.)"""
    if fmt.quant_mode == QuantMode.NONE:
        if cache.dtype not in NATIVE_DTYPES:
            raise ValueError(
                f"{arg}: kv_cache_dtype {fmt.name!r} needs a bf16/fp16/fp32 cache, got {cache.dtype}"
            )
        want = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(fmt.storage)
        if want is not None and cache.dtype != want:
            raise ValueError(f"{arg}: kv_cache_dtype {fmt.name!r} needs a {want} cache, got {cache.dtype}")
        return
    typed_dtype = fmt.fp8_dtype if typed else None
    if cache.dtype != torch.uint8 and (typed_dtype is None or cache.dtype != typed_dtype):
        also = f" or {typed_dtype}" if typed_dtype is not None else ""
        raise ValueError(f"{arg}: kv_cache_dtype {fmt.name!r} needs a torch.uint8{also} cache, got {cache.dtype}")


def check_cache(cache, fmt: CacheFormat, arg: str = "kv_cache") -> tuple[int, int, int]:
    """A `[num_blocks, B, entry]` cache of `fmt`; returns (num_blocks, B, entry).

    The last dim must be contiguous; block and entry strides are free (a cache
    may be a view into a larger buffer) but must be non-negative.
    """
    cache = _check_cache_layout(cache, arg)
    check_cache_dtype(cache, fmt, arg, typed=fmt.quant_mode == QuantMode.FP8_PER_TENSOR)
    if fmt.quant_mode != QuantMode.NONE:
        fixed = fmt.fixed_entry_bytes  # fp8_ds_mla 656, nvfp4_ds_mla 352
        if fixed is not None and cache.size(2) != fixed:
            raise ValueError(
                f"{arg}: {fmt.name} entries are {fixed} bytes, got last dim {cache.size(2)}"
            )
    return cache.size(0), cache.size(1), cache.size(2)


def check_k_scale(k_scale, fmt: CacheFormat, device: torch.device) -> None:
    """A per-tensor format needs a float32 scale with one element on the cache's device.

    Other formats ignore the scale, but a tensor given for it must still be on
    the cache's device (every tensor argument of a compiled op is on one device).
    """
    if fmt.quant_mode != QuantMode.FP8_PER_TENSOR:
        if not isinstance(k_scale, Tensor):  # the compiled op's schema takes a Tensor for every format
            raise ValueError(f"k_scale: expected a float32 tensor [1] (the op takes one even where the format "
                             f"ignores its value), got {type(k_scale).__name__}")
        if k_scale.device != device:
            raise ValueError(f"k_scale: expected a tensor on {device} (the cache's device), got {k_scale.device}")
        return
    k_scale = _tensor(k_scale, "k_scale")
    if k_scale.dtype != torch.float32 or k_scale.numel() != 1:
        raise ValueError(
            f"k_scale: expected a float32 tensor with 1 element, got {k_scale.dtype} of shape {tuple(k_scale.shape)}"
        )
    if k_scale.device != device:
        raise ValueError(f"k_scale: expected a tensor on {device} (the cache's device), got {k_scale.device}")


def check_scale_value(k_scale: Tensor) -> None:
    """Reads the scale (a host sync on CUDA): must be finite and > 0."""
    v = float(k_scale.reshape(-1)[0])
    if not (v > 0.0 and v != float("inf")):
        raise ValueError(f"k_scale: expected a finite value > 0, got {v}")


def validate_write_args(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> CacheFormat:
    fmt = get_format(kv_cache_dtype)
    kv_c, k_pe = _tensor(kv_c, "kv_c"), _tensor(k_pe, "k_pe")
    _, _, entry = check_cache(kv_cache, fmt)
    if kv_c.dim() != 2 or k_pe.dim() != 2:
        raise ValueError(
            f"kv_c, k_pe: expected 2-D [T, L] and [T, R] tensors, got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}"
        )
    T, L = kv_c.shape
    R = k_pe.size(1)
    if k_pe.size(0) != T:
        raise ValueError(f"k_pe: expected {T} rows (as kv_c), got {k_pe.size(0)}")
    for t, name in ((kv_c, "kv_c"), (k_pe, "k_pe")):
        if t.dtype not in NATIVE_DTYPES:
            raise ValueError(f"{name}: expected bf16/fp16/fp32, got {t.dtype}")
        if t.size(1) > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")
        _same_device(t, kv_cache, name, "kv_cache")
    if k_pe.dtype != kv_c.dtype:
        raise ValueError(f"k_pe: expected dtype {kv_c.dtype} (as kv_c), got {k_pe.dtype}")
    fmt.check_dims(L, R)
    if fmt.quant_mode == QuantMode.NONE and kv_c.dtype != kv_cache.dtype:
        raise ValueError(f"kv_c: a native {kv_cache.dtype} cache takes {kv_cache.dtype} inputs, got {kv_c.dtype}")
    want = fmt.entry_elems(L, R)
    if entry != want:
        raise ValueError(f"kv_cache: expected entry width {want} for L={L}, R={R}, format {fmt.name!r}; got {entry}")
    slot_mapping = _int_tensor(slot_mapping, "slot_mapping", 1, (torch.int64, torch.int32))
    if slot_mapping.numel() != T:
        raise ValueError(f"slot_mapping: expected {T} entries (one per token), got {slot_mapping.numel()}")
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping: expected a contiguous tensor")
    _same_device(slot_mapping, kv_cache, "slot_mapping", "kv_cache")
    check_k_scale(k_scale, fmt, kv_cache.device)
    check_no_internal_overlap(kv_cache, "kv_cache")
    for t, name in ((kv_c, "kv_c"), (k_pe, "k_pe"), (slot_mapping, "slot_mapping"), (k_scale, "k_scale")):
        check_no_overlap(kv_cache, "kv_cache", t, name)
    return fmt


def check_slots(slot_mapping: Tensor, num_slots: int) -> None:
    """Reads slot_mapping (host sync): every slot is -1 (skip) or in [0, num_slots)."""
    s = slot_mapping.to("cpu", torch.int64)
    bad = ((s < -1) | (s >= num_slots)).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise ValueError(
            f"slot_mapping: token {t} has slot {int(s[t])}, outside [0, {num_slots}) (and not -1)"
        )


def _check_gather_index_args(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts) -> None:
    block_table = _int_tensor(block_table, "block_table", 2)
    cu_seq_lens = _int_tensor(cu_seq_lens, "cu_seq_lens", 1)
    if not isinstance(num_reqs, int) or isinstance(num_reqs, bool):
        raise ValueError(f"num_reqs: expected an int, got {type(num_reqs).__name__}")
    if num_reqs < 0 or num_reqs > cu_seq_lens.numel() - 1:
        raise ValueError(
            f"num_reqs: expected 0 <= num_reqs <= cu_seq_lens.numel() - 1 = {cu_seq_lens.numel() - 1}, got {num_reqs}"
        )
    if num_reqs > block_table.size(0):
        raise ValueError(f"block_table: expected at least num_reqs={num_reqs} rows, got {block_table.size(0)}")
    if block_table.size(1) > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table: the last dim must be contiguous (stride 1), got strides {block_table.stride()}")
    if cu_seq_lens.numel() > 1 and cu_seq_lens.stride(0) != 1:
        raise ValueError("cu_seq_lens: expected a contiguous tensor")
    for t, name in ((block_table, "block_table"), (cu_seq_lens, "cu_seq_lens")):
        _same_device(t, src_cache, name, "src_cache")
    if seq_starts is not None:
        seq_starts = _int_tensor(seq_starts, "seq_starts", 1)
        if seq_starts.numel() < num_reqs:
            raise ValueError(f"seq_starts: expected at least num_reqs={num_reqs} entries, got {seq_starts.numel()}")
        if seq_starts.numel() > 1 and seq_starts.stride(0) != 1:
            raise ValueError("seq_starts: expected a contiguous tensor")
        _same_device(seq_starts, src_cache, "seq_starts", "src_cache")
    dst = _tensor(dst, "dst")
    if dst.dim() != 2:
        raise ValueError(f"dst: expected a 2-D [T, E] tensor, got shape {tuple(dst.shape)}")
    if dst.size(1) > 1 and dst.stride(1) != 1:
        raise ValueError(f"dst: the last dim must be contiguous (stride 1), got strides {dst.stride()}")
    if dst.stride(0) < 0:
        raise ValueError(f"dst: negative strides are not supported, got {dst.stride()}")
    _same_device(dst, src_cache, "dst", "src_cache")
    check_no_internal_overlap(dst, "dst")
    for t, name in ((src_cache, "src_cache"), (block_table, "block_table"), (cu_seq_lens, "cu_seq_lens"),
                    (seq_starts, "seq_starts")):
        check_no_overlap(dst, "dst", t, name)


def validate_gather_args(
    src_cache, dst, block_table, cu_seq_lens, num_reqs, kv_cache_dtype, k_scale, seq_starts=None
) -> GatherInfo:
    """Checks of gather_and_maybe_dequant_cache; no data is read."""
    fmt = get_format(kv_cache_dtype)
    num_blocks, B, entry = check_cache(src_cache, fmt, "src_cache")
    _check_gather_index_args(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts)
    width = dst.size(1)
    raw = dst.dtype == src_cache.dtype
    if fmt.quant_mode == QuantMode.NONE and not raw:
        raise ValueError(
            f"dst: a native {src_cache.dtype} cache ({fmt.name!r}) can only be gathered into "
            f"{src_cache.dtype}, got {dst.dtype}"
        )
    if not raw and dst.dtype not in DEQUANT_DST_DTYPES:
        raise ValueError(
            f"dst: expected bf16/fp16/fp32 (dequantized) or {src_cache.dtype} (raw bytes), got {dst.dtype}"
        )
    widths = None if raw else fmt.dequant_widths()  # fixed-layout formats
    if widths is None:
        if width != entry:
            raise ValueError(f"dst: expected {entry} columns (the cache entry width), got {width}")
    elif width not in widths:
        if fmt.quant_mode == QuantMode.FP8_PER_TILE:
            raise ValueError(
                f"dst: fp8_ds_mla dequantizes to {widths[0]} (R=64) or {widths[1]} (R=0) columns, got {width}"
            )
        raise ValueError(f"dst: {fmt.name} dequantizes to {widths[0]} columns, got {width}")
    check_k_scale(k_scale, fmt if not raw else get_format("auto"), src_cache.device)
    check_no_overlap(dst, "dst", k_scale, "k_scale")
    return GatherInfo(fmt, raw, num_blocks, B, entry, width)


def validate_cp_gather_args(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts=None) -> GatherInfo:
    """Checks of cp_gather_cache (raw bytes: dst has the cache's dtype and entry width)."""
    src_cache = _check_cache_layout(src_cache, "src_cache")
    _check_gather_index_args(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts)
    if dst.dtype != src_cache.dtype:
        raise ValueError(
            f"dst: cp_gather_cache copies raw bytes, so dst must have the cache's dtype {src_cache.dtype}, got {dst.dtype}"
        )
    if dst.size(1) != src_cache.size(2):
        raise ValueError(f"dst: expected {src_cache.size(2)} columns (the cache entry width), got {dst.size(1)}")
    fmt = get_format("auto")
    return GatherInfo(fmt, True, src_cache.size(0), src_cache.size(1), src_cache.size(2), dst.size(1))


def _first(mask: Tensor) -> int | None:
    """Index of the first True of a 1-D mask, or None."""
    hit = mask.nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def check_offsets(
    cu_seq_lens: Tensor, num_reqs: int, seq_starts: Tensor | None = None, dst_rows: int | None = None, *,
    arg: str = "cu_seq_lens", dst_arg: str = "dst",
) -> tuple[Tensor, Tensor, Tensor]:
    """Reads the offsets (host sync) and raises naming the argument and the first bad request.

    `cu_seq_lens[:num_reqs + 1]` (called `arg`) are row offsets into `dst_arg`: they start at
    >= 0, never decrease, and (with `dst_rows`) no request ends past dst's rows; `seq_starts`
    (a request's first token) are >= 0 for every request with rows. Vectorized (one pass, no
    per-request Python loop). Returns int64 CPU (cu, lens, starts) for the callers' table checks.
    Callers on CUDA tensors skip this (it would sync): there the kernels bound every read.
    """
    cu = cu_seq_lens.to("cpu", torch.int64)[: num_reqs + 1]
    lens = cu[1:] - cu[:-1]
    starts = (seq_starts.to("cpu", torch.int64)[:num_reqs] if seq_starts is not None
              else torch.zeros(num_reqs, dtype=torch.int64))
    if num_reqs and int(cu[0]) < 0:
        raise ValueError(f"{arg}: entry 0 is {int(cu[0])}, expected >= 0")
    r = _first(lens < 0)
    if r is not None:
        raise ValueError(f"{arg}: request {r} has a negative length ({int(cu[r])} -> {int(cu[r + 1])}); "
                         "expected non-decreasing offsets")
    if dst_rows is not None and num_reqs:
        r = _first(cu[1:] > dst_rows)
        if r is not None:
            raise ValueError(f"{arg}: request {r} ends at row {int(cu[r + 1])} but {dst_arg} has {dst_rows} rows")
    r = _first((starts < 0) & (lens > 0))
    if r is not None:
        raise ValueError(f"seq_starts: request {r} starts at {int(starts[r])}, expected >= 0")
    return cu, lens, starts


def check_row_starts(starts: Tensor, count: int, dst_rows: int, arg: str, dst_arg: str = "dst") -> None:
    """Reads `starts[:count]` (host sync): where each request's rows begin in `dst_arg`, the
    last request running to its end (vLLM's workspace_starts). Each is >= 0, none decreases,
    none is past dst's `dst_rows` rows; the error names `arg` and the first bad request."""
    s = starts.to("cpu", torch.int64)[:count]
    r = _first(s < 0)
    if r is not None:
        raise ValueError(f"{arg}: request {r} starts at row {int(s[r])}, expected >= 0")
    r = _first(s[1:] < s[:-1])
    if r is not None:
        raise ValueError(f"{arg}: request {r + 1} starts at row {int(s[r + 1])}, before request {r} "
                         f"(row {int(s[r])}); expected non-decreasing offsets")
    r = _first(s > dst_rows)
    if r is not None:
        raise ValueError(f"{arg}: request {r} starts at row {int(s[r])}, past the {dst_rows} rows of {dst_arg}")


def check_block_ids(
    block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int, seq_starts: Tensor | None,
    num_blocks: int, block_size: int, dst_rows: int | None = None, *, arg: str = "cu_seq_lens",
    dst_arg: str = "dst",
) -> int:
    """Reads the index tensors (host sync) and raises naming the first bad request and block.

    Checks: the offsets (check_offsets: cu_seq_lens starts at >= 0 and never decreases, no
    request ends past `dst_rows`, seq_starts are >= 0), every logical block a request touches
    is inside the table width, and its physical block id is in [0, num_blocks). Returns the
    rows the requests fill (cu_seq_lens[num_reqs], 0 without requests).
    """
    cu, lens, starts = check_offsets(cu_seq_lens, num_reqs, seq_starts, dst_rows, arg=arg, dst_arg=dst_arg)
    if block_table.dim() != 2 or block_table.size(0) < num_reqs:
        raise ValueError(f"block_table: expected [>= {num_reqs}, max_blocks], got {tuple(block_table.shape)}")
    width = block_table.size(1)
    live = lens > 0
    first, last = starts // block_size, (starts + lens - 1) // block_size
    r = _first(live & (last >= width))
    if r is not None:
        s, n = int(starts[r]), int(lens[r])
        raise ValueError(
            f"block_table: request {r} needs logical block {int(last[r])} (tokens {s}..{s + n - 1}, "
            f"block_size {block_size}) but the table has {width} columns"
        )
    cols = torch.arange(width)
    used = live[:, None] & (cols >= first[:, None]) & (cols <= last[:, None])
    ids = block_table[:num_reqs].to("cpu", torch.int64)
    bad = (((ids < 0) | (ids >= num_blocks)) & used).nonzero()  # row-major: the first request, then block
    if bad.numel():
        r, j = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(
            f"block_table: request {r}, logical block {j} holds block id {int(ids[r, j])}, "
            f"outside [0, {num_blocks})"
        )
    return int(cu[-1]) if num_reqs else 0
