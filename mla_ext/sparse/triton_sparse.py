"""Sparse latent attention straight from the paged cache, in Triton.

Each new token t attends, in latent space (mla_ext/attention/latent.py for the algebra),
exactly the positions listed in indices[t] (request-local index space,
mla_ext/sparse/reference.py): a position below the request's context length is read from
the paged cache through its block-table row and DECODED IN THE LOADER (every cache format,
mla_ext/attention/latent_rows.py, the absorbed kernel's loader); a position in
[ctx, ctx + q_len) is the new token's own latent row (new_kv_c | new_k_pe, unquantized, as
the dense path attends new tokens); -1 and positions past ctx + q_len are no key.

One program: one token x BLOCK_H heads (every head of a token shares its selected keys: the
heads are the dot's M dimension, FlashMLA's sparse-prefill shape), walking the token's list in
BLOCK_N tiles with an online softmax (base 2), LSE stored as a natural log. A token with no
key gets o = 0, lse = -inf. A context position whose block id is outside the cache reads a
zero row that takes part in the softmax (the gather's documented out-of-range result).
Interpreter rules as triton_latent.py: operands in fp32 after loading there.
"""
from __future__ import annotations

import torch

from mla_ext.attention import triton_latent as TL

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
else:
    from mla_ext.attention.latent_rows import (latent_softmax_finish, latent_softmax_step, load_k_scale,
                                                load_latent_rows)
    from mla_ext.triton_fp8 import launch_guard

LOG2E = TL.LOG2E

