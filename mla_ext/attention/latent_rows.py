"""The Triton loaders that decode latent cache rows of every format: load_latent_slice /
load_latent_pe (128 latent columns at a time, the absorbed context kernel, triton_latent.py)
and load_latent_rows (a whole tile, the sparse kernel, mla_ext/sparse/triton_sparse.py,
with its online-softmax step and finish below).

`row` is each token's element offset into the cache (block * block stride + slot * entry
stride, in the cache's element type) and `ok` whether the token may be read; rows not ok
decode to zero. Modes (triton_latent.MODE_*):

  0 NATIVE        bf16 / fp16 / fp32 rows [kv_c | k_pe]
  1 / 2 E4M3/E5M2 per-tensor fp8 bytes x k_scale
  3 DS_MLA        fp8_ds_mla: 4 x 128 e4m3 x their fp32 tile scale (read through c32_ptr, a
                  4-byte view of the cache); 64 bf16 k_pe (through c16_ptr)
  4 NVFP4_DS_MLA  e2m1 nibbles x the e4m3 scale of their 16-value block; 64 e4m3 k_pe

Returns (kv [BLOCK_N, BLOCK_L], pe [BLOCK_N, BLOCK_R]) in fp32 (pe is kv, unused, when
BLOCK_R == 0). The DS_MLA / NVFP4 byte offsets are literals checked against formats.py in
triton_latent.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mla_ext.triton_fp8 import e2m1_to_f32, e2m1_to_f32_over_16384, e4m3_to_f32, e5m2_to_f32


@triton.jit
def load_latent_rows(c_ptr, c32_ptr, c16_ptr, row, ok, k_scale, L: tl.constexpr, R: tl.constexpr,
                     MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    cols = tl.arange(0, BLOCK_L)
    l_mask = cols < L
    ok2 = ok[:, None]
    if MODE == 3:
        byte = tl.load(c_ptr + row[:, None] + cols[None, :], mask=ok2, other=0)
        # The 4 fp32 tile scales through a 4-byte view (rows sit at 4-byte multiples),
        # broadcast over their 128 values.
        sc = tl.load(c32_ptr + (row // 4)[:, None] + 128 + tl.arange(0, 4)[None, :], mask=ok2, other=0.0)
        vals = tl.reshape(e4m3_to_f32(byte.to(tl.int32)), (BLOCK_N, 4, 128))
        kv = tl.reshape(vals * sc[:, :, None], (BLOCK_N, BLOCK_L))
        kv = tl.where(ok2, kv, 0.0)
        pe = kv
        if BLOCK_R > 0:
            rc = tl.arange(0, BLOCK_R)
            pe = tl.load(c16_ptr + (row // 2)[:, None] + (264 + rc)[None, :], mask=ok2 & (rc < R)[None, :],
                         other=0.0).to(tl.float32)
    elif MODE == 4:
        # 256 bytes of e2m1 pairs: element 2j in the low nibble of byte j.
        byte = tl.load(c_ptr + row[:, None] + tl.arange(0, 256)[None, :], mask=ok2, other=0).to(tl.int32)
        lo = e2m1_to_f32(byte & 0xF)
        hi = e2m1_to_f32(byte >> 4)
        vals = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32, 16))
        # The 32 e4m3 block scales at their permuted bytes, broadcast over 16 values.
        g = tl.arange(0, 32)
        sb = tl.load(c_ptr + row[:, None] + (320 + 8 * (g & 3) + (g >> 2))[None, :], mask=ok2, other=0)
        kv = tl.reshape(vals * e4m3_to_f32(sb.to(tl.int32))[:, :, None], (BLOCK_N, BLOCK_L))
        kv = tl.where(ok2, kv, 0.0)
        pe = kv
        if BLOCK_R > 0:
            rc = tl.arange(0, BLOCK_R)
            pb = tl.load(c_ptr + row[:, None] + (256 + rc)[None, :], mask=ok2 & (rc < R)[None, :], other=0)
            pe = tl.where(ok2, e4m3_to_f32(pb.to(tl.int32)), 0.0)
    else:
        x = tl.load(c_ptr + row[:, None] + cols[None, :], mask=ok2 & l_mask[None, :], other=0)
        pe = x
        if BLOCK_R > 0:
            rc = tl.arange(0, BLOCK_R)
            y = tl.load(c_ptr + row[:, None] + (L + rc)[None, :], mask=ok2 & (rc < R)[None, :], other=0)
        if MODE == 1:
            kv = tl.where(ok2, e4m3_to_f32(x.to(tl.int32)) * k_scale, 0.0)
            pe = kv
            if BLOCK_R > 0:
                pe = tl.where(ok2, e4m3_to_f32(y.to(tl.int32)) * k_scale, 0.0)
        elif MODE == 2:
            kv = tl.where(ok2, e5m2_to_f32(x.to(tl.int32)) * k_scale, 0.0)
            pe = kv
            if BLOCK_R > 0:
                pe = tl.where(ok2, e5m2_to_f32(y.to(tl.int32)) * k_scale, 0.0)
        else:
            kv = x.to(tl.float32)
            pe = kv
            if BLOCK_R > 0:
                pe = y.to(tl.float32)
    return kv, pe


@triton.jit
def online_softmax(s, key_ok, qk_scale_log2, m_i, l_i):
    """One key tile of an online softmax in base 2: raw scores s [M, N] (keys where not
    key_ok get -inf) against the running max m_i and sum l_i. Returns (p, alpha, m_new,
    l_new): p the tile's unnormalised probabilities, alpha the factor for what came before."""
    s = tl.where(key_ok[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def latent_softmax_step(q, qp, kv, pe, key_ok, qk_scale_log2, m_i, l_i, acc, LOWP_DOT: tl.constexpr,
                        IEEE_FP32: tl.constexpr, BLOCK_R: tl.constexpr):
    """One key tile of the latent MQA kernels (absorbed and sparse): scores of
    [q | qp] against the decoded rows [kv | pe] (keys where not key_ok get -inf),
    online softmax in base 2, acc += p @ kv. Returns the new (m_i, l_i, acc).
    LOWP_DOT: kv/pe are first rounded to q's dtype (what a gathered workspace holds)."""
    if LOWP_DOT:
        kv = kv.to(q.dtype)
        if BLOCK_R > 0:
            pe = pe.to(q.dtype)
    if IEEE_FP32:
        s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        if BLOCK_R > 0:
            s += tl.dot(qp, tl.trans(pe), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv))
        if BLOCK_R > 0:
            s += tl.dot(qp, tl.trans(pe))
    p, alpha, m_new, l_i = online_softmax(s, key_ok, qk_scale_log2, m_i, l_i)
    acc = acc * alpha[:, None]
    if LOWP_DOT:
        acc += tl.dot(p.to(kv.dtype), kv)
    elif IEEE_FP32:
        acc += tl.dot(p, kv, input_precision="ieee")
    else:
        acc += tl.dot(p, kv)
    return m_new, l_i, acc


@triton.jit
def softmax_norm(m_i, l_i):
    """(1 / sum, lse natural log) of the online softmax; a row without a key: 1 (its
    accumulator is 0, so o = 0) and lse = -inf."""
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return 1.0 / l_safe, lse


@triton.jit
def latent_softmax_finish(acc, m_i, l_i):
    """(o, lse natural log) of the online softmax; a row without a key: o = 0, lse = -inf."""
    inv, lse = softmax_norm(m_i, l_i)
    return acc * inv[:, None], lse


@triton.jit
def load_k_scale(ks_ptr, MODE: tl.constexpr):
    """The per-tensor fp8 scale (modes 1 / 2; 1.0 otherwise, ks_ptr unread). Not checked on
    the host (that would sync): an invalid scale (not finite, <= 0) gives NaN rows."""
    k_scale = 1.0
    if MODE == 1 or MODE == 2:
        k_scale = tl.load(ks_ptr)
        k_scale = tl.where((k_scale > 0.0) & (k_scale <= 3.4028234663852886e38), k_scale, float("nan"))
    return k_scale


# -- the same decoders, one slice of the latent at a time ---------------------------------
#
# The absorbed kernel decodes a KV tile SLICE columns at a time (issue 19): decoding the
# whole [BLOCK_N, 512] tile at once kept every byte, code and fp32 value of it live together
# (255 registers and ~450 B spilled per thread for fp8_ds_mla / nvfp4_ds_mla), and left no
# room for a wgmma-sized query tile. A slice is decoded, rounded to the compute dtype and
# handed to the dots; only one slice's temporaries are ever live.


@triton.jit
def load_latent_slice(c_ptr, c32_ptr, row, ok, k_scale, J: tl.constexpr, L: tl.constexpr, MODE: tl.constexpr,
                      BLOCK_N: tl.constexpr, SLICE: tl.constexpr):
    """Columns [J * SLICE, (J + 1) * SLICE) of the tile's latent rows, fp32 [BLOCK_N, SLICE].
    DS_MLA / NVFP4_DS_MLA need SLICE to divide 128 / be a multiple of 16 (the launcher's 128)."""
    cols = J * SLICE + tl.arange(0, SLICE)
    ok2 = ok[:, None]
    if MODE == 3:
        byte = tl.load(c_ptr + row[:, None] + cols[None, :], mask=ok2, other=0)
        # The slice lies in one 128-value tile: one fp32 scale per row (4-byte view).
        sc = tl.load(c32_ptr + row // 4 + 128 + (J * SLICE) // 128, mask=ok, other=0.0)
        kv = tl.where(ok2, e4m3_to_f32(byte.to(tl.int32)) * sc[:, None], 0.0)
    elif MODE == 4:
        # SLICE / 2 bytes of e2m1 pairs (value 2j in the low nibble of byte j) ...
        byte = tl.load(c_ptr + row[:, None] + (J * SLICE // 2 + tl.arange(0, SLICE // 2))[None, :], mask=ok2,
                       other=0).to(tl.int32)
        lo, hi = e2m1_to_f32_over_16384(byte & 0xF), e2m1_to_f32_over_16384(byte >> 4)
        vals = tl.reshape(tl.join(lo, hi), (BLOCK_N, SLICE // 16, 16))
        # ... times the e4m3 scales of their 16-value blocks, at their permuted bytes (x 2^14,
        # which the cheaper code decode leaves out: exact, the product rounds as value x scale).
        g = J * SLICE // 16 + tl.arange(0, SLICE // 16)
        sb = tl.load(c_ptr + row[:, None] + (320 + 8 * (g & 3) + (g >> 2))[None, :], mask=ok2, other=0)
        kv = tl.reshape(vals * (e4m3_to_f32(sb.to(tl.int32)) * 16384.0)[:, :, None], (BLOCK_N, SLICE))
        kv = tl.where(ok2, kv, 0.0)
    else:
        x = tl.load(c_ptr + row[:, None] + cols[None, :], mask=ok2 & (cols < L)[None, :], other=0)
        kv = _per_tensor(x, ok2, k_scale, MODE)
    return kv


@triton.jit
def load_latent_pe(c_ptr, c16_ptr, row, ok, k_scale, L: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """The tile's rope keys k_pe, fp32 [BLOCK_N, BLOCK_R] (BLOCK_R > 0)."""
    rc = tl.arange(0, BLOCK_R)
    m = ok[:, None] & (rc < R)[None, :]
    if MODE == 3:
        pe = tl.load(c16_ptr + (row // 2)[:, None] + (264 + rc)[None, :], mask=m, other=0.0).to(tl.float32)
    elif MODE == 4:
        pb = tl.load(c_ptr + row[:, None] + (256 + rc)[None, :], mask=m, other=0)
        pe = tl.where(m, e4m3_to_f32(pb.to(tl.int32)), 0.0)
    else:
        pe = _per_tensor(tl.load(c_ptr + row[:, None] + (L + rc)[None, :], mask=m, other=0), m, k_scale, MODE)
    return pe


@triton.jit
def _per_tensor(x, ok, k_scale, MODE: tl.constexpr):
    """Native / per-tensor fp8 cache values -> fp32 (rows not ok: 0)."""
    if MODE == 1:
        v = tl.where(ok, e4m3_to_f32(x.to(tl.int32)) * k_scale, 0.0)
    elif MODE == 2:
        v = tl.where(ok, e5m2_to_f32(x.to(tl.int32)) * k_scale, 0.0)
    else:
        v = x.to(tl.float32)
    return v
