"""Pure-PyTorch reference for the paged latent cache ops (SPEC §2, §6).

Clarity over speed, float32 math, runs on the CPU. Every backend (C++ CPU,
CUDA, Triton) is tested against these functions; they mutate and return like
the compiled ops they mirror.

Out-of-range policy shared by all backends (documented in mla_ext.cache.api):
a gathered row whose token lies in a logical block past the block table's
width, whose token index is negative, or whose physical block id lies outside
`[0, num_blocks)` is written as ZERO (no read happens); a write whose slot is
negative or `>= num_blocks * block_size` is skipped. Rows of `dst` at or past
`cu_seq_lens[num_reqs]` are left untouched; rows past `dst.size(0)` are not
written.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.config.formats import DsMla, E4M3_MAX, E5M2_MAX, Nvfp4DsMla, QuantMode, get_format

# compute_kv_scale never returns less than this, so a layer of all-zero data
# still gets a finite, positive (usable) scale. Well below any real amax/448.
MIN_KV_SCALE = 1e-12


def fp8_max(fp8_dtype: torch.dtype) -> float:
    if fp8_dtype == torch.float8_e4m3fn:
        return E4M3_MAX
    if fp8_dtype == torch.float8_e5m2:
        return E5M2_MAX
    raise ValueError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")


def quantize_fp8_per_tensor(x: Tensor, k_scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """saturate(x / k_scale) as fp8 bytes (uint8). Round-to-nearest-even; NaN stays NaN."""
    m = fp8_max(fp8_dtype)
    q = (x.float() / k_scale.float().reshape(())).clamp(-m, m)
    return q.to(fp8_dtype).view(torch.uint8)


def dequantize_fp8_bytes(b: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """fp8 bytes (uint8) -> their float32 values (no scale applied)."""
    fp8_max(fp8_dtype)  # validates the dtype
    return b.contiguous().view(torch.uint8).view(fp8_dtype).float()


def _ds_tile_scales(kv_c: Tensor) -> Tensor:
    """[T, 4] power-of-two scales: 2^ceil(log2(max(amax(tile)/448, 1e-4))).

    ceil(log2(s)) is computed exactly from the float's exponent (frexp gives
    s = m * 2^e with m in [0.5, 1): ceil(log2 s) = e - 1 when m == 0.5, else e),
    so no log2 rounding can push a tile over 448. Kernels do the same.
    """
    T = kv_c.shape[0]
    tiles = kv_c.float().reshape(T, DsMla.NUM_TILES, DsMla.TILE_SIZE)
    amax = tiles.abs().amax(dim=-1)
    s = torch.clamp(amax / DsMla.E4M3_MAX, min=DsMla.MIN_SCALE)
    mant, exp = torch.frexp(s)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(s), e.to(torch.float32))


def encode_ds_mla_row(kv_c: Tensor, k_pe: Tensor) -> Tensor:
    """[T, 512] latent + [T, 64 or 0] rope -> [T, 656] fp8_ds_mla rows (uint8)."""
    T = kv_c.shape[0]
    if kv_c.shape[-1] != DsMla.LATENT_DIM or k_pe.shape[-1] not in (DsMla.ROPE_DIM, 0):
        raise ValueError(
            f"fp8_ds_mla needs kv_c [T, 512] and k_pe [T, 64 or 0]; got {tuple(kv_c.shape)}, "
            f"{tuple(k_pe.shape)}"
        )
    scales = _ds_tile_scales(kv_c)
    tiles = kv_c.float().reshape(T, DsMla.NUM_TILES, DsMla.TILE_SIZE) / scales[:, :, None]
    q = tiles.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.zeros(T, DsMla.ENTRY_BYTES, dtype=torch.uint8)
    out[:, DsMla.LATENT_OFFSET : DsMla.LATENT_OFFSET + DsMla.LATENT_DIM] = q.reshape(T, DsMla.LATENT_DIM)
    out[:, DsMla.SCALE_OFFSET : DsMla.ROPE_OFFSET] = scales.contiguous().view(torch.uint8)
    if k_pe.shape[-1]:
        rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
        out[:, DsMla.ROPE_OFFSET :] = rope
    return out


def decode_ds_mla_row(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[T, 656] uint8 -> (kv_c float32 [T, 512], k_pe bf16 [T, 64], tile scales float32 [T, 4])."""
    rows = rows.contiguous().view(torch.uint8)
    T = rows.shape[0]
    scales = rows[:, DsMla.SCALE_OFFSET : DsMla.ROPE_OFFSET].clone().view(torch.float32)
    vals = dequantize_fp8_bytes(rows[:, DsMla.LATENT_OFFSET : DsMla.LATENT_DIM], torch.float8_e4m3fn)
    kv_c = (vals.reshape(T, DsMla.NUM_TILES, DsMla.TILE_SIZE) * scales[:, :, None]).reshape(T, DsMla.LATENT_DIM)
    k_pe = rows[:, DsMla.ROPE_OFFSET :].clone().view(torch.bfloat16)  # clone: any byte alignment
    return kv_c, k_pe, scales


