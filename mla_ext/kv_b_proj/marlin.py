"""Marlin-style packed FP8 weights (W8A16) for kv_b_proj.

The fp8 [N, K] weight is regrouped into int32 words laid out for the
`mma.sync.m16n8k16` B fragment (csrc/kv_b_proj/marlin_fp8.h documents the
layout byte by byte). The kernel dequantizes by shifting the e4m3 bits into
bf16/fp16 positions; the missing exponent bias (2^120 for bf16, 2^8 for fp16)
is folded into the scales, so a packed weight is tied to ONE activation dtype
(`act_dtype`) and its storage dtype (int32) says nothing about the compute
dtype (SPEC §5).

Scales: input orientation is fp32 `[N]` (per-channel, group_size=-1) or
`[K/128, N]` (group_size=128: row g scales k in [128g, 128g+128)). They are
stored as fp32 `[G, N_pad]` (permuted per 64-column block, bias folded), not in
the activation dtype: they multiply fp32 partial sums in the kernel epilogue,
so rounding them to bf16 would only lose accuracy, and fp16 cannot hold
scale * 2^8 for scales >= 256. The folded scale must be finite in fp32
(|scale| < 256 for bf16).

Constraints: K % 16 == 0 (K % 128 == 0 with group_size=128); any N (padded to
64 in the packed layout, masked in the GEMM); NaN weight bytes (0x7f/0xff) are
rejected. On CUDA tensors the GEMM is the mma.sync kernel (sm_80+); on CPU
tensors it is the packed-layout reference kernel (fp32, slow but exact in
intent: it proves the packing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ext import _ext
from mla_ext.kv_b_proj.weights import check_row_cut

ACT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUP_SIZES = (-1, 128)
TILE_N = 64  # output columns per packed tile (kTileN in csrc/kv_b_proj/marlin_fp8.h)


@dataclass(frozen=True)
class MarlinFp8Packed:
    """A repacked fp8 weight.

    qweight: int32 [ceil(N/64), 16*K] (packed tiles); scales: fp32 [G, ceil(N/64)*64]
    (permuted, exponent bias for `act_dtype` folded; G = 1 or K/128); N, K: logical
    shape of the original [N, K] weight; group_size: -1 (per-channel) or 128;
    act_dtype: the activation dtype the GEMM must be fed (bf16 or fp16).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    N: int
    K: int
    group_size: int
    act_dtype: torch.dtype


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def marlin_fp8_repack(
    w_fp8: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype, group_size: int = -1
) -> MarlinFp8Packed:
    """Packs fp8 `w_fp8` [N, K] with fp32 `scales` ([N], or [K/128, N] for group_size=128).

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


def marlin_fp8_slice_rows(packed: MarlinFp8Packed, start: int, stop: int) -> MarlinFp8Packed:
    """Output rows [start, stop) of the logical weight, cut from the packed tiles
    without repacking (e.g. a tensor-parallel shard); the result owns its tensors.

    A 64-column tile (qweight row) and its 64-column scale block are
    self-contained, so the cut must fall on tile boundaries: start % 64 == 0
    and stop % 64 == 0 or stop == N. Otherwise slice the checkpoint fp8 weight
    and scale and pack that (`MarlinFp8Weight.from_fp8(fp8_format.slice_rows(...))`).
    """
    _require(0 <= start < stop <= packed.N,
             f"rows [start, stop): expected 0 <= start < stop <= N={packed.N}, got [{start}, {stop})")
    check_row_cut(start, stop, packed.N, TILE_N, f"{TILE_N}-row Marlin packing tile",
                  "slice the checkpoint fp8 weight and scale instead and pack the slice, "
                  "MarlinFp8Weight.from_fp8(fp8_format.slice_rows(...))")
    t0, t1 = start // TILE_N, -(-stop // TILE_N)
    qweight = packed.qweight[t0:t1].clone(memory_format=torch.contiguous_format)
    # Scales are permuted only inside 64-column blocks; padded columns (past N) hold 0.
    scales = packed.scales[:, t0 * TILE_N:t1 * TILE_N].clone(memory_format=torch.contiguous_format)
    return MarlinFp8Packed(qweight, scales, stop - start, packed.K, packed.group_size, packed.act_dtype)


def marlin_fp8_gemm(
    a: torch.Tensor, packed: MarlinFp8Packed, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """a [M, K] (dtype packed.act_dtype; row stride may exceed K, last dim contiguous) -> [M, N].

    out_dtype defaults to packed.act_dtype (bf16, fp16 or fp32 allowed).
    """
    _require(a.dtype == packed.act_dtype,
             f"a: expected dtype {packed.act_dtype} (the dtype the weight was packed for), got {a.dtype}")
    _require(out_dtype is None or out_dtype in OUT_DTYPES,
             f"out_dtype: expected one of {OUT_DTYPES} or None, got {out_dtype}")
    return _ext.ops().marlin_fp8_gemm(
        a, packed.qweight, packed.scales, packed.N, packed.K, packed.group_size, packed.act_dtype, out_dtype
    )


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
        ok, why = _ext.cuda_kernels_usable()
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
