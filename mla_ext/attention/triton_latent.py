"""Latent-space (absorbed) MLA context attention straight from the paged cache, in Triton.

Multi-query attention in which every head shares one key/value row per
context token, the cached latent itself: q = [q_lat | q_pe] (Dqk = L + R),
k = [kv_c | k_pe], v = kv_c (Dv = L). See mla_ext/prefill/absorbed.py for
the algebra and mla_ext/prefill/absorbed_reference.py for the reference.

One program takes BLOCK_M rows of one request's (query, head) pairs (row =
token * N + head: all heads of a query side by side, since they share every
key) and walks a range of that request's context in BLOCK_N-token tiles. Each
tile's rows are found through the block table and DECODED IN THE LOADER (a
constexpr MODE, the same decoders as the cache gather, mla_ext/triton_fp8.py),
so nothing is gathered into a workspace:

  NATIVE        bf16 / fp16 / fp32 rows [kv_c | k_pe]
  E4M3 / E5M2   per-tensor fp8 bytes x k_scale (an invalid scale gives NaN, as the gather)
  DS_MLA        fp8_ds_mla: 4 x 128 e4m3 x their fp32 tile scale; 64 bf16 k_pe
  NVFP4_DS_MLA  nvfp4_ds_mla: e2m1 nibbles x the e4m3 scale of their 16-value
                block (at its permuted byte); 64 e4m3 k_pe

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

from mla_ext.formats import DsMla, Nvfp4DsMla, QuantMode, get_format

try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # pragma: no cover - depends on the install
    triton = None
    TRITON_IMPORT_ERROR: str | None = str(_exc)
else:
    TRITON_IMPORT_ERROR = None
    from mla_ext.attention.latent_rows import latent_softmax_finish, latent_softmax_step, load_latent_rows
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

    # register budget: 255
    @triton.jit(do_not_specialize=["max_blocks", "split_len", "bt_s0", "o_ss", "lse_ss", "lse_sh"])  # batch-varying: no re-compile
    def _latent_attn_kernel(
        ql_ptr, qp_ptr, c_ptr, c32_ptr, c16_ptr, bt_ptr, cu_q_ptr, cu_k_ptr, st_ptr, ks_ptr,
        o_ptr, lse_ptr,
        qk_scale_log2, N, num_blocks, block_size, max_blocks, split_len,
        ql_st, ql_sh, qp_st, qp_sh, c_blk, c_ent, bt_s0, bt_s1,
        o_ss, o_st, o_sh, lse_ss, lse_sh,
        L: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, HAS_STARTS: tl.constexpr,
        LOWP_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        sp = tl.program_id(2)
        q0 = tl.load(cu_q_ptr + b).to(tl.int64)
        q_len = tl.load(cu_q_ptr + b + 1).to(tl.int64) - q0
        k_len = tl.load(cu_k_ptr + b + 1) - tl.load(cu_k_ptr + b)
        row0 = pid_m * BLOCK_M
        if row0 >= q_len * N:
            return
        kv_lo = sp * split_len
        kv_hi = tl.minimum(k_len, kv_lo + split_len)

        rows = row0 + tl.arange(0, BLOCK_M)
        r_mask = rows < q_len * N
        tok_q = q0 + rows // N  # int64 query row of the batch
        head = (rows % N).to(tl.int64)
        cols = tl.arange(0, BLOCK_L)
        l_mask = cols < L
        q = tl.load(ql_ptr + tok_q[:, None] * ql_st + head[:, None] * ql_sh + cols[None, :],
                    mask=r_mask[:, None] & l_mask[None, :], other=0.0)
        if not LOWP_DOT:
            q = q.to(tl.float32)
        if BLOCK_R > 0:
            rc = tl.arange(0, BLOCK_R)
            rc_mask = rc < R
            qp = tl.load(qp_ptr + tok_q[:, None] * qp_st + head[:, None] * qp_sh + rc[None, :],
                         mask=r_mask[:, None] & rc_mask[None, :], other=0.0)
            if not LOWP_DOT:
                qp = qp.to(tl.float32)
        start = 0
        if HAS_STARTS:
            start = tl.load(st_ptr + b)
        k_scale = 1.0
        if MODE == 1 or MODE == 2:
            k_scale = tl.load(ks_ptr)
            # Not checked on the host (that would sync): an invalid scale gives NaN rows.
            k_scale = tl.where((k_scale > 0.0) & (k_scale <= 3.4028234663852886e38), k_scale, float("nan"))

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(kv_lo, kv_hi, BLOCK_N):
            j = n0 + offs_n
            n_mask = j < kv_hi
            tok = start + j
            lblk = tl.where(tok >= 0, tok // block_size, -1)
            in_table = n_mask & (lblk >= 0) & (lblk < max_blocks)
            lblk = tl.where(in_table, lblk, 0).to(tl.int64)
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_s0 + lblk * bt_s1, mask=in_table, other=-1)
            ok = in_table & (blk >= 0) & (blk < num_blocks)
            blk = tl.where(ok, blk, 0).to(tl.int64)
            slot = tl.where(ok, tok % block_size, 0).to(tl.int64)
            row = blk * c_blk + slot * c_ent  # element offset of the token's entry

            # -- the tile's latent rows kv [BLOCK_N, BLOCK_L] and k_pe [BLOCK_N, BLOCK_R], fp32 --
            # (rows are contiguous: the launcher refuses other column strides)
            kv, pe = load_latent_rows(c_ptr, c32_ptr, c16_ptr, row, ok, k_scale, L, R, MODE, BLOCK_N, BLOCK_L,
                                      BLOCK_R)
            m_i, l_i, acc = latent_softmax_step(q, qp, kv, pe, n_mask, qk_scale_log2, m_i, l_i, acc, LOWP_DOT,
                                                IEEE_FP32, BLOCK_R)

        o, lse = latent_softmax_finish(acc, m_i, l_i)
        tl.store(o_ptr + sp * o_ss + tok_q[:, None] * o_st + head[:, None] * o_sh + cols[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & l_mask[None, :])
        tl.store(lse_ptr + sp * lse_ss + head * lse_sh + tok_q, lse, mask=r_mask)


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
# program, so few big ones. GPU: the accumulator is [BLOCK_M, L] fp32 and the
# decoded tile [BLOCK_N, L]; measured by compiling ahead of time for L = 512,
# R = 64 (triton 3.8, ptxas -v; tests/test_ptxas_budget.py compiles every config
# the launcher picks and tests/test_prefill_absorbed.py checks the shared memory).
# 16-bit: 16 x 32 on 8 warps, one stage: no spills in any decoder (native, fp8,
# fp8_ds_mla, nvfp4_ds_mla; 170-250 registers, 84-88 KB, fits sm_86's 99 KB). The
# earlier 32 x 32 (sm_90) / 32 x 16 (sm_86) spilled 424-504 B per thread in the
# fp8_ds_mla / nvfp4_ds_mla decoders (issue 19); 16 rows decode each KV tile for
# half as many query rows, a cost to weigh on a GPU against the spills
# (benchmarks/bench_absorbed.py). fp32: 16 x 16 (74 KB, no spills). A wider,
# wgmma-sized BLOCK_M needs the latent decoded in slices (not done yet).
GPU_CONFIGS = {  # (dtype is fp32, the device has BIG_SMEM bytes per block) -> config
    (False, True): (16, 32, 8, 1),
    (False, False): (16, 32, 8, 1),
    (True, True): (16, 16, 8, 1),
    (True, False): (16, 16, 8, 1),
}
# Configs needing more than 99 KB of shared memory (none now) go to the devices
# whose measured opt-in limit per block allows them (sm_80: 163 KB, sm_90: 227 KB;
# sm_86, sm_89 and sm_120: 99 KB), never by capability (sm_120 is "newer" but has 99 KB).
BIG_SMEM = 110 * 1024
MAX_BLOCK_L = 512  # the widest latent tile the configs above were checked for
# Split-KV: aim for this many programs per SM, and no split shorter than this.
PROGRAMS_PER_SM, MIN_SPLIT_TOKENS = 2, 256


def launch_config(max_rows: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `max_rows` (query, head) rows."""
    if interpreting() or device.type != "cuda":
        return max(16, min(64, triton.next_power_of_2(max(max_rows, 1)))), 64, 4, 1
    # One config per dtype and device, whatever the rows (one compile per cache format).
    big = torch.cuda.get_device_properties(device).shared_memory_per_block_optin >= BIG_SMEM
    return GPU_CONFIGS[(dtype == torch.float32, big)]


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
    (mla_ext.prefill.absorbed). Rows of requests without context get o = 0, lse = -inf.
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
    block_m, block_n, warps, stages = launch_config(max_query_len * N, dtype, q_lat.device)
    m_tiles = triton.cdiv(max_query_len * N, block_m)
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
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_L=_pad(L), BLOCK_R=_pad(R),
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
