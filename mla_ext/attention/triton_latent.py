"""Latent-space (absorbed) MLA context attention straight from the paged cache, in Triton.

Multi-query attention in which every head shares one key/value row per
context token, the cached latent itself: q = [q_lat | q_pe] (Dqk = L + R),
k = [kv_c | k_pe], v = kv_c (Dv = L). See mla_ext/attention/latent.py for
the algebra and mla_ext/attention/latent_reference.py for the reference.

One program takes BLOCK_M (query, head) rows of one request: BLOCK_M // BLOCK_H
query tokens x BLOCK_H heads (N rounded up to a power of two; head blocks when N
is larger), all heads of a token side by side since they share every key, and
walks a range of that request's context in BLOCK_N-token tiles. Each tile's rows
are found through the block table and DECODED IN THE LOADER, 128 latent columns
at a time (mla_ext/attention/latent_rows.py: load_latent_slice, the same
decoders as the cache gather, mla_ext/triton_fp8.py), so nothing is gathered
into a workspace and only one slice's decode is live at once:

  NATIVE        bf16 / fp16 / fp32 rows [kv_c | k_pe]
  E4M3 / E5M2   per-tensor fp8 bytes x k_scale (an invalid scale gives NaN, as the gather)
  DS_MLA        fp8_ds_mla: 4 x 128 e4m3 x their fp32 tile scale; 64 bf16 k_pe
  NVFP4_DS_MLA  nvfp4_ds_mla: e2m1 nibbles x the e4m3 scale of their 16-value
                block (at its permuted byte); 64 e4m3 k_pe

On sm_90 a program is 64 rows, one wgmma M, and Triton pipelines the cache-row
loads (cp.async, 2 stages); elsewhere 32 rows of mma.sync (GPU tiles below).

A token outside the cache (a block id outside [0, num_blocks), a logical block
past the table width) reads nothing and is a zero row, which takes part in the
softmax: the gather's documented out-of-range result, so both context paths
give the same answer for the same (bad) table.

The softmax is online, in base 2 (scores pre-multiplied by scale*log2(e)),
LSE stored as a natural log. The context of a request can be split over
`grid[2]` programs (split-KV, for few queries against a long context: one
request's 16 heads x 1 token would otherwise be one program); each split
writes its partial (o, lse) and `combine_splits` merges them.

Interpreter rules (TRITON_INTERPRET=1): operands go to fp32 right after
loading (bf16 arithmetic and dots are wrong there). On a GPU, 16-bit queries
make 16-bit dots (decoded values rounded to the compute dtype, as the gather
rounds them into its workspace), fp32 queries IEEE fp32 dots.
"""
from __future__ import annotations

import os

import torch

from mla_ext.config.formats import DsMla, Nvfp4DsMla, QuantMode, get_format

try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # pragma: no cover - depends on the install
    triton = None
    TRITON_IMPORT_ERROR: str | None = str(_exc)
else:
    TRITON_IMPORT_ERROR = None
    from mla_ext.attention.latent_rows import (load_k_scale, load_latent_pe, load_latent_slice,
                                                online_softmax, softmax_norm)
    from mla_ext.triton_fp8 import launch_guard

LOG2E = 1.4426950408889634
MODE_NATIVE, MODE_E4M3, MODE_E5M2, MODE_DS_MLA, MODE_NVFP4_DS_MLA = 0, 1, 2, 3, 4
# The DS_MLA / NVFP4 branches spell the row layouts as literals (the interpreter
# takes no module-level constexprs there); they must be formats.py's.
assert (DsMla.LATENT_DIM, DsMla.SCALE_OFFSET, DsMla.ROPE_OFFSET, DsMla.TILE_SIZE) == (512, 512, 528, 128), \
    "update _latent_attn_kernel"
assert (Nvfp4DsMla.LATENT_OFFSET, Nvfp4DsMla.ROPE_OFFSET, Nvfp4DsMla.SCALE_OFFSET, Nvfp4DsMla.BLOCK_SIZE) \
    == (0, 256, 320, 16), "update _latent_attn_kernel"
