"""Marlin packed FP8 weights (W8A16) for kv_b_proj, in vLLM's post-load layout.

mla_ext's native packed layout IS vLLM's Marlin fp8 layout (what vLLM's
`process_weights_after_loading` leaves in a Marlin fp8 layer's `weight` and
`weight_scale`/`weight_scale_inv`), so `marlin_fp8_from_vllm` (and
`MarlinFp8Weight.from_vllm`) wraps a vLLM layer's tensors as they are, with no
conversion copy, and `marlin_fp8_repack` produces the same bytes from an fp8
checkpoint weight. csrc/kv_b_proj/marlin_fp8.h is the definition the kernels
use; the block below is the same text (tests/kv_b_proj/test_kv_b_proj_marlin.py keeps the
two equal and checks the repack against it and against `word_location` /
`scale_position` here):

LAYOUT BEGIN
qweight: int32 [K/16, 4*N_pad], N_pad = N rounded up to 64 (vLLM: N % 64 == 0, so [K/16, 4N]).
  The weight is cut into tiles of 16 k (reduction) x 64 n (output columns).
  Tile (kt, nt) is the 256 consecutive words starting at word (kt * N_pad/64 + nt) * 256,
  i.e. row kt of qweight holds the tiles of k-tile kt for every 64-column block (k-tiles outermost).
  Inside a tile, word lane*8 + j (lane 0..31, j 0..7) feeds warp lane `lane` the
  mma.sync.m16n8k16 B fragment of the j-th 8-column sub-tile; with g = lane / 4, t = lane % 4:
    n = nt*64 + j*8 + g,  k0 = kt*16 + 2*t,
    byte 0 = W[n][k0], byte 1 = W[n][k0+8], byte 2 = W[n][k0+1], byte 3 = W[n][k0+9]
  (byte 0 = least significant). Columns n >= N are zero bytes.
scales: activation dtype (bf16 or fp16, the model dtype), [G, N_pad]; G = 1 (per-channel)
  or K/128 (group_size 128 with K > 128; group_size == K is per-channel).
  Value: the fp32 scale times 2^120 (bf16) or 2^8 (fp16), rounded once to the activation dtype.
  Row g holds k-group g, permuted inside blocks of columns:
  per-channel, 32-column blocks: position 8*i + x holds column 2*i + (x % 2) + 8*(x / 2)
    (i 0..3, x 0..7), i.e. column c sits at 8*((c % 8) / 2) + 2*((c % 32) / 8) + c % 2;
  grouped, 64-column blocks: position 8*i + x holds column i + 8*x (an 8x8 transpose),
    i.e. column c sits at 8*(c % 8) + c / 8.
  Padded columns hold 0.
LAYOUT END

The kernel dequantizes by shifting the e4m3 bits into bf16/fp16 positions;
the missing exponent bias (2^120 for bf16, 2^8 for fp16) is carried by the
scales, so a packed weight is tied to ONE activation dtype (`act_dtype`) and
its storage dtype (int32) says nothing about the compute dtype (SPEC §5). The
folded scale must be finite in the activation dtype (|scale| below about 256). mla_ext's repack folds in fp32 and rounds once; vLLM
rounds first and multiplies in the activation dtype: the same bits whenever
the unfolded scale is a normal number of that dtype (always for bf16).

Constraints: K % 16 == 0 (K % 128 == 0 with group_size=128); any N in the
repack (padded to 64, masked in the GEMM) -- vLLM's own Marlin requires
N % 64 == 0 and K % 128 == 0; NaN weight bytes (0x7f/0xff) are rejected. On
CUDA tensors the GEMM is the mma.sync kernel (sm_80+); on CPU tensors it is
the packed-layout reference kernel (fp32, slow but exact in intent: it proves
the packing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_ext import _ext
from mla_ext.kv_b_proj.rows import check_row_cut

ACT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUP_SIZES = (-1, 128)
TILE_N = 64  # output columns per packed tile (kTileN in csrc/kv_b_proj/marlin_fp8.h)


@dataclass(frozen=True)
class MarlinFp8Packed:
    """A packed fp8 weight in vLLM's Marlin layout (module doc).

    qweight: int32 [K/16, 4*N_pad]; scales: act_dtype [G, N_pad] (permuted,
    exponent bias for `act_dtype` folded; G = 1, or K/128 with group_size=128
    and K > 128); N, K: logical shape of the original [N, K] weight;
    group_size: -1 (per-channel) or 128; act_dtype: the activation dtype the
    GEMM must be fed (bf16 or fp16).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    N: int
    K: int
    group_size: int
    act_dtype: torch.dtype