if triton is not None:

    @triton.jit
    def _sparse_latent_kernel(
        ql_ptr, qp_ptr, c_ptr, c32_ptr, c16_ptr, nkv_ptr, npe_ptr, idx_ptr, req_ptr, ctx_ptr, cuq_ptr, bt_ptr,
        ks_ptr, o_ptr, lse_ptr,
        qk_scale_log2, N, K, num_blocks, block_size, max_blocks,
        ql_st, ql_sh, qp_st, qp_sh, c_blk, c_ent, nkv_s, npe_s, idx_s, bt_s0, o_st, o_sh, lse_sh,
        L: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, LOWP_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        t, heads, h_mask = _program_heads(N, BLOCK_H)
        r = tl.load(req_ptr + t).to(tl.int64)
        ctx = tl.load(ctx_ptr + r)
        q0 = tl.load(cuq_ptr + r)
        n_tok = ctx + tl.load(cuq_ptr + r + 1) - q0  # the request's index space: [0, ctx + q_len)

        cols = tl.arange(0, BLOCK_L)
        l_mask = cols < L
        q, qp = _load_queries(ql_ptr, qp_ptr, t, heads, h_mask, ql_st, ql_sh, qp_st, qp_sh, L, R, LOWP_DOT, BLOCK_L,
                              BLOCK_R)
        if BLOCK_R > 0:
            rc = tl.arange(0, BLOCK_R)
            rc_mask = rc < R
        k_scale = load_k_scale(ks_ptr, MODE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for j0 in range(0, K, BLOCK_N):
            j = j0 + offs_n
            pos = tl.load(idx_ptr + t * idx_s + j, mask=j < K, other=-1)
            valid = (pos >= 0) & (pos < n_tok)
            in_ctx = valid & (pos < ctx)
            lblk = tl.where(in_ctx, pos // block_size, 0)
            in_table = in_ctx & (lblk < max_blocks)
            blk = tl.load(bt_ptr + r * bt_s0 + lblk, mask=in_table, other=-1)
            ok = in_table & (blk >= 0) & (blk < num_blocks)
            row = tl.where(ok, blk, 0).to(tl.int64) * c_blk + tl.where(ok, pos % block_size, 0).to(tl.int64) * c_ent
            kv, pe = load_latent_rows(c_ptr, c32_ptr, c16_ptr, row, ok, k_scale, L, R, MODE, BLOCK_N, BLOCK_L,
                                      BLOCK_R)
            is_new = valid & (pos >= ctx)
            nrow = tl.where(is_new, q0 + pos - ctx, 0).to(tl.int64)
            kvn = tl.load(nkv_ptr + nrow[:, None] * nkv_s + cols[None, :], mask=is_new[:, None] & l_mask[None, :],
                          other=0.0).to(tl.float32)
            kv = tl.where(is_new[:, None], kvn, kv)
            if BLOCK_R > 0:
                pen = tl.load(npe_ptr + nrow[:, None] * npe_s + rc[None, :], mask=is_new[:, None] & rc_mask[None, :],
                              other=0.0).to(tl.float32)
                pe = tl.where(is_new[:, None], pen, pe)
            m_i, l_i, acc = latent_softmax_step(q, qp, kv, pe, valid, qk_scale_log2, m_i, l_i, acc, LOWP_DOT,
                                                IEEE_FP32, BLOCK_R)

        _store_outputs(o_ptr + t * o_st, lse_ptr + t, heads, h_mask, o_sh, lse_sh, acc, m_i, l_i, L, BLOCK_L)

    @triton.jit
    def _program_heads(N, BLOCK_H: tl.constexpr):
        """This program's token t (grid axis 0, int64) and its block of heads (axis 1, int64, with
        the mask of those below N)."""
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = heads < N
        return tl.program_id(0).to(tl.int64), heads.to(tl.int64), h_mask

    @triton.jit
    def _load_queries(ql_ptr, qp_ptr, t, heads, h_mask, ql_st, ql_sh, qp_st, qp_sh, L: tl.constexpr,
                      R: tl.constexpr, LOWP_DOT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
        """Token t's [q_lat | q_pe] rows of BLOCK_H heads (fp32 unless LOWP_DOT: the interpreter's
        bf16 arithmetic is wrong); qp is q, unused, when BLOCK_R == 0."""
        cols = tl.arange(0, BLOCK_L)
        q = tl.load(ql_ptr + t * ql_st + heads[:, None] * ql_sh + cols[None, :],
                    mask=h_mask[:, None] & (cols < L)[None, :], other=0.0)
        if not LOWP_DOT:
            q = q.to(tl.float32)
        qp = q
        if BLOCK_R > 0:
            rc = tl.arange(0, BLOCK_R)
            qp = tl.load(qp_ptr + t * qp_st + heads[:, None] * qp_sh + rc[None, :],
                         mask=h_mask[:, None] & (rc < R)[None, :], other=0.0)
            if not LOWP_DOT:
                qp = qp.to(tl.float32)
        return q, qp

    @triton.jit
    def _store_outputs(o_row, lse_row, heads, h_mask, o_sh, lse_sh, acc, m_i, l_i, L: tl.constexpr,
                       BLOCK_L: tl.constexpr):
        """o (in o_row's dtype) and the natural-log lse of BLOCK_H heads; a head without a key:
        o = 0, lse = -inf."""
        cols = tl.arange(0, BLOCK_L)
        o, lse = latent_softmax_finish(acc, m_i, l_i)
        tl.store(o_row + heads[:, None] * o_sh + cols[None, :], o.to(o_row.dtype.element_ty),
                 mask=h_mask[:, None] & (cols < L)[None, :])
        tl.store(lse_row + heads * lse_sh, lse, mask=h_mask)

    # Flat-slot mode (vLLM's sparse MLA: mla_ext/sparse/slot_attention.py). Slot s is row s of the
    # cache viewed flat (vLLM's flat_kv_row_view: block s // block_rows, offset s % block_rows, with
    # block_rows = the block stride in rows); -1, an offset past block_size (rows between this
    # layer's blocks) and a block past num_blocks are no key, never read. Program (t, head block,
    # split): split `sp` walks slots [sp * split_len, (sp + 1) * split_len) of token t.
    # batch-varying: no re-compile
    @triton.jit(do_not_specialize=["K", "num_blocks", "split_len", "H"])
    def _slot_latent_kernel(
        ql_ptr, qp_ptr, c_ptr, c32_ptr, c16_ptr, sl_ptr, ks_ptr, o_ptr, lse_ptr,
        qk_scale_log2, H, K, num_blocks, block_size, block_rows, split_len,
        ql_st, ql_sh, qp_st, qp_sh, c_ent, sl_st, o_ss, o_st, o_sh, lse_ss, lse_st, lse_sh,
        L: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, LOWP_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        t, heads, h_mask = _program_heads(H, BLOCK_H)
        sp = tl.program_id(2)
        q, qp = _load_queries(ql_ptr, qp_ptr, t, heads, h_mask, ql_st, ql_sh, qp_st, qp_sh, L, R, LOWP_DOT, BLOCK_L,
                              BLOCK_R)
        k_scale = load_k_scale(ks_ptr, MODE)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        k_lo = sp * split_len
        k_hi = tl.minimum(K, k_lo + split_len)
        for j0 in range(k_lo, k_hi, BLOCK_N):
            j = j0 + offs_n
            # int32 slot arithmetic (a 64-bit division per slot spilled 276-424 B on sm_80..90)
            s = tl.load(sl_ptr + t * sl_st + j, mask=j < k_hi, other=-1)
            blk = s // block_rows
            ok = (s >= 0) & (s - blk * block_rows < block_size) & (blk < num_blocks)
            row = tl.where(ok, s, 0).to(tl.int64) * c_ent  # the flat row: block stride = block_rows rows
            kv, pe = load_latent_rows(c_ptr, c32_ptr, c16_ptr, row, ok, k_scale, L, R, MODE, BLOCK_N, BLOCK_L,
                                      BLOCK_R)
            m_i, l_i, acc = latent_softmax_step(q, qp, kv, pe, ok, qk_scale_log2, m_i, l_i, acc, LOWP_DOT,
                                                IEEE_FP32, BLOCK_R)
        _store_outputs(o_ptr + sp.to(tl.int64) * o_ss + t * o_st, lse_ptr + sp.to(tl.int64) * lse_ss + t * lse_st, heads, h_mask, o_sh, lse_sh,
                       acc, m_i, l_i, L, BLOCK_L)


# GPU tiles (BLOCK_H, BLOCK_N, num_warps, num_stages), from ptxas -v at L = 512, R = 64 (triton 3.8;
# tests/sparse/test_sparse_aot.py compiles every one and fails on any spill): 16 x 32 on 8 warps, one
# stage, for 16-bit queries and the fp8 / ds_mla / native decoders (this kernel decodes a whole
# tile at once, load_latent_rows); nvfp4's decoder needs 16 x 16 on
# 8 warps (32 x 16 spilled 440 B on sm_86, 16 x 32 124 B on sm_90a); fp32 on sm_90a 4 warps
# (8 spilled 16 B).
def _gpu_config(fp32: bool, sm90: bool, mode: int) -> tuple[int, int, int, int]:
    if mode == TL.MODE_NVFP4_DS_MLA:
        return (16, 16, 8, 1)
    if fp32:
        return (16, 16, 4 if sm90 else 8, 1)
    return (16, 32, 8, 1)


def launch_config(N: int, dtype: torch.dtype, device: torch.device, mode: int = TL.MODE_NATIVE
                  ) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages); heads are the dot's M rows."""
    if TL.interpreting() or device.type != "cuda":
        return max(16, min(64, triton.next_power_of_2(max(N, 1)))), 64, 4, 1
    sm90 = torch.cuda.get_device_capability(device) >= (9, 0)
    return _gpu_config(dtype == torch.float32, sm90, mode)


def sparse_latent_attention_triton(q_lat, q_pe, kv_cache, kv_cache_dtype, block_table, indices, tok_req, ctx_lens,
                                   cu_seqlens_q, new_kv_c, new_k_pe, k_scale, softmax_scale, out, lse) -> None:
    """Fills out [N, T, L] and lse [N, T]; arguments checked by mla_ext.sparse.sparse_attention."""
    N, T, L = q_lat.shape
    R = q_pe.shape[-1]
    if T == 0 or N == 0:
        return
    mode = TL.cache_mode(kv_cache_dtype)
    cache = kv_cache.view(torch.uint8) if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else kv_cache
    c32 = cache.view(torch.float32) if mode == TL.MODE_DS_MLA else cache
    c16 = cache.view(torch.bfloat16) if mode == TL.MODE_DS_MLA else cache
    scale_t = k_scale.to(torch.float32).reshape(-1) if mode in (TL.MODE_E4M3, TL.MODE_E5M2) else ctx_lens
    bt = TL._i32(block_table)
    if bt.shape[1] == 0:
        bt = torch.full((bt.shape[0], 1), -1, dtype=torch.int32, device=q_lat.device)
    bh, bn, warps, stages = launch_config(N, q_lat.dtype, q_lat.device, mode)
    lowp = (not TL.interpreting()) and q_lat.dtype in (torch.bfloat16, torch.float16)
    idx = TL._i32(indices)
    grid = (T, triton.cdiv(N, bh))
    with launch_guard(q_lat):
        _sparse_latent_kernel[grid](
            q_lat, q_pe, cache, c32, c16, new_kv_c, new_k_pe, idx, TL._i32(tok_req), TL._i32(ctx_lens),
            TL._i32(cu_seqlens_q), bt, scale_t, out, lse,
            softmax_scale * LOG2E, N, idx.shape[1], cache.shape[0], cache.shape[1], bt.shape[1],
            q_lat.stride(1), q_lat.stride(0), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
            new_kv_c.stride(0), new_k_pe.stride(0), idx.stride(0), bt.stride(0), out.stride(1), out.stride(0),
            lse.stride(0),
            L=L, R=R, MODE=mode, LOWP_DOT=lowp, IEEE_FP32=q_lat.dtype == torch.float32,
            BLOCK_H=bh, BLOCK_N=bn, BLOCK_L=TL._pad(L), BLOCK_R=TL._pad(R), num_warps=warps, num_stages=stages,
        )


def slot_split_len(K: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, split_len) for `splits` requested over K slots: whole BLOCK_N tiles per split."""
    split_len = -(-max(K, 1) // max(splits, 1))
    split_len = -(-split_len // block_n) * block_n
    return -(-max(K, 1) // split_len), split_len


def slot_attention_triton(q_lat, q_pe, cache, kv_cache_dtype, slots, block_rows, k_scale, softmax_scale, out, lse,
                          splits: int | None = None) -> None:
    """Fills out [T, H, L] and lse [T, H] (arguments checked by mla_ext.sparse.slot_attention;
    `cache` a uint8 / native view, block_rows its block stride in rows). Split-K when the grid
    of (token, head block) programs would leave the GPU idle (few decode tokens): each split
    writes a normalised fp32 partial and its lse, merged by LSE here (host numbers only: the
    same launches for a shape, so a CUDA graph replays them)."""
    T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    K = slots.shape[1]
    if T == 0 or H == 0:
        return
    mode = TL.cache_mode(kv_cache_dtype)
    c32 = cache.view(torch.float32) if mode == TL.MODE_DS_MLA else cache
    c16 = cache.view(torch.bfloat16) if mode == TL.MODE_DS_MLA else cache
    scale_t = k_scale.to(torch.float32).reshape(-1) if mode in (TL.MODE_E4M3, TL.MODE_E5M2) else lse
    bh, bn, warps, stages = launch_config(H, q_lat.dtype, q_lat.device, mode)
    programs = T * triton.cdiv(H, bh)
    if splits is None:
        n_split, split_len = TL.num_splits(programs, K, q_lat.device, bn)
    else:
        n_split, split_len = slot_split_len(K, splits, bn)
    if n_split > 1:
        o_part = torch.empty(n_split, T, H, L, dtype=torch.float32, device=q_lat.device)
        lse_part = torch.empty(n_split, T, H, dtype=torch.float32, device=q_lat.device)
    else:
        o_part, lse_part = out.unsqueeze(0), lse.unsqueeze(0)
    lowp = (not TL.interpreting()) and q_lat.dtype in (torch.bfloat16, torch.float16)
    with launch_guard(q_lat):
        _slot_latent_kernel[(T, triton.cdiv(H, bh), n_split)](
            q_lat, q_pe, cache, c32, c16, slots, scale_t, o_part, lse_part,
            softmax_scale * LOG2E, H, K, cache.shape[0], cache.shape[1], block_rows, split_len,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(1), slots.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            lse_part.stride(2),
            L=L, R=R, MODE=mode, LOWP_DOT=lowp, IEEE_FP32=q_lat.dtype == torch.float32,
            BLOCK_H=bh, BLOCK_N=bn, BLOCK_L=TL._pad(L), BLOCK_R=TL._pad(R), num_warps=warps, num_stages=stages,
        )
    if n_split > 1:
        merge_splits(o_part, lse_part, out, lse)


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s (natural log); a row no split saw a
    key in stays o = 0, lse = -inf."""
    total = torch.logsumexp(lse_part, dim=0)
    w = torch.exp(lse_part - torch.where(torch.isinf(total), 0.0, total))  # 0 for a split without keys
    out.copy_(torch.einsum("sth,sthl->thl", w, o_part))
    lse.copy_(total)