assert all(Nvfp4DsMla.scale_byte(s) == 8 * (s & 3) + (s >> 2) for s in range(32)), "update _latent_attn_kernel"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    @triton.jit
    def _tile_rows(n0, kv_hi, start, b, bt_ptr, bt_s0, bt_s1, num_blocks, block_size, max_blocks, c_blk, c_ent,
                   BLOCK_N: tl.constexpr):
        """The KV tile at context position n0: (in range, element offset of each token's
        cache entry, readable). A token outside the cache reads nothing (a zero row)."""
        j = n0 + tl.arange(0, BLOCK_N)
        n_mask = j < kv_hi
        tok = start + j
        lblk = tl.where(tok >= 0, tok // block_size, -1)
        in_table = n_mask & (lblk >= 0) & (lblk < max_blocks)
        lblk = tl.where(in_table, lblk, 0).to(tl.int64)
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_s0 + lblk * bt_s1, mask=in_table, other=-1)
        ok = in_table & (blk >= 0) & (blk < num_blocks)
        blk = tl.where(ok, blk, 0).to(tl.int64)
        slot = tl.where(ok, tok % block_size, 0).to(tl.int64)
        return n_mask, blk * c_blk + slot * c_ent, ok

    @triton.jit
    def _mm(a, b, IEEE_FP32: tl.constexpr):
        if IEEE_FP32:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _load_q(ptr, tok_q, head, st, sh, r_mask, c0, n_cols, WIDTH: tl.constexpr, LOWP_DOT: tl.constexpr):
        cols = c0 + tl.arange(0, WIDTH)
        x = tl.load(ptr + tok_q[:, None] * st + head[:, None] * sh + cols[None, :],
                    mask=r_mask[:, None] & (cols < n_cols)[None, :], other=0.0)
        if not LOWP_DOT:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _decoded(c_ptr, c32_ptr, row, ok, k_scale, J: tl.constexpr, L: tl.constexpr, MODE: tl.constexpr,
                 BLOCK_N: tl.constexpr, SLICE: tl.constexpr, dtype: tl.constexpr):
        """Slice J of the tile, decoded and rounded to the dots' dtype (what a gathered
        workspace would hold)."""
        return load_latent_slice(c_ptr, c32_ptr, row, ok, k_scale, J, L, MODE, BLOCK_N, SLICE).to(dtype)

    # batch-varying: no re-compile; N: one compile serves every head count of a BLOCK_H
    # register budget: 255
    @triton.jit(do_not_specialize=["max_blocks", "split_len", "bt_s0", "o_ss", "lse_ss", "lse_sh", "N"])
    def _latent_attn_kernel(
        ql_ptr, qp_ptr, c_ptr, c32_ptr, c16_ptr, bt_ptr, cu_q_ptr, cu_k_ptr, st_ptr, ks_ptr,
        o_ptr, lse_ptr,
        qk_scale_log2, N, num_blocks, block_size, max_blocks, split_len,
        ql_st, ql_sh, qp_st, qp_sh, c_blk, c_ent, bt_s0, bt_s1,
        o_ss, o_st, o_sh, lse_ss, lse_sh,
        L: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, HAS_STARTS: tl.constexpr,
        LOWP_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr, SLICE: tl.constexpr,
    ):
        # A program's BLOCK_M rows are BLOCK_M // BLOCK_H query tokens x BLOCK_H heads
        # (BLOCK_H = N rounded up to a power of two, at most BLOCK_M; head blocks along
        # grid[0] when N is larger): the row -> (token, head) split is constant shifts the
        # compiler redoes after the loop. Rows as token * N + head with a runtime N (or a
        # runtime shift) kept every row's int64 offsets live across the loop (40-240 B
        # spilled at 64 rows on sm_90a).
        # The latent is handled in BLOCK_L // SLICE (1, 2 or 4) slices of SLICE columns:
        # query q_j, decoded keys kv_j and accumulator acc_j per slice, so a KV tile is
        # decoded one slice at a time and no [BLOCK_N, BLOCK_L] fp32 tile ever exists.
        tl.static_assert(BLOCK_L == SLICE or BLOCK_L == 2 * SLICE or BLOCK_L == 4 * SLICE)
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        sp = tl.program_id(2)
        head_blocks = tl.cdiv(N, BLOCK_H)
        t_blk = pid_m // head_blocks
        tokens: tl.constexpr = BLOCK_M // BLOCK_H
        q0 = tl.load(cu_q_ptr + b).to(tl.int64)
        q_len = tl.load(cu_q_ptr + b + 1).to(tl.int64) - q0
        k_len = tl.load(cu_k_ptr + b + 1) - tl.load(cu_k_ptr + b)
        if t_blk * tokens >= q_len:
            return
        kv_lo = sp * split_len
        kv_hi = tl.minimum(k_len, kv_lo + split_len)

        r = tl.arange(0, BLOCK_M)
        t = t_blk * tokens + r // BLOCK_H
        head = ((pid_m - t_blk * head_blocks) * BLOCK_H + r % BLOCK_H).to(tl.int64)
        r_mask = (t < q_len) & (head < N)
        tok_q = q0 + t  # int64 query row of the batch
        if LOWP_DOT:
            dt = ql_ptr.dtype.element_ty
        else:
            dt = tl.float32
        qa = _load_q(ql_ptr, tok_q, head, ql_st, ql_sh, r_mask, 0, L, SLICE, LOWP_DOT)
        if BLOCK_L > SLICE:
            qb = _load_q(ql_ptr, tok_q, head, ql_st, ql_sh, r_mask, SLICE, L, SLICE, LOWP_DOT)
        if BLOCK_L > 2 * SLICE:
            qc = _load_q(ql_ptr, tok_q, head, ql_st, ql_sh, r_mask, 2 * SLICE, L, SLICE, LOWP_DOT)
            qd = _load_q(ql_ptr, tok_q, head, ql_st, ql_sh, r_mask, 3 * SLICE, L, SLICE, LOWP_DOT)
        if BLOCK_R > 0:
            qp = _load_q(qp_ptr, tok_q, head, qp_st, qp_sh, r_mask, 0, R, BLOCK_R, LOWP_DOT)
        start = 0
        if HAS_STARTS:
            start = tl.load(st_ptr + b)
        k_scale = load_k_scale(ks_ptr, MODE)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_a = tl.zeros([BLOCK_M, SLICE], tl.float32)
        acc_b = tl.zeros([BLOCK_M, SLICE], tl.float32)
        acc_c = tl.zeros([BLOCK_M, SLICE], tl.float32)
        acc_d = tl.zeros([BLOCK_M, SLICE], tl.float32)
        for n0 in range(kv_lo, kv_hi, BLOCK_N):
            n_mask, row, ok = _tile_rows(n0, kv_hi, start, b, bt_ptr, bt_s0, bt_s1, num_blocks, block_size,
                                         max_blocks, c_blk, c_ent, BLOCK_N)
            # scores, one latent slice at a time (rows are contiguous: the launcher refuses
            # other column strides)
            kv_a = _decoded(c_ptr, c32_ptr, row, ok, k_scale, 0, L, MODE, BLOCK_N, SLICE, dt)
            s = _mm(qa, tl.trans(kv_a), IEEE_FP32)
            if BLOCK_L > SLICE:
                kv_b = _decoded(c_ptr, c32_ptr, row, ok, k_scale, 1, L, MODE, BLOCK_N, SLICE, dt)
                s += _mm(qb, tl.trans(kv_b), IEEE_FP32)
            if BLOCK_L > 2 * SLICE:
                kv_c = _decoded(c_ptr, c32_ptr, row, ok, k_scale, 2, L, MODE, BLOCK_N, SLICE, dt)
                s += _mm(qc, tl.trans(kv_c), IEEE_FP32)
                kv_d = _decoded(c_ptr, c32_ptr, row, ok, k_scale, 3, L, MODE, BLOCK_N, SLICE, dt)
                s += _mm(qd, tl.trans(kv_d), IEEE_FP32)
            if BLOCK_R > 0:
                pe = load_latent_pe(c_ptr, c16_ptr, row, ok, k_scale, L, R, MODE, BLOCK_R).to(dt)
                s += _mm(qp, tl.trans(pe), IEEE_FP32)
            p, alpha, m_i, l_i = online_softmax(s, n_mask, qk_scale_log2, m_i, l_i)
            p = p.to(dt)
            acc_a = acc_a * alpha[:, None] + _mm(p, kv_a, IEEE_FP32)
            if BLOCK_L > SLICE:
                acc_b = acc_b * alpha[:, None] + _mm(p, kv_b, IEEE_FP32)
            if BLOCK_L > 2 * SLICE:
                acc_c = acc_c * alpha[:, None] + _mm(p, kv_c, IEEE_FP32)
                acc_d = acc_d * alpha[:, None] + _mm(p, kv_d, IEEE_FP32)

        inv, lse = softmax_norm(m_i, l_i)
        o_row = o_ptr + sp * o_ss + tok_q[:, None] * o_st + head[:, None] * o_sh
        _store_o(o_row, acc_a, inv, r_mask, 0, L, SLICE)
        if BLOCK_L > SLICE:
            _store_o(o_row, acc_b, inv, r_mask, SLICE, L, SLICE)
        if BLOCK_L > 2 * SLICE:
            _store_o(o_row, acc_c, inv, r_mask, 2 * SLICE, L, SLICE)
            _store_o(o_row, acc_d, inv, r_mask, 3 * SLICE, L, SLICE)
        tl.store(lse_ptr + sp * lse_ss + head * lse_sh + tok_q, lse, mask=r_mask)

    @triton.jit
    def _store_o(o_row, acc, inv, r_mask, c0, L: tl.constexpr, SLICE: tl.constexpr):
        cols = c0 + tl.arange(0, SLICE)
        tl.store(o_row + cols[None, :], (acc * inv[:, None]).to(o_row.dtype.element_ty),
                 mask=r_mask[:, None] & (cols < L)[None, :])


