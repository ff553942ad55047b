"""vLLM 0.33's ``vllm/_custom_ops.py`` signatures over mla_ext's kernels.

Swap ``from vllm import _custom_ops as ops`` for ``from mla_ext.vllm import
_custom_ops as ops`` and the MLA prefill-with-context calls run unchanged:
same names, argument order, keyword names and defaults; outputs written in
place; every op returns None. Each op is a torch op in the ``mla_ext_vllm``
namespace (``torch.ops.mla_ext_vllm.<name>``) with a fake kernel, so
``torch.compile(fullgraph=True)`` traces through it. Behind each op is the
native API (mla_ext.cache.api / mla_ext.attention.api) and so its backends:
C++ CPU, CUDA, Triton (forced with ``GATHER.force("triton_paged")`` /
``MERGE.force("triton")`` or MLA_EXT_FORCE_GATHER / MLA_EXT_FORCE_MERGE).

Errors are ValueErrors naming the argument and the expected value. The checks
of this file read shapes, dtypes and devices only (they run in the fake
kernels too); the native API then checks the rest.

Ops and how each vLLM feature is backed
---------------------------------------
concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale=False)
    The native write. ``skip_scale=True``: the fp8 writer stores saturate(x)
    (scale treated as 1), as in vLLM; a unit scale tensor is passed instead.

gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq,
                               num_tokens, kv_cache_dtype, scale, seq_starts=None)
    The native gather with num_reqs = len(cu_seq_lens) - 1. Like vLLM 0.33's
    CUDA kernel it works from cu_seq_lens: ``token_to_seq`` is checked for
    shape only (1-D int32, >= num_tokens entries, dst's device) and never read;
    ``num_tokens`` must lie in [0, dst.size(0)]. dst width must be 320, 512 or
    576 (vLLM's rule; the native API takes any entry width). Beyond vLLM, the
    fp8_ds_mla format is accepted here too (dequantized to 576 or 512 columns).

cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None)
    The native raw gather; ``batch_size`` must equal len(cu_seq_lens) - 1. A
    uint8 cache may be gathered into a float8 dst (or the reverse): raw bytes,
    done through a view of dst (no copy).

cp_gather_and_upconvert_fp8_kv_cache(src_cache, dst, block_table, workspace_starts, batch_size,
                                     seq_starts=None, host_cache=None, host_row_ids=None,
                                     device_row_ids=None)
    The native fp8_ds_mla gather into bf16 [tokens, 576]. ``workspace_starts``
    [>= batch_size] gives where each request's rows start in dst; as in vLLM's
    kernel only the first batch_size entries are read (vLLM itself passes the
    chunk's cu_seq_lens, R + 1 entries, with batch_size = R) and the last
    request runs to dst's last row (pass the chunk's rows, workspace[:toks]).
    Extra work: one tiny device tensor, cu_seq_lens = workspace_starts + [dst
    rows] (a cat, no host sync). On CPU tensors workspace_starts (negative,
    decreasing, past dst) and seq_starts (negative) are checked, naming them;
    on CUDA they are not read (no sync) and the kernel bounds every row. The host-cache arguments (vLLM's rows of an
    offloaded cache) are not supported: anything but None is refused.

cp_gather_and_upconvert_nvfp4_kv_cache(src_cache, dst, block_table, workspace_starts, batch_size)
    Defined exactly when mla_ext.config.formats has nvfp4_ds_mla (352-byte rows): the
    native nvfp4_ds_mla gather into bf16 [tokens, 576], rows as above. vLLM's
    signature has no seq_starts: every request is gathered from its token 0.
    vLLM runs it on SM100 only; here on every backend of the native gather.

merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                  prefill_tokens_with_context=None, output_scale=None)
    The native merge, in place into output / output_lse. Composed where the
    native op has no such feature:
      * ``prefill_tokens_with_context = p``: the native merge runs on the first
        p tokens (views, no copy); tokens p.. copy suffix_output (and
        suffix_lse into output_lse) — the copy vLLM also makes.
      * ``output_scale`` (fp32, one element): output is float8_e4m3fn and gets
        saturate(merged / output_scale). The merge goes into a temporary of the
        inputs' dtype (one [p, N, D] buffer), then one pass divides, saturates
        and casts. For bf16/fp16 inputs the value is rounded to that dtype
        first, so a result can differ from a one-rounding fp32 kernel by one
        e4m3 step at a rounding tie.
    Both sides empty (LSE -inf): output 0 and output_lse -inf (SPEC §7, as
    vLLM's Triton and torch paths); vLLM's CUDA kernel copies prefix_output
    there instead.

Offsets on CPU tensors (cu_seq_lens, seq_starts, workspace_starts) are read and a
negative, decreasing or past-dst one is refused naming it; on CUDA they are not read
(no host sync) and the kernels bound every row.

Where the surface differs from vLLM 0.33 (also in docs/vllm.md):
  * gather rows whose token lies past the block table's width, or whose block
    id is out of [0, num_blocks), are written as zeros (mla_ext's defined
    out-of-range result, no read); vLLM leaves rows past the table untouched.
    A block table that covers every request (any correct call) has no such row.
  * the both-empty merge above.
  * the fp8 output of merge_attn_states is float8_e4m3fn (no ROCm fnuz).
"""
import math
from typing import Optional

