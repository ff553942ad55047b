"""Triton gather of paged latent-cache rows with the dequant fused (SPEC §2, §6).

One kernel, `_gather_paged_kernel` (the dispatcher's "triton_paged" backend).
It maps a program's BLOCK_R dst rows to their cache rows once (a vectorised
binary search over cu_seq_lens, one block-table load per row: rows of a page
share the address), then issues every load of the program's tile before its
first store: the whole fp8_ds_mla / nvfp4_ds_mla row (latent, scales, k_pe) as
3-D / 2-D tiles, and for the other formats the row's tail chunk (576 = 512 +
64) together with its first main chunk; fp8 bytes are converted by the hardware
(bitcast to float8e4nv / float8e5) on sm_89+, by integer moves elsewhere and in
the interpreter; nvfp4 nibbles are split with tl.join and the permuted block
scales put in order with one tile transpose instead of per-value byte loads.

The kernel serves every format; a constexpr MODE picks the row decoder:
  COPY   dst.dtype == cache dtype: native bf16/fp16/fp32 copy, or raw fp8 bytes;
  E4M3 / E5M2   per-tensor fp8 bytes x k_scale;
  DS_MLA  fp8_ds_mla 656-byte rows: 4 x 128 e4m3 values x their fp32 tile scale,
          then 64 bf16 k_pe copied bit-exactly.
  NVFP4_DS_MLA  nvfp4_ds_mla 352-byte rows: 512 e2m1 nibbles x the e4m3 scale of
          their 16-value block (read at its permuted byte), then 64 e4m3 k_pe.
          Every product is exact, so the stores round nothing.

Semantics are those of `reference.gather_ref`, including its out-of-range
policy: a row whose token is negative, lies in a logical block past the table
width, or maps to a block id outside [0, num_blocks) is written as zeros, and
no load touches memory for it (loads are masked and their indices clamped).
Rows of dst outside [cu_seq_lens[0], cu_seq_lens[num_reqs]) are untouched.

No host sync: each row finds its request by a binary search over cu_seq_lens
inside the kernel, and k_scale is read on the device, so a launch is
CUDA-graph capturable. Programs whose rows all lie past cu_seq_lens[num_reqs]
(dst can be a whole workspace) exit after one load.

fp8 bytes are decoded with integer ops instead of `tl.float8e4nv` casts
because Triton's e4m3 conversion does not exist before sm_89 and sm_86 is a
target: e4m3 bits shifted into an fp16 (same layout with 3 more exponent bits)
and scaled by 2^8 give the exact value, subnormals included; e5m2 is the high
byte of an fp16. The ds_mla scales and k_pe are read through fp32 / bf16
views of the same bytes when every row starts at a multiple of 4 bytes (any
whole cache tensor); otherwise (a view at an odd offset into a larger byte
buffer) they are assembled from single bytes and bitcast, bit-exactly too.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from mla_ext.config.formats import DsMla, Nvfp4DsMla, QuantMode, get_format

try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # pragma: no cover - depends on the install
    triton = None
    _TRITON_IMPORT_ERROR = str(_exc)
else:
    _TRITON_IMPORT_ERROR = None
    from mla_ext.triton_fp8 import e2m1_to_f32, e4m3_to_f32, e5m2_to_f32, launch_guard

# The MODE 3 (fp8_ds_mla) branch of the kernel spells the row layout as
# literals (512 latent bytes, scales at byte 512 = fp32 index 128, k_pe at
# byte 528 = bf16 index 264, 4 tiles of 128, 64 rope values): Triton's
# interpreter does not take module-level constexprs there. They must be the
# layout formats.DsMla defines (the one Python mirror of cache_layout.h).
assert (DsMla.LATENT_DIM, DsMla.SCALE_OFFSET, DsMla.ROPE_OFFSET, DsMla.NUM_TILES,
        DsMla.TILE_SIZE, DsMla.ROPE_DIM) == (512, 512, 528, 4, 128, 64), "update _gather_paged_kernel"
# Likewise MODE 4 (nvfp4_ds_mla): e2m1 pairs at byte 0, 64 e4m3 k_pe at 256,
# block scales at 320 + 8 * (s & 3) + (s >> 2), 16 values per block.
assert (Nvfp4DsMla.LATENT_OFFSET, Nvfp4DsMla.ROPE_OFFSET, Nvfp4DsMla.SCALE_OFFSET, Nvfp4DsMla.BLOCK_SIZE,
        Nvfp4DsMla.ROPE_DIM, Nvfp4DsMla.LATENT_DIM) == (0, 256, 320, 16, 64, 512), "update _gather_paged_kernel"
assert all(Nvfp4DsMla.scale_byte(s) == 8 * (s & 3) + (s >> 2) for s in range(32)), "update _gather_paged_kernel"

MODE_COPY, MODE_E4M3, MODE_E5M2, MODE_DS_MLA, MODE_NVFP4_DS_MLA = 0, 1, 2, 3, 4
_FLOAT_DSTS = (torch.bfloat16, torch.float16, torch.float32)
_NATIVE_SRCS = (torch.bfloat16, torch.float16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    @triton.jit
    def _window_sources(cu_ptr, starts_ptr, bt_ptr, row0, num_reqs, num_blocks, block_size, max_blocks,
                        dst_rows, search_steps, bt_s0, bt_s1, HAS_STARTS: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rows row0 + [0, BLOCK_R) of dst: (rows, live, ok, blk, slot). live: a request owns
        the row; ok: it has a cache row (block blk, slot); other rows get blk = slot = 0, so
        even a masked address stays inside the cache."""
        total = tl.load(cu_ptr + num_reqs)
        first = tl.load(cu_ptr)
        rows = row0 + tl.arange(0, BLOCK_R)
        live = (rows >= first) & (rows < total) & (rows < dst_rows)
        # Request of each row: the largest r with cu[r] <= row. lo stays in [0, num_reqs - 1]
        # whatever cu holds, so every index below is in range.
        lo = tl.zeros([BLOCK_R], dtype=tl.int32)
        hi = tl.zeros([BLOCK_R], dtype=tl.int32) + num_reqs
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            at_mid = tl.load(cu_ptr + mid, mask=live, other=0)
            right = at_mid <= rows
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        req = lo.to(tl.int64)
        tok = rows - tl.load(cu_ptr + req, mask=live, other=0)
        if HAS_STARTS:
            tok += tl.load(starts_ptr + req, mask=live, other=0)
        lblk = tl.where(tok >= 0, tok // block_size, -1)
        in_table = live & (lblk >= 0) & (lblk < max_blocks)
        lblk = tl.where(in_table, lblk, 0).to(tl.int64)
        blk = tl.load(bt_ptr + req * bt_s0 + lblk * bt_s1, mask=in_table, other=-1)
        ok = in_table & (blk >= 0) & (blk < num_blocks)
        blk = tl.where(ok, blk, 0).to(tl.int64)
        slot = tl.where(ok, tok % block_size, 0).to(tl.int64)
        return rows, live, ok, blk, slot

    @triton.jit
    def _fp8_decode(b, E5M2: tl.constexpr, HW_FP8: tl.constexpr):
        """uint8 fp8 bits -> float32, exact: the hardware conversion on sm_89+, else integer moves."""
        if HW_FP8:
            if E5M2:
                v = b.to(tl.float8e5, bitcast=True).to(tl.float32)
            else:
                v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            if E5M2:
                v = e5m2_to_f32(b.to(tl.int32))
            else:
                v = e4m3_to_f32(b.to(tl.int32))
        return v

    # ptxas (Triton 3.8, the launch configs of _paged_tiles): 52-111 registers on
    # sm_86 and sm_90a, no spills (tests/cache/test_cache_paged_gather.py checks it).
    # register budget: 128
    @triton.jit(do_not_specialize=["num_reqs", "max_blocks", "dst_rows", "search_steps", "bt_s0"])  # batch-varying: no re-compile
    def _gather_paged_kernel(
        src_ptr, src_f32_ptr, src_bf16_ptr, dst_ptr, bt_ptr, cu_ptr, starts_ptr, scale_ptr,
        num_reqs, num_blocks, block_size, max_blocks, dst_rows, n_cols, search_steps,
        s_blk, s_ent, s_col, bt_s0, bt_s1, d_row, d_col,
        MODE: tl.constexpr, HAS_STARTS: tl.constexpr, ALIGNED: tl.constexpr, HW_FP8: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TAIL_C: tl.constexpr,
    ):
        row0 = tl.program_id(0) * BLOCK_R
        if row0 < tl.load(cu_ptr + num_reqs):
            rows, live, ok, blk, slot = _window_sources(
                cu_ptr, starts_ptr, bt_ptr, row0, num_reqs, num_blocks, block_size, max_blocks, dst_rows,
                search_steps, bt_s0, bt_s1, HAS_STARTS, BLOCK_R)
            src_row = src_ptr + blk * s_blk + slot * s_ent
            dst_row = dst_ptr + rows.to(tl.int64) * d_row
            ok2 = ok[:, None]
            live2 = live[:, None]
            if MODE == 3:
                # fp8_ds_mla: latent [R, 4 tiles, 128], scales [R, 4], k_pe [R, 64], all loaded first.
                ok3 = ok[:, None, None]
                lat = tl.arange(0, 4)[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
                b = tl.load(src_row[:, None, None] + lat * s_col, mask=ok3, other=0)
                k = tl.arange(0, 64)[None, :]
                t4 = tl.arange(0, 4)[None, :]
                pe_cm = (512 + k) < n_cols
                if ALIGNED:
                    row4 = blk * (s_blk // 4) + slot * (s_ent // 4)
                    row2 = blk * (s_blk // 2) + slot * (s_ent // 2)
                    sc = tl.load(src_f32_ptr + row4[:, None] + (128 + t4), mask=ok2, other=0.0)
                    pe = tl.load(src_bf16_ptr + row2[:, None] + (264 + k), mask=ok2 & pe_cm, other=0.0)
                else:
                    sb = src_row[:, None] + (512 + 4 * t4) * s_col
                    bits = tl.load(sb, mask=ok2, other=0).to(tl.int32)
                    bits |= tl.load(sb + s_col, mask=ok2, other=0).to(tl.int32) << 8
                    bits |= tl.load(sb + 2 * s_col, mask=ok2, other=0).to(tl.int32) << 16
                    bits |= tl.load(sb + 3 * s_col, mask=ok2, other=0).to(tl.int32) << 24
                    sc = bits.to(tl.float32, bitcast=True)
                    pb = src_row[:, None] + (528 + 2 * k) * s_col
                    lo_b = tl.load(pb, mask=ok2 & pe_cm, other=0).to(tl.int32)
                    hi_b = tl.load(pb + s_col, mask=ok2 & pe_cm, other=0).to(tl.int32)
                    pe = (lo_b | (hi_b << 8)).to(tl.int16).to(tl.bfloat16, bitcast=True)
                v = _fp8_decode(b, False, HW_FP8) * sc[:, :, None]
                v = tl.where(ok3, v, 0.0)
                tl.store(dst_row[:, None, None] + lat * d_col, v, mask=live[:, None, None])
                tl.store(dst_row[:, None] + (512 + k) * d_col, pe.to(tl.float32), mask=live2 & pe_cm)
            elif MODE == 4:
                # nvfp4_ds_mla: 256 code bytes, 32 scale bytes, 64 k_pe bytes per row, all loaded first.
                k256 = tl.arange(0, 256)[None, :]
                q = tl.arange(0, 32)[None, :]
                k64 = tl.arange(0, 64)[None, :]
                codes = tl.load(src_row[:, None] + k256 * s_col, mask=ok2, other=0).to(tl.int32)
                sbytes = tl.load(src_row[:, None] + (320 + q) * s_col, mask=ok2, other=0)
                rb = tl.load(src_row[:, None] + (256 + k64) * s_col, mask=ok2, other=0)
                # The scale of block s sits at byte 8 (s & 3) + (s >> 2): as [R, s & 3, s >> 2] the
                # bytes are the transpose of the block order [R, s >> 2, s & 3].
                sbt = tl.reshape(tl.permute(tl.reshape(sbytes, (BLOCK_R, 4, 8)), (0, 2, 1)), (BLOCK_R, 32))
                scale = _fp8_decode(sbt, False, HW_FP8)
                # Element 2 j is the low nibble of byte j, element 2 j + 1 the high one.
                nib = tl.reshape(tl.join(codes & 0xF, codes >> 4), (BLOCK_R, 512))
                v = tl.reshape(e2m1_to_f32(nib), (BLOCK_R, 32, 16)) * scale[:, :, None]
                v = tl.where(ok[:, None, None], v, 0.0)
                s3 = tl.arange(0, 32)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
                tl.store(dst_row[:, None, None] + s3 * d_col, v, mask=live[:, None, None])
                pe = tl.where(ok2, _fp8_decode(rb, False, HW_FP8), 0.0)
                tl.store(dst_row[:, None] + (512 + k64) * d_col, pe, mask=live2)
            else:
                if MODE != 0:
                    k_scale = tl.load(scale_ptr)
                    # An invalid scale (NaN, inf, <= 0) gives NaN rows, as in the C++ kernels.
                    k_scale = tl.where((k_scale > 0.0) & (k_scale <= 3.4028234663852886e38), k_scale, float("nan"))
                n_main = (n_cols // BLOCK_C) * BLOCK_C
                if TAIL_C > 0:
                    # The tail columns are loaded ahead, with the first main chunk.
                    tcols = n_main + tl.arange(0, TAIL_C)
                    tcm = (tcols < n_cols)[None, :]
                    xt = tl.load(src_row[:, None] + tcols[None, :] * s_col, mask=ok2 & tcm, other=0)
                for c0 in range(0, n_main, BLOCK_C):
                    cols = c0 + tl.arange(0, BLOCK_C)
                    x = tl.load(src_row[:, None] + cols[None, :] * s_col, mask=ok2, other=0)
                    if MODE != 0:
                        x = tl.where(ok2, _fp8_decode(x, MODE == 2, HW_FP8) * k_scale, 0.0)
                    tl.store(dst_row[:, None] + cols[None, :] * d_col, x, mask=live2)
                if TAIL_C > 0:
                    if MODE != 0:
                        xt = tl.where(ok2, _fp8_decode(xt, MODE == 2, HW_FP8) * k_scale, 0.0)
                    tl.store(dst_row[:, None] + tcols[None, :] * d_col, xt, mask=live2 & tcm)


def _mode(fmt, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> int:
    if dst_dtype == src_dtype:
        return MODE_COPY
    if fmt.quant_mode == QuantMode.FP8_PER_TILE:
        return MODE_DS_MLA
    if fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        return MODE_NVFP4_DS_MLA
    return MODE_E4M3 if fmt.fp8_dtype == torch.float8_e4m3fn else MODE_E5M2


def triton_not_supported_reasons(src_cache: Tensor, dst: Tensor, kv_cache_dtype: str) -> list[str]:
    """Why `gather_triton` cannot serve these tensors (empty list: it can)."""
    why: list[str] = []
    if triton is None:
        why.append(f"triton is not importable ({_TRITON_IMPORT_ERROR})")
    if _interpreting():
        if src_cache.device.type != "cpu" or dst.device.type != "cpu":
            why.append("TRITON_INTERPRET is set: tensors must be on the CPU")
    elif src_cache.device.type != "cuda" or dst.device.type != "cuda":
        why.append("tensors are not on CUDA (and TRITON_INTERPRET is not set)")
    if src_cache.device != dst.device:
        why.append(f"src_cache is on {src_cache.device} but dst on {dst.device}")
    try:
        fmt = get_format(kv_cache_dtype)
    except ValueError as exc:
        return why + [str(exc)]
    if src_cache.dim() != 3 or dst.dim() != 2:
        return why + ["src_cache must be [num_blocks, block_size, entry] and dst [T, E]"]
    entry, width = src_cache.shape[2], dst.shape[1]
    if fmt.is_native:
        if src_cache.dtype not in _NATIVE_SRCS:
            why.append(f"native cache dtype {src_cache.dtype} is not bf16/fp16/fp32")
        if dst.dtype != src_cache.dtype:
            why.append(f"a native {src_cache.dtype} cache gathers only into {src_cache.dtype}")
    elif fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        if src_cache.dtype != torch.uint8:
            why.append(f"nvfp4_ds_mla cache must be uint8 bytes, got {src_cache.dtype}")
        if dst.dtype not in _FLOAT_DSTS and dst.dtype != src_cache.dtype:
            why.append(f"dst dtype {dst.dtype} is not bf16/fp16/fp32 (or the cache's, raw)")
    else:
        if src_cache.dtype not in (torch.uint8, fmt.fp8_dtype):
            why.append(f"fp8 cache must be uint8 bytes (or {fmt.fp8_dtype}), got {src_cache.dtype}")
        if dst.dtype not in _FLOAT_DSTS and dst.dtype != src_cache.dtype:
            why.append(f"dst dtype {dst.dtype} is not bf16/fp16/fp32 (or the cache's, raw)")
    decoding = dst.dtype != src_cache.dtype
    if decoding and fmt.quant_mode == QuantMode.FP8_PER_TILE:
        if entry != DsMla.ENTRY_BYTES or width > DsMla.LATENT_DIM + DsMla.ROPE_DIM:
            why.append(f"fp8_ds_mla needs entry {DsMla.ENTRY_BYTES} and dst width <= 576; "
                       f"got entry {entry}, width {width}")
    elif decoding and fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        if entry != Nvfp4DsMla.ENTRY_BYTES or width != Nvfp4DsMla.LATENT_DIM + Nvfp4DsMla.ROPE_DIM:
            why.append(f"nvfp4_ds_mla needs entry {Nvfp4DsMla.ENTRY_BYTES} and dst width 576; "
                       f"got entry {entry}, width {width}")
    elif width != entry:
        why.append(f"dst width {width} differs from the cache entry width {entry}")
    return why


def _paged_tiles(mode: int, out_bytes: int, n_cols: int, dst_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_C, TAIL_C, num_warps) of the paged kernel.

    BLOCK_C: the largest power of two <= n_cols, at most 512 columns; TAIL_C: the
    next power of two >= the n_cols % BLOCK_C columns left (0: none), loaded
    together with the first main chunk. On a GPU a [16-32, 512] byte tile gives
    each of 128-256 threads four or more 16-byte loads before its first store.
    The interpreter pays per program: big row tiles there. out_bytes: dst element size."""
    block_c = 1
    while block_c * 2 <= min(n_cols, 512):
        block_c *= 2
    rest = n_cols % block_c
    tail = 0 if rest == 0 else 1 << (rest - 1).bit_length()
    if _interpreting():
        return 64, block_c, tail, 4
    # One warp per 4 rows: a 512-byte row chunk is 4 x 16 bytes per thread (fp8
    # sources; 8 x 16 for 16-bit copies); 32-row tiles once dst is large. fp32
    # outputs of a dequant hold twice the register bytes: twice the warps.
    rows = 32 if dst_rows >= 65536 else 16
    warps = rows // 4 * (2 if out_bytes == 4 and mode != MODE_COPY else 1)
    return rows, block_c, tail, warps


_HW_FP8: dict[int, bool] = {}


def _hw_fp8(device: torch.device) -> bool:
    """Triton's float8e4nv / float8e5 conversions exist on sm_89+ (not in the interpreter)."""
    if device.type != "cuda" or _interpreting():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _HW_FP8:
        _HW_FP8[idx] = torch.cuda.get_device_capability(idx) >= (8, 9)
    return _HW_FP8[idx]


def _i32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def gather_triton(
    src_cache: Tensor, dst: Tensor, block_table: Tensor, cu_seq_lens: Tensor, num_reqs: int,
    kv_cache_dtype: str, k_scale: Tensor | None, seq_starts: Tensor | None = None,
    block_rows: int | None = None,
) -> Tensor:
    """dst[cu[r] + i] = dequant(cache token seq_starts[r] + i of request r); returns dst.

    Argument values are not checked here (that is `checks.py`'s job, in the
    public op); any value is memory-safe. `block_rows` overrides the tile height.
    """
    why = triton_not_supported_reasons(src_cache, dst, kv_cache_dtype)
    if why:
        raise ValueError("gather_triton: " + "; ".join(why))
    out = dst
    num_reqs = int(num_reqs)
    if num_reqs <= 0 or dst.shape[0] == 0 or dst.shape[1] == 0:
        return out
    if cu_seq_lens.numel() < num_reqs + 1:
        raise ValueError(f"cu_seq_lens: expected at least num_reqs + 1 = {num_reqs + 1} "
                         f"entries, got {cu_seq_lens.numel()}")
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table: expected [>= {num_reqs}, max_blocks], "
                         f"got {tuple(block_table.shape)}")
    if seq_starts is not None and seq_starts.numel() < num_reqs:
        raise ValueError(f"seq_starts: expected at least {num_reqs} entries, "
                         f"got {seq_starts.numel()}")
    fmt = get_format(kv_cache_dtype)
    mode = _mode(fmt, src_cache.dtype, dst.dtype)
    if src_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # Work on the bytes: Triton's fp8 pointer types do not exist before sm_89.
        if dst.dtype == src_cache.dtype:
            dst = dst.view(torch.uint8)
        src_cache = src_cache.view(torch.uint8)
    cu = _i32(cu_seq_lens)
    starts = _i32(seq_starts) if seq_starts is not None else cu
    if mode in (MODE_E4M3, MODE_E5M2):
        if k_scale is None or k_scale.numel() < 1:
            raise ValueError("k_scale: per-tensor fp8 needs a float32 tensor of 1 element")
        scale = k_scale.to(torch.float32).reshape(-1)
    else:
        scale = cu  # unread
    bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    if block_table.shape[1] == 0:
        bt = torch.full((num_reqs, 1), -1, dtype=torch.int32, device=dst.device)

    # fp8_ds_mla: when the rows sit at 4-byte multiples (always, for a whole cache
    # tensor: 656 = 4 x 164), read scales and k_pe through fp32 / bf16 views.
    aligned = (mode == MODE_DS_MLA and src_cache.stride(2) == 1 and src_cache.stride(0) % 4 == 0
               and src_cache.stride(1) % 4 == 0 and src_cache.storage_offset() % 4 == 0)
    src_f32 = src_cache.view(torch.float32) if aligned else src_cache
    src_bf16 = src_cache.view(torch.bfloat16) if aligned else src_cache
    rows, block_c, tail_c, warps = _paged_tiles(mode, dst.element_size(), dst.shape[1], dst.shape[0])
    rows = block_rows or rows
    grid = (triton.cdiv(dst.shape[0], rows),)
    with launch_guard(dst):
        _gather_paged_kernel[grid](
            src_cache, src_f32, src_bf16, dst, bt, cu, starts, scale,
            num_reqs, src_cache.shape[0], src_cache.shape[1], block_table.shape[1],
            dst.shape[0], dst.shape[1], max(num_reqs.bit_length(), 1),
            src_cache.stride(0), src_cache.stride(1), src_cache.stride(2),
            bt.stride(0), bt.stride(1), dst.stride(0), dst.stride(1),
            MODE=mode, HAS_STARTS=seq_starts is not None, ALIGNED=aligned, HW_FP8=_hw_fp8(dst.device),
            BLOCK_R=rows, BLOCK_C=block_c, TAIL_C=tail_c, num_warps=warps,
        )
    return out