def cache_mode(kv_cache_dtype: str) -> int:
    fmt = get_format(kv_cache_dtype)
    if fmt.quant_mode == QuantMode.FP8_PER_TILE:
        return MODE_DS_MLA
    if fmt.quant_mode == QuantMode.NVFP4_PER_BLOCK:
        return MODE_NVFP4_DS_MLA
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR:
        return MODE_E4M3 if fmt.fp8_dtype == torch.float8_e4m3fn else MODE_E5M2
    return MODE_NATIVE


def _pad(d: int) -> int:
    """A tile width: the next power of two, at least 16 (tl.dot's minimum); 0 stays 0."""
    return max(16, triton.next_power_of_2(d)) if d > 0 else 0


# Tiles (BLOCK_M, BLOCK_N, num_warps, num_stages). Interpreter: it pays per
# program, so few big ones. GPU: measured by compiling ahead of time for L = 512,
# R = 64 with ptxas -v, Triton 3.8 and 3.6 alike (tests/build/test_ptxas_budget.py compiles
# every config the launcher picks and fails on any spill; tests/prefill/test_prefill_absorbed.py
# checks the shared memory and the instructions). The latent is decoded in 128-column
# slices, so a tile's live state is the accumulator [BLOCK_M, 512] fp32 plus one slice:
#
#   WGMMA_TILE  sm_90: 64 query rows = one wgmma M, 8 warps (two warpgroups split each dot's
#               N), 2 stages: Triton pipelines the cache-row loads with cp.async. 223-255
#               registers, no spills in any decoder; 118-144 KB of shared memory.
#   MMA_TILE    mma.sync devices (sm_80/86/89/120, and sm_100 until checked there): 32 rows,
#               2 stages; 168-255 registers, 74-97 KB (fits sm_86's 99 KB).
#   MMA_TILE_NVFP4  the e2m1 decoder on mma.sync: 16 rows (32 x 32 and 32 x 16 spilled
#               4-48 B under Triton 3.6); 164-191 registers, 68 KB.
#   SMALL_TILE  any device whose opt-in shared memory holds none of the above: 58 KB.
#   FP32_TILE   fp32 queries (IEEE fp32 FMA dots): 16 x 16, 72 KB, 224-234 registers.
#
# Before the slices (issue 19) the whole [BLOCK_N, 512] tile was decoded at once: 32-row
# tiles spilled 424-504 B per thread in the fp8_ds_mla / nvfp4_ds_mla decoders and the
# kernel fell back to 16 rows, one stage, mma.sync on every device.
WGMMA_TILE = (64, 32, 8, 2)
MMA_TILE = (32, 32, 8, 2)
MMA_TILE_NVFP4 = (16, 32, 8, 2)
SMALL_TILE = (16, 32, 8, 1)
FP32_TILE = (16, 16, 8, 1)
# The most shared memory each tile takes over the cache formats (bytes, Triton 3.8 and 3.6,
# sm_86 / sm_90a): a device gets a tile only if its measured opt-in limit per block
# (shared_memory_per_block_optin) holds it, never by capability (sm_120 is "newer" than
# sm_90 but has sm_86's 99 KB).
TILE_SMEM = {WGMMA_TILE: 147456, MMA_TILE: 98944, MMA_TILE_NVFP4: 69760, SMALL_TILE: 59392, FP32_TILE: 73728}
# The instruction decides the MMA: wgmma exists on sm_90a only (Triton compiles 64-row dots
# there to wgmma, elsewhere to mma.sync, whose register-held query slices spill at 64 rows:
# 652 B on sm_80; sm_100's tcgen05 is unchecked).
WGMMA_CAPABILITIES = ((9, 0),)
# ... and only where every variant compiles without spills under Triton 3.6 as well as 3.8:
# not for one or two heads per token (BLOCK_H 1-2 spilled 8-92 B under 3.6), which take the
# mma.sync tiles. (nvfp4_ds_mla fits since its e2m1 codes decode in two integer ops,
# triton_fp8.e2m1_to_f32_over_16384; with the five-op decode it spilled 20-224 B.)
WGMMA_MIN_HEADS = 3
SLICE_COLS = 128
MAX_BLOCK_L = 4 * SLICE_COLS  # the widest latent tile the configs above were checked for
# Split-KV: aim for this many programs per SM, and no split shorter than this.
PROGRAMS_PER_SM, MIN_SPLIT_TOKENS = 2, 256