import torch
from torch import Tensor

from mla_ext.config import formats
from mla_ext._fake import _one_device
from mla_ext.attention import api as attn_api
from mla_ext.cache import api as cache_api
from mla_ext.cache import checks as cache_checks
from mla_ext.cache.checks import check_no_internal_overlap, check_no_overlap
from mla_ext.config.formats import DsMla, E4M3_MAX

NAMESPACE = "mla_ext_vllm"
# vLLM 0.33's gather_and_maybe_dequant_cache takes these dst widths only.
GATHER_DST_WIDTHS = (320, 512, 576)
UPCONVERT_DST_WIDTH = DsMla.LATENT_DIM + DsMla.ROPE_DIM  # 576
FP8_OUTPUT_DTYPE = torch.float8_e4m3fn


# -- argument checks (shapes, dtypes, devices only: shared with the fakes) -----

def _check(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _tensor(t, name: str, ndim: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    _check(isinstance(t, Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        _check(t.dim() == ndim, f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if dtype is not None:
        _check(t.dtype == dtype, f"{name}: expected dtype {dtype}, got {t.dtype}")
    return t


def _batch_size(batch_size, expected, what: str) -> None:
    _check(_is_int(batch_size), f"batch_size: expected an int, got {batch_size!r}")
    _check(batch_size == expected,
           f"batch_size: expected {what} = {expected}, got {batch_size}")


def _scale(scale, kv_cache_dtype) -> None:
    """vLLM's `scale` is a tensor for every format, even one that ignores its value."""
    _check(isinstance(scale, Tensor),
           f"scale: expected a float32 tensor [1] (kv_cache_dtype {kv_cache_dtype!r} may ignore its value, "
           f"but the op takes one), got {type(scale).__name__}")


def _check_concat(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale) -> None:
    _check(isinstance(skip_scale, bool), f"skip_scale: expected a bool, got {skip_scale!r}")
    _scale(scale, kv_cache_dtype)
    _one_device("concat_and_cache_mla", kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                slot_mapping=slot_mapping, scale=scale)


def _check_gather(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype,
                  scale, seq_starts) -> None:
    dst = _tensor(dst, "dst", 2)
    _check(dst.size(1) in GATHER_DST_WIDTHS,
           f"dst: expected {', '.join(map(str, GATHER_DST_WIDTHS))} columns (vLLM 0.33's "
           f"gather_and_maybe_dequant_cache widths), got {dst.size(1)}")
    _tensor(cu_seq_lens, "cu_seq_lens", 1)
    _check(cu_seq_lens.numel() >= 1, "cu_seq_lens: expected [num_reqs + 1] offsets, got an empty tensor")
    _check(_is_int(num_tokens) and 0 <= num_tokens <= dst.size(0),
           f"num_tokens: expected an int in [0, {dst.size(0)}] (dst's rows), got {num_tokens!r}")
    _tensor(token_to_seq, "token_to_seq", 1, torch.int32)
    _check(token_to_seq.numel() >= num_tokens,
           f"token_to_seq: expected at least num_tokens={num_tokens} entries, got {token_to_seq.numel()}")
    _scale(scale, kv_cache_dtype)
    _one_device("gather_and_maybe_dequant_cache", src_cache=src_cache, dst=dst, block_table=block_table,
                cu_seq_lens=cu_seq_lens, token_to_seq=token_to_seq, scale=scale, seq_starts=seq_starts)


def _check_cp_gather(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts) -> None:
    _tensor(cu_seq_lens, "cu_seq_lens", 1)
    _batch_size(batch_size, cu_seq_lens.numel() - 1, "len(cu_seq_lens) - 1")
    _one_device("cp_gather_cache", src_cache=src_cache, dst=dst, block_table=block_table,
                cu_seq_lens=cu_seq_lens, seq_starts=seq_starts)


def _check_host_cache(host_cache, host_row_ids, device_row_ids) -> None:
    for name, value in (("host_cache", host_cache), ("host_row_ids", host_row_ids),
                        ("device_row_ids", device_row_ids)):
        _check(value is None,
               f"{name}: expected None; mla_ext does not support vLLM's host-cache rows "
               "(host_cache / host_row_ids / device_row_ids): gather from a device cache")


def _check_upconvert(op, src_cache, dst, block_table, workspace_starts, batch_size, seq_starts) -> None:
    dst = _tensor(dst, "dst", 2, torch.bfloat16)
    _check(dst.size(1) == UPCONVERT_DST_WIDTH,
           f"dst: expected {UPCONVERT_DST_WIDTH} columns (512 latent + 64 rope, bf16), got {dst.size(1)}")
    _tensor(workspace_starts, "workspace_starts", 1, torch.int32)
    # vLLM's own callers pass the chunk's cu_seq_lens (R + 1 entries) with
    # batch_size = R, and its kernel reads the first batch_size entries.
    _check(_is_int(batch_size) and 0 <= batch_size <= workspace_starts.numel(),
           f"batch_size: expected an int in [0, {workspace_starts.numel()}] (len(workspace_starts); "
           f"the first batch_size entries are read), got {batch_size!r}")
    _one_device(op, src_cache=src_cache, dst=dst, block_table=block_table, workspace_starts=workspace_starts,
                seq_starts=seq_starts)


def _check_merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                 prefill_tokens_with_context, output_scale) -> None:
    output = _tensor(output, "output", 3)
    tokens, heads, dim = output.shape
    p = prefill_tokens_with_context
    _check(p is None or (_is_int(p) and 0 <= p <= tokens),
           f"prefill_tokens_with_context: expected None or an int in [0, {tokens}] (output's tokens), "
           f"got {p!r}")
    o_shape = (tokens, heads, dim)
    suffix_output = _tensor(suffix_output, "suffix_output", 3)
    _check(suffix_output.dtype in attn_api.O_DTYPES,
           f"suffix_output: expected dtype bfloat16, float16 or float32, got {suffix_output.dtype}")
    _check(tuple(suffix_output.shape) == o_shape,
           f"suffix_output: expected shape {list(o_shape)} (as output), got {list(suffix_output.shape)}")
    prefix_output = _tensor(prefix_output, "prefix_output", 3, suffix_output.dtype)
    # With p given only the first p tokens of the prefix are read: [>= p, N, D].
    rows_ok = prefix_output.size(0) == tokens if p is None else prefix_output.size(0) >= p
    _check(rows_ok and tuple(prefix_output.shape[1:]) == (heads, dim),
           f"prefix_output: expected shape {list(o_shape)} (as output)"
           + ("" if p is None else f" or [>= {p}, {heads}, {dim}]") + f", got {list(prefix_output.shape)}")
    # The native merge's stride rule, named as vLLM names the arguments (a float8
    # output is written by a copy, at any strides).
    for name, o in (("prefix_output", prefix_output), ("suffix_output", suffix_output),
                    ("output", output if output_scale is None else None)):
        _check(o is None or dim <= 1 or o.stride(2) == 1,
               f"{name}: the head dim must be contiguous (stride 1), got stride {o.stride(2) if o is not None else 1}")
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse)):
        if lse is None and name == "output_lse":
            continue
        lse = _tensor(lse, name, 2, torch.float32)
        cols_ok = lse.size(1) == tokens if (name != "prefix_lse" or p is None) else lse.size(1) >= p
        _check(cols_ok and lse.size(0) == heads,
               f"{name}: expected shape [{heads}, {tokens}] ([num_heads, num_tokens])"
               + ("" if name != "prefix_lse" or p is None else f" or [{heads}, >= {p}]")
               + f", got {list(lse.shape)}")
    if output_scale is None:
        _check(output.dtype == suffix_output.dtype,
               f"output: expected dtype {suffix_output.dtype} (as suffix_output; a float8 output needs "
               f"output_scale), got {output.dtype}")
    else:
        _tensor(output_scale, "output_scale", dtype=torch.float32)
        _check(output_scale.numel() == 1,
               f"output_scale: expected one element, got shape {list(output_scale.shape)}")
        _check(output.dtype == FP8_OUTPUT_DTYPE,
               f"output: with output_scale, expected dtype {FP8_OUTPUT_DTYPE}, got {output.dtype}")
    _one_device("merge_attn_states", output=output, prefix_output=prefix_output, prefix_lse=prefix_lse,
                suffix_output=suffix_output, suffix_lse=suffix_lse, output_lse=output_lse,
                output_scale=output_scale)


# -- helpers of the real kernels ----------------------------------------------

_UNIT_SCALES: dict = {}


def _unit_scale(device: torch.device) -> Tensor:
    """float32 [1] = 1.0 on `device`: the scale of skip_scale=True, and the
    k_scale argument (ignored by the format) of the fp8_ds_mla gather. Cached
    per device, except while a CUDA graph is being captured: a tensor made
    then is filled only when the graph replays, so it is not kept."""
    unit = _UNIT_SCALES.get(device)
    if unit is None:
        unit = torch.ones(1, dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _UNIT_SCALES[device] = unit
    return unit


def _raw_dst(src_cache: Tensor, dst: Tensor) -> Tensor:
    """dst seen with the cache's dtype when one is uint8 and the other a 1-byte
    float8 (raw bytes either way); otherwise dst itself (the native op checks it)."""
    one_byte = {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2}
    if (dst.dtype != src_cache.dtype and torch.uint8 in (dst.dtype, src_cache.dtype)
            and {dst.dtype, src_cache.dtype} <= one_byte):
        return dst.view(src_cache.dtype)
    return dst


def _check_merge_memory(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, p,
                        output_scale) -> None:
    """The native merge's shared-memory rules, named as vLLM names the arguments:
    an output may be exactly the input of its kind (an in-place merge; only
    the p prefix tokens that are read count), never a shifted or partial view
    of any input, nor overlap the other output or itself."""
    in_place = output_scale is None  # a float8 output cannot be a 16/32-bit input
    outputs = [("output", output, (("prefix_output", prefix_output[:p], output[:p], in_place),
                                   ("suffix_output", suffix_output, output, in_place),
                                   ("prefix_lse", prefix_lse, output, False),
                                   ("suffix_lse", suffix_lse, output, False),
                                   ("output_scale", output_scale, output, False)))]
    if output_lse is not None:
        outputs.append(("output_lse", output_lse, (("prefix_lse", prefix_lse[:, :p], output_lse[:, :p], True),
                                                   ("suffix_lse", suffix_lse, output_lse, True),
                                                   ("prefix_output", prefix_output, output_lse, False),
                                                   ("suffix_output", suffix_output, output_lse, False),
                                                   ("output", output, output_lse, False))))
    for w_name, w, reads in outputs:
        check_no_internal_overlap(w, w_name)
        for r_name, r, w_part, same_ok in reads:
            check_no_overlap(w_part, w_name, r, r_name, in_place=same_ok)


def _format_bytes(cache: Tensor, kv_cache_dtype: str) -> Tensor:
    """A float8-typed cache of a quantized format, seen as its raw bytes.

    vLLM's MLAAttention views every quantized per-tensor cache as the
    platform's fp8 dtype (float8_e4m3fn) before its ops, also an fp8_e5m2 one:
    its kernels read the bytes by the format string. The native API checks a
    float8 cache's dtype against the format, so the surface passes the bytes
    (uint8, no copy) and the format string decides, as in vLLM."""
    if (isinstance(cache, Tensor) and cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and isinstance(kv_cache_dtype, str) and kv_cache_dtype not in ("auto", "bfloat16", "float16")):
        return cache.view(torch.uint8)
    return cache


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _store_fp8(out: Tensor, values: Tensor, output_scale: Tensor) -> None:
    """out (float8_e4m3fn) = saturate(values / output_scale)."""
    if out.numel():
        q = (values.float() / output_scale.reshape(())).clamp_(-E4M3_MAX, E4M3_MAX)
        out.copy_(q.to(FP8_OUTPUT_DTYPE))


def _check_output_scale_value(output_scale: Tensor) -> None:
    """A CPU scale is read (free) and must be finite and > 0; a device one is
    not read (that would sync): an invalid one gives saturated or NaN bytes."""
    if output_scale.device.type == "cpu":
        v = float(output_scale.reshape(-1)[0])
        _check(math.isfinite(v) and v > 0, f"output_scale: expected a finite value > 0, got {v}")


def _check_offsets_on_cpu(dst: Tensor, cu_seq_lens: Tensor, num_reqs: int, seq_starts: Tensor | None) -> None:
    """CPU tensors: cu_seq_lens (negative, decreasing, past dst) and seq_starts (negative) are read
    and refused naming them (free on the host). On CUDA they are not read (that would sync): the
    kernels write no row outside dst and give zero rows for tokens outside the table, as vLLM's."""
    if dst.device.type == "cpu":
        _check(seq_starts is None or (seq_starts.dim() == 1 and seq_starts.numel() >= num_reqs),
               f"seq_starts: expected [>= {num_reqs}] (one per request), got "
               f"{None if seq_starts is None else tuple(seq_starts.shape)}")
        cache_checks.check_offsets(cu_seq_lens, num_reqs, seq_starts, dst.size(0))


# -- the ops -----------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::concat_and_cache_mla", mutates_args=("kv_cache",))
def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                         kv_cache_dtype: str, scale: Tensor, skip_scale: bool = False) -> None:
    _check_concat(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale)
    k_scale = _unit_scale(kv_cache.device) if skip_scale else scale
    cache_api.concat_and_cache_mla(kv_c, k_pe, _format_bytes(kv_cache, kv_cache_dtype), slot_mapping,
                                   kv_cache_dtype, k_scale)


@concat_and_cache_mla.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale=False):
    _check_concat(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale)


@torch.library.custom_op(f"{NAMESPACE}::gather_and_maybe_dequant_cache", mutates_args=("dst",))
def gather_and_maybe_dequant_cache(src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor,
                                   token_to_seq: Tensor, num_tokens: int, kv_cache_dtype: str, scale: Tensor,
                                   seq_starts: Optional[Tensor] = None) -> None:
    _check_gather(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype, scale,
                  seq_starts)
    _check_offsets_on_cpu(dst, cu_seq_lens, cu_seq_lens.numel() - 1, seq_starts)
    cache_api.gather_and_maybe_dequant_cache(_format_bytes(src_cache, kv_cache_dtype), dst, block_table,
                                             cu_seq_lens, cu_seq_lens.numel() - 1, kv_cache_dtype, scale,
                                             seq_starts)


@gather_and_maybe_dequant_cache.register_fake
def _(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype, scale,
      seq_starts=None):
    _check_gather(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, kv_cache_dtype, scale,
                  seq_starts)


@torch.library.custom_op(f"{NAMESPACE}::cp_gather_cache", mutates_args=("dst",))
def cp_gather_cache(src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, batch_size: int,
                    seq_starts: Optional[Tensor] = None) -> None:
    _check_cp_gather(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)
    _check_offsets_on_cpu(dst, cu_seq_lens, batch_size, seq_starts)
    cache_api.cp_gather_cache(src_cache, _raw_dst(src_cache, dst), block_table, cu_seq_lens, batch_size,
                              seq_starts)


@cp_gather_cache.register_fake
def _(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
    _check_cp_gather(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)


def _upconvert(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts, kv_cache_dtype) -> None:
    """The native dequantizing gather of a fixed-layout format into bf16 [tokens, 576].
    Request r owns rows [workspace_starts[r], workspace_starts[r + 1]) and the
    last one runs to dst's end: the native op's cu_seq_lens, built on the device
    (one tiny cat, no host sync). The format ignores the scale argument.
    CPU tensors are read first (free there): workspace_starts negative, decreasing or
    past dst, and seq_starts negative raise naming them. CUDA tensors are not read
    (that would sync): the kernel bounds every row (no write past dst, zeros for a
    token outside the table), as vLLM's."""
    end = workspace_starts.new_full((1,), dst.size(0))
    cu_seq_lens = torch.cat([workspace_starts[:batch_size], end])
    if dst.device.type == "cpu":
        cache_checks.check_row_starts(workspace_starts, batch_size, dst.size(0), "workspace_starts")
    _check_offsets_on_cpu(dst, cu_seq_lens, batch_size, seq_starts)  # seq_starts (the rows are valid now)
    cache_api.gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, kv_cache_dtype,
                                             _unit_scale(src_cache.device), seq_starts)


_FP8_UPCONVERT = "cp_gather_and_upconvert_fp8_kv_cache"


@torch.library.custom_op(f"{NAMESPACE}::{_FP8_UPCONVERT}", mutates_args=("dst",))
def cp_gather_and_upconvert_fp8_kv_cache(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, workspace_starts: Tensor, batch_size: int,
    seq_starts: Optional[Tensor] = None, host_cache: Optional[Tensor] = None,
    host_row_ids: Optional[Tensor] = None, device_row_ids: Optional[Tensor] = None,
) -> None:
    _check_host_cache(host_cache, host_row_ids, device_row_ids)
    _check_upconvert(_FP8_UPCONVERT, src_cache, dst, block_table, workspace_starts, batch_size, seq_starts)
    _upconvert(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts, "fp8_ds_mla")


@cp_gather_and_upconvert_fp8_kv_cache.register_fake
def _(src_cache, dst, block_table, workspace_starts, batch_size, seq_starts=None, host_cache=None,
      host_row_ids=None, device_row_ids=None):
    _check_host_cache(host_cache, host_row_ids, device_row_ids)
    _check_upconvert(_FP8_UPCONVERT, src_cache, dst, block_table, workspace_starts, batch_size, seq_starts)


# The op's schema carries no defaults: torch 2.11's custom_op raises IndexError
# ("tuple index out of range") when a mutated optional argument with a default
# (output_lse) is left out or passed as None with nothing after it (2.14 guards
# it). vLLM's defaults live on the Python function `merge_attn_states` below,
# which always passes every argument. The op's argument ORDER is
# torch.ops._C.merge_attn_states's (output, output_lse, prefix_output, ...),
# so code written against vLLM's torch op runs unchanged; the Python function
# below has vLLM's _custom_ops order (output_lse 6th), as vLLM's wrapper.
@torch.library.custom_op(f"{NAMESPACE}::merge_attn_states", mutates_args=("output", "output_lse"))
def _merge_attn_states_op(output: Tensor, output_lse: Optional[Tensor], prefix_output: Tensor,
                          prefix_lse: Tensor, suffix_output: Tensor, suffix_lse: Tensor,
                          prefill_tokens_with_context: Optional[int],
                          output_scale: Optional[Tensor]) -> None:
    _check_merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                 prefill_tokens_with_context, output_scale)
    tokens = output.size(0)
    p = tokens if prefill_tokens_with_context is None else prefill_tokens_with_context
    _check_merge_memory(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, p, output_scale)
    whole = p == tokens and prefix_output.size(0) == tokens and prefix_lse.size(1) == tokens
    if output_scale is None and whole:  # the plain merge: straight into output
        attn_api.merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse,
                                   out=output, out_lse=output_lse)
        return
    lse_head = output_lse[:, :p] if output_lse is not None else None
    if output_scale is None:
        if p:
            attn_api.merge_attn_states(prefix_output[:p], prefix_lse[:, :p], suffix_output[:p], suffix_lse[:, :p],
                                       out=output[:p], out_lse=lse_head)
        if not _same_view(output, suffix_output):
            output[p:].copy_(suffix_output[p:])
    else:
        _check_output_scale_value(output_scale)
        if p:
            merged, _ = attn_api.merge_attn_states(prefix_output[:p], prefix_lse[:, :p], suffix_output[:p],
                                                   suffix_lse[:, :p], out_lse=lse_head)
            _store_fp8(output[:p], merged, output_scale)
        _store_fp8(output[p:], suffix_output[p:], output_scale)
    if output_lse is not None and p < tokens and not _same_view(output_lse, suffix_lse):
        output_lse[:, p:].copy_(suffix_lse[:, p:])