def grouped_scales(k: int, group_size: int) -> bool:
    """Grouped (64-column transpose) or per-channel (32-column) scale permutation."""
    return 0 < group_size < k


def word_location(n: int, k: int) -> tuple[int, int, int]:
    """(qweight row, qweight column, byte) holding W[n][k] (layout block above)."""
    kt, nt = k // 16, n // TILE_N
    kk, c = k % 16, n % TILE_N
    t, g, j = (kk % 8) // 2, c % 8, c // 8
    byte = (kk % 2) * 2 + kk // 8  # k0 -> 0, k0+8 -> 1, k0+1 -> 2, k0+9 -> 3
    return kt, nt * 256 + (g * 4 + t) * 8 + j, byte


def scale_position(c: int, grouped: bool) -> int:
    """Position, inside its 64-column panel, of the scale of column c (0..63)."""
    if grouped:
        return 8 * (c % 8) + c // 8
    return 32 * (c // 32) + 8 * ((c % 8) // 2) + 2 * ((c % 32) // 8) + c % 2


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def marlin_fp8_repack(
    w_fp8: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype, group_size: int = -1
) -> MarlinFp8Packed:
    """Packs fp8 `w_fp8` [N, K] with fp32 `scales` ([N], or [K/128, N] for group_size=128)
    into vLLM's Marlin layout (module doc).

    Runs on the tensors' device (CPU or CUDA). Validation (NaN bytes, finite
    scales) synchronises once: this is a weight-load-time call.
    """
    _require(isinstance(w_fp8, torch.Tensor), f"w_fp8: expected a tensor, got {type(w_fp8).__name__}")
    _require(isinstance(scales, torch.Tensor), f"scales: expected a tensor, got {type(scales).__name__}")
    _require(act_dtype in ACT_DTYPES, f"act_dtype: expected torch.bfloat16 or torch.float16, got {act_dtype}")
    _require(group_size in GROUP_SIZES, f"group_size: expected -1 (per-channel) or 128, got {group_size}")
    qweight, packed_scales = _ext.ops().marlin_fp8_repack(w_fp8, scales, group_size, act_dtype)
    n, k = w_fp8.shape
    return MarlinFp8Packed(qweight, packed_scales, int(n), int(k), int(group_size), act_dtype)


def marlin_fp8_from_vllm(qweight: torch.Tensor, scales: torch.Tensor, size_n: int, size_k: int,
                         group_size: int, act_dtype: torch.dtype) -> MarlinFp8Packed:
    """Wraps vLLM's post-load Marlin fp8 tensors as they are (no copy where the
    layouts agree).

    qweight: int32 [K_pad/16, 4*N_pad'] (a layer's `weight` after
    process_weights_after_loading); scales: [G', N_pad'] (or [N_pad'] for
    per-channel) in act_dtype, permuted, exponent bias folded (its
    `weight_scale` or `weight_scale_inv`); size_n / size_k: the TRUE sizes
    (the layer's `output_size_per_partition` / `input_size_per_partition`);
    group_size: -1 or 128 (vLLM: -1 for per-tensor/per-channel,
    weight_block_size[1] for block fp8).

    vLLM 0.33 zero-pads N and K to Marlin's thread tiles (`marlin_padded_nk`:
    N to 64 or 128, K to 128 or 64 and to the group size; N=200 -> 256), so
    the tensors may be larger than [size_k/16, 4*size_n]. Padding is zero
    bytes and zero scales, and the tiles are laid out k-tile-row by k-tile-row,
    so the first size_k/16 rows of qweight and the first ceil(size_k/group)
    rows of the scales are the true weight's (contiguous views, no copy) when
    N_pad' is mla_ext's N_pad (size_n rounded up to 64; true whenever
    vLLM's padded K is a multiple of 128, as for every kv_b_proj); a wider N
    padding is cut to N_pad with one copy. size_k must be a multiple of 16
    (of 128 with group_size=128): mla_ext's GEMM does not mask K.
    One host sync checks the scales are finite.
    """
    for name, v in (("size_n", size_n), ("size_k", size_k), ("group_size", group_size)):
        _require(isinstance(v, int) and not isinstance(v, bool), f"{name}: expected an int, got {v!r}")
    _require(act_dtype in ACT_DTYPES, f"act_dtype: expected torch.bfloat16 or torch.float16, got {act_dtype}")
    _require(size_n > 0, f"size_n: expected a positive int (the true N, output_size_per_partition), got {size_n}")
    _require(size_k > 0 and size_k % 16 == 0, f"size_k: expected a positive multiple of 16, got {size_k}")
    _require(group_size in GROUP_SIZES,
             f"group_size: expected -1 (per-channel) or 128 (group-128 / block fp8), got {group_size}")
    _require(group_size == -1 or size_k % 128 == 0,
             f"size_k: expected a multiple of 128 with group_size=128, got {size_k}")
    _require(isinstance(qweight, torch.Tensor), f"qweight: expected a tensor, got {type(qweight).__name__}")
    _require(isinstance(scales, torch.Tensor), f"scales: expected a tensor, got {type(scales).__name__}")
    _require(qweight.dtype == torch.int32, f"qweight: expected torch.int32 (Marlin-packed), got {qweight.dtype}")
    n_pad = -(-size_n // TILE_N) * TILE_N
    _require(qweight.dim() == 2 and qweight.shape[0] * 16 >= size_k and qweight.shape[1] % (4 * TILE_N) == 0
             and qweight.shape[1] >= 4 * n_pad,
             f"qweight: expected shape [K_pad/16, 4*N_pad] with K_pad >= size_k={size_k} and N_pad >= {n_pad} a "
             f"multiple of 64 (vLLM's Marlin layout, possibly zero-padded), got {list(qweight.shape)}")
    # Only the padding vLLM's rule can produce (N to 64 or 128, K to at most
    # lcm(128, group)): a bigger tensor means the stated sizes are not its own.
    k_tile = 128 if group_size == -1 else math.lcm(128, group_size)
    n_choices = (n_pad, -(-size_n // 128) * 128)
    _require(qweight.shape[1] // 4 in n_choices and qweight.shape[0] * 16 <= -(-size_k // k_tile) * k_tile,
             f"qweight: expected shape [K_pad/16, 4*N_pad] with N_pad in {sorted(set(n_choices))} and K_pad in "
             f"[{size_k}, {-(-size_k // k_tile) * k_tile}] (size_n={size_n}, size_k={size_k} with vLLM's Marlin "
             f"padding), got {list(qweight.shape)}: do the stated sizes belong to this weight?")
    _require(qweight.is_contiguous(), "qweight: expected a contiguous tensor (it is used as is, no copy)")
    _require(scales.dtype == act_dtype,
             f"scales: expected {act_dtype} (vLLM stores Marlin scales in the model dtype), got {scales.dtype}")
    groups = size_k // group_size if group_size > 0 else 1
    stored_n = qweight.shape[1] // 4
    if scales.dim() == 1:
        scales = scales.view(1, -1)
    _require(scales.dim() == 2 and scales.shape[0] >= groups and scales.shape[1] == stored_n
             and (group_size > 0 or scales.shape[0] == 1),
             f"scales: expected shape [G, N_pad] with G >= {groups} and N_pad = {stored_n} (as qweight)"
             f"{' (or [N_pad])' if groups == 1 else ''}, got {list(scales.shape)}")
    _require(scales.is_contiguous(), "scales: expected a contiguous tensor (it is used as is, no copy)")
    _require(scales.device == qweight.device,
             f"scales: expected device {qweight.device} (as qweight), got {scales.device}")
    qweight = qweight[: size_k // 16]  # leading k-tile rows: a contiguous view
    scales = scales[:groups]
    if stored_n != n_pad:  # N padded past the 64-column tile: keep the first N_pad columns (one copy)
        qweight = qweight[:, : 4 * n_pad].contiguous()
        scales = scales[:, :n_pad].contiguous()
    _require(bool(torch.isfinite(scales).all()),
             "scales: expected finite values (the folded Marlin scale overflowed the activation dtype?)")
    return MarlinFp8Packed(qweight, scales, size_n, size_k, group_size, act_dtype)


def marlin_fp8_slice_rows(packed: MarlinFp8Packed, start: int, stop: int) -> MarlinFp8Packed:
    """Output rows [start, stop) of the logical weight, cut from the packed tiles
    without repacking (e.g. a tensor-parallel shard); the result owns its tensors.

    Output rows are 64-column blocks of the layout: 256 words of every qweight
    row (one per k-tile) and 64 scale columns (both scale permutations stay
    inside 64 columns), so the cut must fall on tile boundaries:
    start % 64 == 0 and stop % 64 == 0 or stop == N. Otherwise slice the
    checkpoint fp8 weight and scale and pack that
    (`MarlinFp8Weight.from_fp8(fp8_format.slice_rows(...))`).
    """
    _require(0 <= start < stop <= packed.N,
             f"rows [start, stop): expected 0 <= start < stop <= N={packed.N}, got [{start}, {stop})")
    check_row_cut(start, stop, packed.N, TILE_N, f"{TILE_N}-row Marlin packing tile",
                  "slice the checkpoint fp8 weight and scale instead and pack the slice, "
                  "MarlinFp8Weight.from_fp8(fp8_format.slice_rows(...))")
    t0, t1 = start // TILE_N, -(-stop // TILE_N)
    qweight = packed.qweight[:, t0 * 256:t1 * 256].clone(memory_format=torch.contiguous_format)
    # Padded columns (past N) hold zero bytes / zero scales.
    scales = packed.scales[:, t0 * TILE_N:t1 * TILE_N].clone(memory_format=torch.contiguous_format)
    return MarlinFp8Packed(qweight, scales, stop - start, packed.K, packed.group_size, packed.act_dtype)


MAX_SPLIT_K = 64  # kMaxSplit in csrc/kv_b_proj/marlin_fp8.h


def marlin_fp8_gemm(
    a: torch.Tensor, packed: MarlinFp8Packed, out_dtype: torch.dtype | None = None, *,
    split_k: int = 0,
) -> torch.Tensor:
    """a [M, K] (dtype packed.act_dtype; row stride may exceed K, last dim contiguous) -> [M, N].

    out_dtype defaults to packed.act_dtype (bf16, fp16 or fp32 allowed).
    The CUDA kernel splits K and takes up to 64-row CTA tiles.
    split_k: K slices, 0 = chosen from the output tiles and the SM
    count (`plan_gemm`); on the CPU, 0 is one slice and n reproduces the
    kernel's n-slice summation order.
    """
    _require(a.dtype == packed.act_dtype,
             f"a: expected dtype {packed.act_dtype} (the dtype the weight was packed for), got {a.dtype}")
    _require(out_dtype is None or out_dtype in OUT_DTYPES,
             f"out_dtype: expected one of {OUT_DTYPES} or None, got {out_dtype}")
    _require(type(split_k) is int and 0 <= split_k <= MAX_SPLIT_K,
             f"split_k: expected an int from 0 (automatic) to {MAX_SPLIT_K}, got {split_k!r}")
    return _ext.ops().marlin_fp8_gemm(
        a, packed.qweight, packed.scales, packed.N, packed.K, packed.group_size, packed.act_dtype, out_dtype,
        split_k,
    )


@dataclass(frozen=True)
class GemmPlan:
    """The kernel's tiling and split-K for one call (mirror of plan_gemm in
    csrc/kv_b_proj/marlin_fp8.h; a test compiles the header and compares the two).

    mb: 16-row blocks per CTA; ws: 8-column sub-tiles per warp (a CTA covers
    16*mb rows x 32*ws columns); split: K slices of slice_tiles 16-k tiles
    each; workspace_floats / counters: the split-K workspace of one launch."""

    mb: int
    ws: int
    n_ctiles: int
    m_tiles: int
    k_tiles: int
    split: int
    slice_tiles: int
    workspace_floats: int
    counters: int


def plan_gemm(m: int, n: int, k: int, group_size: int, sm_count: int, split_k: int = 0) -> GemmPlan:
    """The GEMM plan (see GemmPlan) for an [m, k] x [n, k]^T call on a
    device with `sm_count` SMs (0: no split unless `split_k` asks for one)."""
    grouped = grouped_scales(k, group_size)
    mb, ws = (1, 8) if m <= 16 else ((2, 4 if grouped else 8) if m <= 32 else (4, 2 if grouped else 4))
    np_ = ws // 2
    n_tiles = -(-n // TILE_N)
    n_ct, m_t, k_t = -(-n_tiles // np_), -(-m // (16 * mb)), k // 16
    tiles = n_ct * m_t
    s = split_k
    if s <= 0:
        s = (sm_count + tiles // 2) // tiles if (sm_count > 0 and tiles > 0) else 1
        s = min(s, 16, k_t // 2)
        # The reduction's bytes (8 per fp32 partial: written, re-read) stay within the weight's.
        per_slice = 8 * min(m_t, 65535) * 16 * mb * n_ct * 32 * ws
        s = min(s, n_tiles * TILE_N * k // per_slice)
    s = max(1, min(s, MAX_SPLIT_K))
    length = -(-k_t // s)
    length = max(1, -(-length // 2) * 2)
    split = 1 if length >= k_t else -(-k_t // length)
    slice_tiles = k_t if split == 1 else length
    launch_tiles = n_ct * min(m_t, 65535)
    ws_floats = split * launch_tiles * 16 * mb * 32 * ws if split > 1 else 0
    return GemmPlan(mb, ws, n_ct, m_t, k_t, split, slice_tiles, ws_floats, launch_tiles if split > 1 else 0)


def marlin_fp8_dequantize(packed: MarlinFp8Packed, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight decoded from the packed layout: [N, K] decode(w) * scale, in
    packed.act_dtype (or `out_dtype`, e.g. torch.float32 for an exact check)."""
    w = _ext.ops().marlin_fp8_dequantize(
        packed.qweight, packed.scales, packed.N, packed.K, packed.group_size, packed.act_dtype
    )
    return w.to(out_dtype or packed.act_dtype)


def marlin_not_supported_reasons(a: torch.Tensor, packed: MarlinFp8Packed) -> list[str]:
    """Why `marlin_fp8_gemm(a, packed)` cannot run (empty list: it can).

    CPU tensors are served by the packed-layout reference kernel (correct, not
    fast); CUDA tensors need the compiled kernels, sm_80+, and 16-byte aligned rows.
    """
    reasons: list[str] = []
    if a.dtype != packed.act_dtype:
        reasons.append(f"a.dtype is {a.dtype}, the weight was packed for {packed.act_dtype}")
    if a.dim() != 2 or a.shape[-1] != packed.K:
        reasons.append(f"a must be [M, {packed.K}], got {tuple(a.shape)}")
    elif a.stride(-1) != 1:
        reasons.append(f"a's last dim must be contiguous (stride 1), got stride {a.stride(-1)}")
    if a.device != packed.qweight.device:
        reasons.append(f"a is on {a.device}, the packed weight on {packed.qweight.device}")
        return reasons
    if a.device.type == "cuda":
        ok, why = _ext.cuda_kernels_usable(a.device)
        if not ok:
            reasons.append(why)
        elif torch.cuda.get_device_capability(a.device) < (8, 0):
            reasons.append("the Marlin fp8 kernel needs sm_80+ (cp.async, bf16 mma.sync)")
        if a.dim() == 2 and a.shape[0] > 1 and a.stride(0) % 8 != 0:
            reasons.append(f"a's row stride must be a multiple of 8 elements, got {a.stride(0)}")
        for name, t in (("a", a), ("qweight", packed.qweight), ("scales", packed.scales)):
            if t.data_ptr() % 16 != 0:
                reasons.append(f"{name} must be 16-byte aligned")
    elif a.device.type != "cpu":
        reasons.append(f"unsupported device {a.device}")
    return reasons