def latent_slice(L: int) -> int:
    """Columns of the latent decoded at a time: 128 (one fp8_ds_mla tile), or the whole
    padded latent when it is narrower."""
    return min(_pad(L), SLICE_COLS)


def gpu_config(fp32: bool, wgmma: bool, smem_optin: int, mode: int, heads: int) -> tuple[int, int, int, int]:
    """The tile for a device (does it have wgmma, its opt-in shared memory per block), a
    cache format and a head count: the first candidate whose shared memory fits."""
    if fp32:
        candidates = [FP32_TILE]  # 72 KB: every sm_80+ device has at least 99 KB
    else:
        candidates = [WGMMA_TILE] if wgmma and heads >= WGMMA_MIN_HEADS else []
        candidates += [MMA_TILE_NVFP4 if mode == MODE_NVFP4_DS_MLA else MMA_TILE, SMALL_TILE]
    for cfg in candidates:
        if TILE_SMEM[cfg] <= smem_optin:
            return cfg
    return candidates[-1]


def head_block(heads: int, block_m: int) -> int:
    """BLOCK_H: the heads of one token in a program, N rounded up to a power of two (at most BLOCK_M)."""
    return min(triton.next_power_of_2(max(heads, 1)), block_m)


def launch_config(max_rows: int, dtype: torch.dtype, device: torch.device, mode: int,
                  heads: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `max_rows` (query, head) rows of a
    layer with `heads` heads reading a cache of MODE `mode`."""
    if interpreting() or device.type != "cuda":
        return max(16, min(64, triton.next_power_of_2(max(max_rows, 1)))), 64, 4, 1
    # One config per dtype, device, cache format and head count, whatever the rows.
    smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    wgmma = tuple(torch.cuda.get_device_capability(device)) in WGMMA_CAPABILITIES
    return gpu_config(dtype == torch.float32, wgmma, smem, mode, heads)


def num_splits(programs: int, max_ctx: int, device: torch.device, block_n: int) -> tuple[int, int]:
    """(splits, split_len): how many programs share one request's context, from
    host numbers only (no sync). One split under the interpreter."""
    if max_ctx <= 0:
        return 1, max(block_n, 1)
    if device.type != "cuda" or interpreting():
        splits = 1
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = -(-PROGRAMS_PER_SM * sms // max(programs, 1))
        splits = max(1, min(want, -(-max_ctx // MIN_SPLIT_TOKENS)))
    split_len = -(-max_ctx // splits)
    split_len = -(-split_len // block_n) * block_n
    return -(-max_ctx // split_len), split_len


def not_supported_reasons(kv_cache: torch.Tensor, q_lat: torch.Tensor, kv_cache_dtype: str) -> list[str]:
    """Why `latent_attention_triton` cannot serve these tensors (empty: it can)."""
    if triton is None:
        return [f"triton is not importable ({TRITON_IMPORT_ERROR})"]
    why = []
    dev = q_lat.device
    if dev.type == "cpu" and not interpreting():
        why.append("CPU tensors need TRITON_INTERPRET=1")
    elif dev.type not in ("cpu", "cuda"):
        why.append(f"tensors are on {dev}; Triton needs CUDA (or the CPU under TRITON_INTERPRET=1)")
    L = q_lat.shape[-1]
    if _pad(L) > MAX_BLOCK_L:
        why.append(f"kv_lora_rank L={L} is above the {MAX_BLOCK_L} the kernel's tiles are sized for "
                   "(the torch path serves it)")
    if kv_cache.dim() != 3 or (kv_cache.shape[2] > 1 and kv_cache.stride(2) != 1):
        why.append(f"kv_cache: expected [num_blocks, block_size, entry] with contiguous entries, got shape "
                   f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    elif cache_mode(kv_cache_dtype) == MODE_DS_MLA:
        ok = (kv_cache.stride(2) == 1 and kv_cache.stride(0) % 4 == 0 and kv_cache.stride(1) % 4 == 0
              and kv_cache.storage_offset() % 4 == 0)
        if not ok:
            why.append("fp8_ds_mla rows must start at 4-byte multiples (a whole cache tensor does); "
                       f"got strides {kv_cache.stride()} and offset {kv_cache.storage_offset()}")
    return why


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def latent_attention_triton(
    q_lat: torch.Tensor,  # [N, T, L] view (any strides, L contiguous), the compute dtype
    q_pe: torch.Tensor,  # [T, N, R] view (any strides, R contiguous)
    kv_cache: torch.Tensor,  # [num_blocks, B, entry]
    kv_cache_dtype: str,
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32 query rows (of q_lat / q_pe)
    cu_seq_lens: torch.Tensor,  # [num_reqs + 1] int32 context offsets (only the lengths are used)
    seq_starts: torch.Tensor | None,  # [num_reqs] int32 first context token of each request
    k_scale: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor,  # [N, T, L], the compute dtype (any strides, L contiguous)
    lse: torch.Tensor,  # [N, T] float32
    max_query_len: int,
    max_context_len: int,
    splits: int | None = None,
) -> None:
    """Fills out (latent output) and lse; arguments are checked by the caller
    (mla_ext.attention.latent). Rows of requests without context get o = 0, lse = -inf.
    `splits` overrides the split-KV count (tests); the launch otherwise picks it."""
    N, T, L = q_lat.shape
    R = q_pe.shape[-1]
    num_reqs = cu_seqlens_q.numel() - 1
    if T == 0 or N == 0 or num_reqs <= 0:
        return
    if max_query_len <= 0 or max_context_len <= 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    mode = cache_mode(kv_cache_dtype)
    cache = kv_cache.view(torch.uint8) if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else kv_cache
    c32 = cache.view(torch.float32) if mode == MODE_DS_MLA else cache
    c16 = cache.view(torch.bfloat16) if mode == MODE_DS_MLA else cache
    if mode in (MODE_E4M3, MODE_E5M2):
        if k_scale is None or k_scale.numel() < 1:
            raise ValueError("k_scale: per-tensor fp8 needs a float32 tensor of 1 element")
        scale_t = k_scale.to(torch.float32).reshape(-1)
    else:
        scale_t = cu_seqlens_q  # unread
    bt = _i32(block_table)
    if bt.shape[1] == 0:
        bt = torch.full((num_reqs, 1), -1, dtype=torch.int32, device=q_lat.device)
    dtype = q_lat.dtype
    block_m, block_n, warps, stages = launch_config(max_query_len * N, dtype, q_lat.device, mode, N)
    block_h = head_block(N, block_m)
    m_tiles = triton.cdiv(max_query_len, block_m // block_h) * triton.cdiv(N, block_h)
    if splits is None:
        splits, split_len = num_splits(m_tiles * num_reqs, max_context_len, q_lat.device, block_n)
    else:
        split_len = -(-max_context_len // max(1, splits))
        split_len = -(-split_len // block_n) * block_n
        splits = -(-max_context_len // split_len)
    if splits == 1:
        o_buf, lse_buf = out, lse
        o_ss, lse_ss = 0, 0
    else:
        o_buf = torch.empty(splits, N, T, L, dtype=torch.float32, device=q_lat.device)
        lse_buf = torch.empty(splits, N, T, dtype=torch.float32, device=q_lat.device)
        o_ss, lse_ss = o_buf.stride(0), lse_buf.stride(0)
    o_view = o_buf if splits == 1 else o_buf[0]  # [N, T, L] strides
    lse_view = lse_buf if splits == 1 else lse_buf[0]
    lowp = (not interpreting()) and dtype in (torch.bfloat16, torch.float16)
    starts = _i32(seq_starts) if seq_starts is not None else cu_seqlens_q
    grid = (m_tiles, num_reqs, splits)
    with launch_guard(q_lat):
        _latent_attn_kernel[grid](
            q_lat, q_pe, cache, c32, c16, bt, _i32(cu_seqlens_q), _i32(cu_seq_lens), starts, scale_t,
            o_buf, lse_buf,
            softmax_scale * LOG2E, N, cache.shape[0], cache.shape[1], block_table.shape[1], split_len,
            q_lat.stride(1), q_lat.stride(0), q_pe.stride(0), q_pe.stride(1),
            cache.stride(0), cache.stride(1), bt.stride(0), bt.stride(1),
            o_ss, o_view.stride(1), o_view.stride(0), lse_ss, lse_view.stride(0),
            L=L, R=R, MODE=mode, HAS_STARTS=seq_starts is not None, LOWP_DOT=lowp,
            IEEE_FP32=dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_L=_pad(L), BLOCK_R=_pad(R), SLICE=latent_slice(L),
            num_warps=warps, num_stages=stages,
        )
    if splits > 1:
        combine_splits(o_buf, lse_buf, out, lse)


def combine_splits(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merges split-KV partials o_parts [S, N, T, L] fp32, lse_parts [S, N, T]
    (SPEC §7 over S sides): splits without keys (lse -inf) weigh nothing; a row
    no split saw gets o = 0, lse = -inf (never NaN)."""
    total = torch.logsumexp(lse_parts, dim=0)  # -inf where every split is -inf
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    w = torch.exp(lse_parts - safe)  # [S, N, T]; exp(-inf) = 0
    out.copy_(torch.einsum("snt,sntl->ntl", w, o_parts))
    lse.copy_(total)
