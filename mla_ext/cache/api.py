"""Public paged latent cache ops (SPEC §2, §6) over the backend dispatcher.

Ops (argument order as the upstream engine's ops of the same names, with one
difference: upstream gather_and_maybe_dequant_cache takes `token_to_seq,
num_tokens` after cu_seq_lens (and ignores token_to_seq); here that slot is
`num_reqs`, so an upstream-style positional call fails with a ValueError
instead of running. concat_and_cache_mla has no trailing `skip_scale`.):
  concat_and_cache_mla            write new tokens into the cache
  gather_and_maybe_dequant_cache  gather context rows into dst, dequantizing
  cp_gather_cache                 gather raw bytes (fp8 passthrough, context parallel)
  compute_kv_scale                per-tensor K scale from the data

Backends, in priority order (each states why it cannot serve an input;
`explain(...)` and `backend_report()` show the choice; `GATHER.force(name)` or
MLA_EXT_FORCE_GATHER=<name> forces one):
  gathers   "cuda_paged" (csrc/cache/gather_paged.cu: a window of rows per
            CTA, mapped once, streamed in 16-byte units), "cpu"
            (csrc/cache/cache_cpu.cpp), "triton_paged"
            (mla_ext/cache/triton_gather.py);
  write     "cuda_vector" (csrc/cache/write.cu: 16-byte loads, 8/16-byte
            stores), "cpu", "triton" (mla_ext/cache/triton_write.py,
            bit-identical to "cpu": serves a GPU the library holds no binary for);
  kv scale  "cuda_vector", "cpu", "triton".

Out-of-range policy (every backend; see csrc/cache/cache_kernels.h):
  * gather: a row whose token lies in a logical block past the block table's
    width, or whose block id is outside [0, num_blocks), is written as ZERO and
    nothing is read for it. Rows of dst outside [cu_seq_lens[0],
    cu_seq_lens[num_reqs]) are untouched; no row past dst.size(0) is written.
  * write: tokens whose slot is negative (-1 = padding) or >= num_blocks *
    block_size are skipped.
  * `validate=True` reads the index tensors on the host (a sync; not for CUDA
    graphs) and raises ValueError naming the request and the block (or the
    token and the slot, or the request whose rows end past dst) instead.
  * k_scale must be finite and > 0: checked whenever it is on the CPU (free),
    and on a GPU only with validate=True (reading it there would sync). An
    unchecked invalid device scale gives NaN (every dequantized value of a
    gather, every stored value of a write), never plausible rows. k_scale is
    on the cache's device even for formats that ignore it.
  * Outputs never share memory with inputs: dst (kv_cache for a write) may
    not overlap the cache, the index tensors or k_scale, nor itself (an
    expand()ed dst); a ValueError names both arguments.
  * num_reqs may be smaller than cu_seq_lens.numel() - 1 (extra entries are
    ignored) but never larger; block_table needs >= num_reqs rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from mla_ext._args import as_device
from mla_ext import _ext
from mla_ext.cache import checks
from mla_ext.dispatch import Backend, Dispatcher
from mla_ext.config.formats import QuantMode, get_format


@dataclass(frozen=True)
class GatherInputs:
    src_cache: Tensor
    dst: Tensor
    block_table: Tensor
    cu_seq_lens: Tensor
    num_reqs: int
    kv_cache_dtype: str | None  # None: cp_gather_cache (raw bytes)
    k_scale: Tensor | None
    seq_starts: Tensor | None

    @property
    def device(self) -> torch.device:
        return self.src_cache.device


@dataclass(frozen=True)
class TensorInputs:
    """Inputs of the write / kv-scale ops (only the device matters for the choice)."""

    args: tuple

    @property
    def device(self) -> torch.device:
        return self.args[0].device


# -- backend reasons ---------------------------------------------------------

def _ext_reasons() -> list[str]:
    return [] if _ext.available() else [str(_ext.load_error())]


def _cuda_reasons(inp) -> list[str]:
    why = _ext_reasons()
    if why:
        return why
    if inp.device.type != "cuda":
        return [f"tensors are on {inp.device}, not CUDA"]
    ok, reason = _ext.cuda_kernels_usable(inp.device)
    return [] if ok else [reason]


def _cpu_reasons(inp) -> list[str]:
    why = _ext_reasons()
    if inp.device.type != "cpu":
        why.append(f"tensors are on {inp.device}, not the CPU")
    return why


def _raw_format_name(cache: Tensor) -> str:
    """A format whose raw (same-dtype) gather the Triton kernel accepts for this cache."""
    if cache.dtype == torch.float8_e5m2:
        return "fp8_e5m2"
    return "fp8" if cache.element_size() == 1 else "auto"


def _triton_reasons(inp: GatherInputs) -> list[str]:
    try:
        from mla_ext.cache import triton_gather
    except ImportError as exc:  # the module or triton itself is missing
        return [f"the Triton gather cannot be imported ({exc})"]
    name = inp.kv_cache_dtype if inp.kv_cache_dtype is not None else _raw_format_name(inp.src_cache)
    return triton_gather.triton_not_supported_reasons(inp.src_cache, inp.dst, name)


def _run_triton(inp: GatherInputs) -> None:
    from mla_ext.cache import triton_gather

    name = inp.kv_cache_dtype if inp.kv_cache_dtype is not None else _raw_format_name(inp.src_cache)
    triton_gather.gather_triton(
        inp.src_cache, inp.dst, inp.block_table, inp.cu_seq_lens, inp.num_reqs, name,
        inp.k_scale, inp.seq_starts,
    )


def _run_compiled_gather(inp: GatherInputs) -> None:
    ops = _ext.ops()
    if inp.kv_cache_dtype is None:
        ops.cp_gather_cache(inp.src_cache, inp.dst, inp.block_table, inp.cu_seq_lens, inp.num_reqs,
                            inp.seq_starts)
    else:
        ops.gather_and_maybe_dequant_cache(
            inp.src_cache, inp.dst, inp.block_table, inp.cu_seq_lens, inp.num_reqs,
            inp.kv_cache_dtype, inp.k_scale, inp.seq_starts,
        )


def _triton_write_reasons(op: str, inp: TensorInputs) -> list[str]:
    """The Triton writer / KV-scale kernel (mla_ext/cache/triton_write.py): serves a GPU
    whose CUDA kernels are not in the library (and the CPU under the interpreter)."""
    try:
        from mla_ext.cache import triton_write
    except ImportError as exc:  # the module or triton itself is missing
        return [f"the Triton writer cannot be imported ({exc})"]
    if op == "write":
        return triton_write.write_not_supported_reasons(inp.args)
    return triton_write.kv_scale_not_supported_reasons(inp.args)


def _run_triton_write(op: str, inp: TensorInputs):
    from mla_ext.cache import triton_write

    if op == "write":
        return triton_write.write_triton(*inp.args)
    return triton_write.kv_scale_triton(*inp.args)


def _run_write(inp: TensorInputs) -> None:
    _ext.ops().concat_and_cache_mla(*inp.args)


def _run_kv_scale(inp: TensorInputs) -> Tensor:
    return _ext.ops().compute_kv_scale(*inp.args)


# CUDA, then CPU, then Triton: on CPU tensors Triton only runs under its (slow)
# interpreter, which tests reach with GATHER.force("triton_paged"); on a GPU the
# CPU backend refuses and Triton serves when the CUDA kernels cannot.
GATHER = Dispatcher("gather", [
    Backend("cuda_paged", _cuda_reasons, _run_compiled_gather),
    Backend("cpu", _cpu_reasons, _run_compiled_gather),
    Backend("triton_paged", _triton_reasons, _run_triton),
])
WRITE = Dispatcher("write", [
    Backend("cuda_vector", _cuda_reasons, _run_write),
    Backend("cpu", _cpu_reasons, _run_write),
    Backend("triton", partial(_triton_write_reasons, "write"), partial(_run_triton_write, "write")),
])
KV_SCALE = Dispatcher("kv_scale", [
    Backend("cuda_vector", _cuda_reasons, _run_kv_scale),
    Backend("cpu", _cpu_reasons, _run_kv_scale),
    Backend("triton", partial(_triton_write_reasons, "kv_scale"), partial(_run_triton_write, "kv_scale")),
])


# -- public ops --------------------------------------------------------------

def _check_scale(k_scale: Tensor, fmt, validate: bool) -> None:
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR and (validate or k_scale.device.type == "cpu"):
        checks.check_scale_value(k_scale)


def concat_and_cache_mla(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, kv_cache_dtype: str,
    k_scale: Tensor, *, validate: bool = False,
) -> None:
    """Writes token t of (kv_c [T, L], k_pe [T, R]) into kv_cache at slot_mapping[t].

    Slot -1 (padding) is skipped. fp8/fp8_e4m3/fp8_e5m2 store saturate(x / k_scale);
    fp8_ds_mla stores power-of-two tile scales and bf16 k_pe (SPEC §2);
    nvfp4_ds_mla (L=512, R=64 only) stores e2m1 latents with one e4m3 scale per
    16 values and e4m3 k_pe (layout and rounding: formats.Nvfp4DsMla); native
    formats copy (kv_c must have the cache's dtype). See the module docstring
    for the out-of-range policy and `validate`.
    """
    fmt = checks.validate_write_args(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
    _check_scale(k_scale, fmt, validate)
    if validate:
        checks.check_slots(slot_mapping, kv_cache.size(0) * kv_cache.size(1))
    WRITE(TensorInputs((kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)))


def _validate_gather_ids(info, dst, block_table, cu_seq_lens, num_reqs, seq_starts) -> None:
    checks.check_block_ids(block_table, cu_seq_lens, num_reqs, seq_starts, info.num_blocks, info.block_size,
                           dst_rows=dst.size(0))


def gather_and_maybe_dequant_cache(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int,
    kv_cache_dtype: str, k_scale: Tensor, seq_starts: Tensor | None = None, *,
    validate: bool = False, chosen=None,
) -> Tensor:
    """dst[cu_seq_lens[r] + i] = dequant(cached token seq_starts[r] + i of request r); returns dst.

    dst is bf16/fp16/fp32 (dequantized), or the cache's own dtype (native copy,
    fp8 raw passthrough). A native cache gathered into another dtype raises.
    fp8_ds_mla dequantizes to 576 (R=64) or 512 (R=0) columns, nvfp4_ds_mla to
    576 (every value exact in bf16/fp16/fp32). Any seq_starts
    alignment, arbitrary block/entry strides. Never syncs the host unless
    validate=True. `chosen` (mla_ext.dispatch.Chosen): a call site resolved once (MLAPrefill).
    """
    info = checks.validate_gather_args(
        src_cache, dst, block_table, cu_seq_lens, num_reqs, kv_cache_dtype, k_scale, seq_starts
    )
    if not info.raw:
        _check_scale(k_scale, info.fmt, validate)
    if validate:
        _validate_gather_ids(info, dst, block_table, cu_seq_lens, num_reqs, seq_starts)
    GATHER.run(GatherInputs(src_cache, dst, block_table, cu_seq_lens, num_reqs, kv_cache_dtype, k_scale,
                            seq_starts), chosen)
    return dst


def cp_gather_cache(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int,
    seq_starts: Tensor | None = None, *, validate: bool = False,
) -> Tensor:
    """Raw gather: the rows of gather_and_maybe_dequant_cache, bytes unchanged; returns dst."""
    info = checks.validate_cp_gather_args(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts)
    if validate:
        _validate_gather_ids(info, dst, block_table, cu_seq_lens, num_reqs, seq_starts)
    GATHER(GatherInputs(src_cache, dst, block_table, cu_seq_lens, num_reqs, None, None, seq_starts))
    return dst


def compute_kv_scale(kv_c: Tensor, k_pe: Tensor, kv_cache_dtype: str) -> Tensor:
    """Per-tensor K scale [1] float32 = max(amax(|kv_c|, |k_pe|) / fp8 max, 1e-12).

    Non-finite values are ignored, so the scale is always finite and > 0.
    fp8_ds_mla and nvfp4_ds_mla have no per-tensor scale (their scales live in
    the rows): 1.0.
    Native formats raise ValueError: a skipped / unquantized layer computes none.
    """
    fmt = get_format(kv_cache_dtype)
    if fmt.quant_mode == QuantMode.NONE:
        raise ValueError(
            f"kv_cache_dtype: layer is not quantized ({fmt.name!r}); it computes no KV scale"
        )
    for t, name in ((kv_c, "kv_c"), (k_pe, "k_pe")):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype not in checks.NATIVE_DTYPES:
            raise ValueError(f"{name}: expected a 2-D bf16/fp16/fp32 tensor")
    if k_pe.dtype != kv_c.dtype or k_pe.size(0) != kv_c.size(0) or k_pe.device != kv_c.device:
        raise ValueError(
            f"k_pe: expected {kv_c.size(0)} rows of {kv_c.dtype} on {kv_c.device} (as kv_c), got "
            f"{k_pe.size(0)} rows of {k_pe.dtype} on {k_pe.device}"
        )
    return KV_SCALE(TensorInputs((kv_c, k_pe, kv_cache_dtype)))


# -- introspection -----------------------------------------------------------

def _probe_inputs(device: torch.device) -> dict[str, object]:
    """Tiny representative inputs per op on `device` (fp8 cache, bf16 dst)."""
    cache = torch.zeros(2, 16, 576, dtype=torch.uint8, device=device)
    dst = torch.zeros(16, 576, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    kv_c = torch.zeros(1, 512, dtype=torch.bfloat16, device=device)
    k_pe = torch.zeros(1, 64, dtype=torch.bfloat16, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    return {
        "gather": (GATHER, GatherInputs(cache, dst, bt, cu, 1, "fp8", scale, None)),
        "cp_gather": (GATHER, GatherInputs(cache, torch.zeros_like(cache[0]), bt, cu, 1, None, None, None)),
        "write": (WRITE, TensorInputs((kv_c, k_pe, cache, slots, "fp8", scale))),
        "kv_scale": (KV_SCALE, TensorInputs((kv_c, k_pe, "fp8"))),
    }


def backend_report(device: str | torch.device | None = None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for probe inputs on `device` (default: CUDA if visible, else CPU).

    An empty reasons list means the backend can serve the op there.
    """
    dev = as_device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    out = []
    for op, (disp, inp) in _probe_inputs(dev).items():
        for b in disp.backends:
            out.append((op, b.name, b.not_supported_reasons(inp)))
    return out


def explain(op: str, inputs) -> str:
    """Which backend serves `inputs` for op 'gather' | 'write' | 'kv_scale', and why not the others."""
    dispatchers = {"gather": GATHER, "cp_gather": GATHER, "write": WRITE, "kv_scale": KV_SCALE}
    if op not in dispatchers:
        raise ValueError(f"op: unknown {op!r}; expected one of {', '.join(dispatchers)}")
    want = GatherInputs if op in ("gather", "cp_gather") else TensorInputs
    ok = isinstance(inputs, want)
    if ok and want is TensorInputs:
        ok = bool(inputs.args) and isinstance(inputs.args[0], Tensor)
    if not ok:
        raise ValueError(f"inputs: expected a {want.__name__} for op {op!r} (the inputs its backends "
                         f"decide on), got {type(inputs).__name__}")
    text = dispatchers[op].explain(inputs)
    if inputs.device.type == "cuda":  # which SASS binary or PTX the CUDA backends would run
        text += "\n  " + _ext.cuda_target_note(inputs.device)
    return text