@_merge_attn_states_op.register_fake
def _(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
      prefill_tokens_with_context, output_scale):
    _check_merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                 prefill_tokens_with_context, output_scale)


def merge_attn_states(output: Tensor, prefix_output: Tensor, prefix_lse: Tensor, suffix_output: Tensor,
                      suffix_lse: Tensor, output_lse: Optional[Tensor] = None,
                      prefill_tokens_with_context: Optional[int] = None,
                      output_scale: Optional[Tensor] = None) -> None:
    """vLLM 0.33's merge_attn_states (the op `mla_ext_vllm::merge_attn_states`, whose
    arguments are in torch.ops._C.merge_attn_states's order)."""
    _merge_attn_states_op(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
                          prefill_tokens_with_context, output_scale)


OPS = (concat_and_cache_mla, gather_and_maybe_dequant_cache, cp_gather_cache,
       cp_gather_and_upconvert_fp8_kv_cache, merge_attn_states)


# The nvfp4_ds_mla upconvert exists exactly when mla_ext's format registry has
# that format (vLLM: SM100 only; here wherever the native gather runs).
if "nvfp4_ds_mla" in formats.ALL_NAMES:
    _NVFP4_UPCONVERT = "cp_gather_and_upconvert_nvfp4_kv_cache"

    @torch.library.custom_op(f"{NAMESPACE}::{_NVFP4_UPCONVERT}", mutates_args=("dst",))
    def cp_gather_and_upconvert_nvfp4_kv_cache(src_cache: Tensor, dst: Tensor, block_table: Tensor,
                                               workspace_starts: Tensor, batch_size: int) -> None:
        _check_upconvert(_NVFP4_UPCONVERT, src_cache, dst, block_table, workspace_starts, batch_size, None)
        _upconvert(src_cache, dst, block_table, workspace_starts, batch_size, None, "nvfp4_ds_mla")

    @cp_gather_and_upconvert_nvfp4_kv_cache.register_fake
    def _(src_cache, dst, block_table, workspace_starts, batch_size):
        _check_upconvert(_NVFP4_UPCONVERT, src_cache, dst, block_table, workspace_starts, batch_size, None)

    OPS += (cp_gather_and_upconvert_nvfp4_kv_cache,)

# The DSA indexer-cache ops (mla_ext/vllm/_indexer_ops.py): vLLM 0.33's names for the sparse path.
from mla_ext.vllm._indexer_ops import (  # noqa: E402,F401
    cp_gather_indexer_k_quant_cache,
    indexer_k_quant_and_cache,
)