# -- nvfp4_ds_mla (352-byte rows; layout in formats.Nvfp4DsMla) ---------------

# e2m1 magnitudes by 3-bit index; a code's bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even on the e2m1 grid as thresholds: the magnitude index of
# |q| is the number of thresholds it passes, strictly (>) where the tie goes to
# the lower (even) index, inclusively (>=) where it goes to the upper one.
_E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)  # ties -> 0, 1.0, 2, 4
_E2M1_INCLUSIVE = (0.75, 1.75, 3.5)  # ties -> 1.0, 2, 4


def e2m1_codes(q: Tensor) -> Tensor:
    """float32 values (already divided by their scale) -> e2m1 codes (uint8, 0..15):
    round to nearest, ties to the even code, saturating at +-6; the sign bit is
    q's own (torch.signbit: -0.0 gives code 8). NaN gives index 0 (callers mask it)."""
    a = q.abs()
    idx = torch.zeros(q.shape, dtype=torch.int32, device=q.device)
    for t in _E2M1_STRICT:
        idx += (a > t).to(torch.int32)
    for t in _E2M1_INCLUSIVE:
        idx += (a >= t).to(torch.int32)
    return (idx | (torch.signbit(q).to(torch.int32) << 3)).to(torch.uint8)


def decode_e2m1(codes: Tensor) -> Tensor:
    """e2m1 codes (any integer dtype, 0..15) -> float32 (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    return table.to(codes.device)[codes.to(torch.int64)]


def nvfp4_block_scale_bytes(kv_c: Tensor) -> Tensor:
    """[T, 512] latent -> [T, 32] e4m3 scale bytes in BLOCK order (not permuted):
    e4m3(max(amax16 / 6, 2^-9)), round to nearest even, saturating at 448; a
    block holding NaN or +-inf gets the NaN byte 0x7F."""
    T = kv_c.shape[0]
    blocks = kv_c.float().reshape(T, Nvfp4DsMla.NUM_BLOCKS, Nvfp4DsMla.BLOCK_SIZE)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(finite, blocks.abs().amax(dim=-1), torch.zeros((), dtype=torch.float32))
    s = torch.clamp(amax / Nvfp4DsMla.E2M1_MAX, min=Nvfp4DsMla.MIN_SCALE, max=E4M3_MAX)
    b = s.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(finite, b, torch.full_like(b, Nvfp4DsMla.NAN_SCALE_BYTE))


def _scale_positions() -> Tensor:
    """[32] byte offsets in the row of the block scales, in block order."""
    return torch.tensor([Nvfp4DsMla.SCALE_OFFSET + Nvfp4DsMla.scale_byte(s)
                         for s in range(Nvfp4DsMla.NUM_BLOCKS)], dtype=torch.int64)


def encode_nvfp4_ds_mla_row(kv_c: Tensor, k_pe: Tensor) -> Tensor:
    """[T, 512] latent + [T, 64] rope (model dtype) -> [T, 352] nvfp4_ds_mla rows (uint8)."""
    if kv_c.dim() != 2 or kv_c.shape[-1] != Nvfp4DsMla.LATENT_DIM or k_pe.dim() != 2 \
            or k_pe.shape[-1] != Nvfp4DsMla.ROPE_DIM or k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(
            f"nvfp4_ds_mla needs kv_c [T, 512] and k_pe [T, 64]; got {tuple(kv_c.shape)}, "
            f"{tuple(k_pe.shape)}"
        )
    T = kv_c.shape[0]
    nb, bs = Nvfp4DsMla.NUM_BLOCKS, Nvfp4DsMla.BLOCK_SIZE
    sbytes = nvfp4_block_scale_bytes(kv_c)
    svals = sbytes.view(torch.float8_e4m3fn).float()
    x = kv_c.float().reshape(T, nb, bs)
    # x * (1 / s) in fp32, not x / s: vLLM's writer multiplies by the exact
    # reciprocal of the block scale and the two differ at e2m1 rounding ties.
    codes = e2m1_codes(x * (1.0 / svals)[:, :, None])
    codes = torch.where((sbytes == Nvfp4DsMla.NAN_SCALE_BYTE)[:, :, None], torch.zeros_like(codes), codes)
    codes = codes.reshape(T, Nvfp4DsMla.LATENT_DIM).to(torch.int32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # element 2j in the low nibble
    out = torch.empty(T, Nvfp4DsMla.ENTRY_BYTES, dtype=torch.uint8)
    out[:, Nvfp4DsMla.LATENT_OFFSET:Nvfp4DsMla.LATENT_OFFSET + Nvfp4DsMla.LATENT_DIM // 2] = packed
    rope = k_pe.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, Nvfp4DsMla.ROPE_OFFSET:Nvfp4DsMla.SCALE_OFFSET] = rope
    out[:, _scale_positions()] = sbytes
    return out


def decode_nvfp4_ds_mla_row(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[T, 352] uint8 -> (kv_c float32 [T, 512], k_pe float32 [T, 64],
    block scales float32 [T, 32] in block order). Every value is exact in fp32
    (and in bf16/fp16: at most 6 significant bits, within their ranges)."""
    rows = rows.contiguous().view(torch.uint8)
    T = rows.shape[0]
    if rows.dim() != 2 or rows.shape[1] != Nvfp4DsMla.ENTRY_BYTES:
        raise ValueError(f"rows: expected [T, {Nvfp4DsMla.ENTRY_BYTES}] uint8, got {tuple(rows.shape)}")
    sbytes = rows[:, _scale_positions()]
    scales = sbytes.contiguous().view(torch.float8_e4m3fn).float()
    packed = rows[:, Nvfp4DsMla.LATENT_OFFSET:Nvfp4DsMla.LATENT_OFFSET + Nvfp4DsMla.LATENT_DIM // 2]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(T, Nvfp4DsMla.LATENT_DIM)
    vals = decode_e2m1(codes).reshape(T, Nvfp4DsMla.NUM_BLOCKS, Nvfp4DsMla.BLOCK_SIZE)
    kv_c = (vals * scales[:, :, None]).reshape(T, Nvfp4DsMla.LATENT_DIM)
    rope = rows[:, Nvfp4DsMla.ROPE_OFFSET:Nvfp4DsMla.SCALE_OFFSET].contiguous()
    k_pe = rope.view(torch.float8_e4m3fn).float()
    return kv_c, k_pe, scales


def decode_cache_rows(rows: Tensor, kv_cache_dtype: str, k_scale: Tensor | None = None) -> Tensor:
    """Cache entries [T, entry] of any format -> float32 [T, L + R] (CPU), what a
    dequantizing gather writes before its rounding to the dst dtype. Per-tensor
    fp8 formats need the K scale they were written with."""
    fmt = get_format(kv_cache_dtype)
    if fmt.quant_mode == QuantMode.FP8_PER_TILE:
        kv_c, k_pe, _ = decode_ds_mla_row(rows)
        return torch.cat([kv_c, k_pe.float()], dim=-1)
    if fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        kv_c, k_pe, _ = decode_nvfp4_ds_mla_row(rows)
        return torch.cat([kv_c, k_pe], dim=-1)
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        if k_scale is None:
            raise ValueError(f"k_scale: {fmt.name!r} rows need the per-tensor K scale they were written with")
        return dequantize_fp8_bytes(rows, fmt.fp8_dtype) * k_scale.cpu().float().reshape(())
    return rows.float()


def _encode_rows(kv_c: Tensor, k_pe: Tensor, fmt, cache_dtype: torch.dtype, k_scale) -> Tensor:
    """New tokens -> cache entries of `fmt` (dtype of the cache)."""
    if fmt.quant_mode == QuantMode.FP8_PER_TILE:
        return encode_ds_mla_row(kv_c, k_pe).view(cache_dtype)
    if fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        return encode_nvfp4_ds_mla_row(kv_c, k_pe).view(cache_dtype)
    row = torch.cat([kv_c.float(), k_pe.float()], dim=-1)
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        return quantize_fp8_per_tensor(row, k_scale, fmt.fp8_dtype).view(cache_dtype)
    return torch.cat([kv_c, k_pe], dim=-1).to(cache_dtype)


def concat_and_cache_mla_ref(
    kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, kv_cache_dtype: str,
    k_scale: Tensor,
) -> None:
    """Writes token t to `kv_cache[slot // B, slot % B]`; negative or too-large slots are skipped."""
    fmt = get_format(kv_cache_dtype)
    num_blocks, B = kv_cache.shape[0], kv_cache.shape[1]
    rows = _encode_rows(kv_c, k_pe, fmt, kv_cache.dtype, k_scale)
    for t, slot in enumerate(slot_mapping.tolist()):
        if 0 <= slot < num_blocks * B:
            kv_cache[slot // B, slot % B] = rows[t]


def _decode_rows(rows: Tensor, fmt, out_dtype: torch.dtype, out_width: int, k_scale) -> Tensor:
    """Cache entries -> `out_dtype` rows: dequantized, or raw when dtypes match."""
    if rows.dtype == out_dtype:  # native copy or fp8 passthrough: bytes unchanged
        return rows
    if fmt.quant_mode == QuantMode.FP8_PER_TILE:
        kv_c, k_pe, _ = decode_ds_mla_row(rows)
        full = torch.cat([kv_c, k_pe.float()], dim=-1)[:, :out_width]
        return full.to(out_dtype)
    if fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        kv_c, k_pe, _ = decode_nvfp4_ds_mla_row(rows)
        return torch.cat([kv_c, k_pe], dim=-1)[:, :out_width].to(out_dtype)
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        vals = dequantize_fp8_bytes(rows, fmt.fp8_dtype) * k_scale.float().reshape(())
        return vals.to(out_dtype)
    raise ValueError(f"dst: a native {rows.dtype} cache cannot be gathered into {out_dtype}")


def _gather_rows(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int,
    seq_starts: Tensor | None, convert,
) -> None:
    num_blocks, B = src_cache.shape[0], src_cache.shape[1]
    width = block_table.shape[1]
    cu = cu_seq_lens.tolist()
    starts = seq_starts.tolist() if seq_starts is not None else [0] * num_reqs
    bt = block_table.tolist()
    n_dst = dst.shape[0]
    for r in range(num_reqs):
        lo, hi = max(cu[r], 0), min(cu[r + 1], n_dst)
        for row in range(lo, hi):
            tok = starts[r] + (row - cu[r])
            lb = tok // B if tok >= 0 else -1
            pb = bt[r][lb] if 0 <= lb < width else -1
            if 0 <= pb < num_blocks:
                dst[row] = convert(src_cache[pb, tok % B][None])[0]
            else:
                dst[row] = 0


def gather_ref(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int,
    kv_cache_dtype: str, k_scale: Tensor, seq_starts: Tensor | None = None,
) -> None:
    """dst[cu[r] + i] = dequant(cache token seq_starts[r] + i of request r), for r < num_reqs."""
    fmt = get_format(kv_cache_dtype)
    _gather_rows(
        src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts,
        lambda rows: _decode_rows(rows, fmt, dst.dtype, dst.shape[1], k_scale),
    )


def cp_gather_ref(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int,
    seq_starts: Tensor | None = None,
) -> None:
    """Raw gather: same rows as gather_ref, bytes copied unchanged (dst.dtype == cache dtype)."""
    _gather_rows(src_cache, dst, block_table, cu_seq_lens, num_reqs, seq_starts, lambda rows: rows)


def compute_kv_scale_ref(kv_c: Tensor, k_pe: Tensor, kv_cache_dtype: str) -> Tensor:
    """Per-tensor K scale [1] float32: max(amax(|kv_c|, |k_pe|) / fp8_max, MIN_KV_SCALE).

    Non-finite values (NaN, ±inf) are ignored by the amax, so the scale is
    always finite and > 0. fp8_ds_mla and nvfp4_ds_mla keep their scales inside
    the rows: 1.0.
    Native formats have no scale: ValueError.
    """
    fmt = get_format(kv_cache_dtype)
    if fmt.quant_mode == QuantMode.NONE:
        raise ValueError(
            f"kv_cache_dtype: layer is not quantized ({fmt.name!r}); it computes no KV scale"
        )
    if fmt.quant_mode != QuantMode.FP8_PER_TENSOR:
        return torch.ones(1, dtype=torch.float32)
    vals = torch.cat([kv_c.float().reshape(-1), k_pe.float().reshape(-1)]).abs()
    vals = torch.where(torch.isfinite(vals), vals, torch.zeros_like(vals))
    amax = vals.max() if vals.numel() else torch.zeros((), dtype=torch.float32)
    scale = torch.clamp(amax / fp8_max(fmt.fp8_dtype), min=MIN_KV_SCALE)
    return scale.reshape(1).to(torch.float32)
