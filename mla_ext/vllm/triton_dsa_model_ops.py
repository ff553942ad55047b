"""Triton kernels of vLLM 0.33's DeepSeek-V3.2 / GLM-5 `fused_norm_rope` and `fused_q`
(mla_ext/vllm/dsa_model_ops.py's CUDA path: one launch per op) without fp8 types: Triton's
fp8e4nv exists only from sm_89, so e4m3 codes are made with integer operations
(mla_ext.cache.triton_write._encode_e4m3: round to nearest even, saturating at 448, NaN kept),
bf16 stores go through their bits (_bf16_bits, RNE: the interpreter's fp32 -> bf16 cast
truncates), divisions are IEEE (div_rn) and the power-of-two scales are rounded on the bits, so the
bytes equal the torch path's (dsa_model_ops' torch backend) in the interpreter and on a GPU. Launched
with fp contraction off (no fma), so every element-wise result is the torch path's exactly; only
the norms' reductions sum in another order (a row's rstd may move by an fp32 ulp).

fused_norm_rope: grid (T, 4), as vLLM's: program 0 the indexer key (LayerNorm + RoPE + index_k_out
+ fp8 index-cache row with its ue8m0 fp32 scale, plain or shuffled layout), 1 the latent
(RMSNorm + interleaved RoPE + kv_c_out / k_pe_out + the MLA cache row: native, fp8 per tensor or
fp8_ds_mla), 2 q's RMSNorm, 3 the top-k buffer's -1 fill. Slots < 0 or past a cache write nothing.
fused_q: grid (T, max(H, NI)): program (t, h) packs MQA head h (e4m3 [ql_nope, RoPE(q_pe)] / q_scale,
or RoPE(q_pe) unquantized) and indexer head h (RoPE + ue8m0 e4m3 + its weight).
"""
from __future__ import annotations

from torch import Tensor

from mla_ext.attention.triton_latent import _pad, interpreting
from mla_ext.sparse._triton import device_reasons, tl, triton

# How a float row is stored (outputs and native caches): fp32, bf16 bits (int16 view), fp16.
OUT_F32, OUT_BF16, OUT_F16 = 0, 1, 2
# The MLA cache as fused_norm_rope's kernel writes it.
MLA_NONE, MLA_NATIVE, MLA_FP8, MLA_DS = 0, 1, 2, 3
SHUFFLE_TILE = 16  # vLLM's shuffled index cache: tiles of 16 tokens x 16 bytes
NORM_ROPE_WARPS, Q_WARPS = 4, 2
TOPK_BLOCK = 1024

if triton is not None:
    from mla_ext.cache.triton_write import _bf16_bits, _ds_tile_scale, _encode_e4m3
    from mla_ext.sparse.triton_indexer_quant import rope_columns
    from mla_ext.triton_fp8 import launch_guard

    @triton.jit
    def _store_f(ptr, x, mask, KIND: tl.constexpr):
        """fp32 values -> a row of fp32 / bf16 (bits, into an int16 view) / fp16, RNE."""
        if KIND == 1:
            tl.store(ptr, _bf16_bits(x).to(tl.int16), mask=mask)
        elif KIND == 2:
            tl.store(ptr, x.to(tl.float16), mask=mask)
        else:
            tl.store(ptr, x, mask=mask)

    @triton.jit
    def _div(x, y):
        """x / y, IEEE (Triton's plain fp32 `/` is approximate on NVIDIA), y broadcast to x."""
        return tl.math.div_rn(x, tl.zeros_like(x) + y)

    @triton.jit
    def _mean(x, N: tl.constexpr):
        """sum(x) / N of a row, IEEE division."""
        s = tl.sum(x, axis=0)
        return tl.math.div_rn(s, tl.zeros_like(s) + N)

    @triton.jit
    def _rsqrt(v):
        """1 / sqrt(v), IEEE sqrt and division (torch's CPU rsqrt)."""
        return tl.math.div_rn(tl.zeros_like(v) + 1.0, tl.sqrt_rn(v))

    @triton.jit
    def _rms(x, w, eps, N: tl.constexpr):
        """x * rsqrt(mean(x^2) + eps) * w, left to right (the torch path's order)."""
        return x * _rsqrt(_mean(x * x, N) + eps) * w

    @triton.jit
    def _ue8m0(amax):
        """max(amax, 1e-4) / 448 up to a power of two, on the bits (index_cache_torch)."""
        s = _div(tl.maximum(amax, 1e-4), 448.0)
        b = s.to(tl.int32, bitcast=True)
        up = ((b & 0x7FFFFF) != 0) & ((b & 0x7F800000) != 0x7F800000)
        return tl.where(up, (b & 0x7F800000) + 0x800000, b).to(tl.float32, bitcast=True)

    @triton.jit
    def _rotate(x, xp, cos, sin, first):
        """x1 cos - x2 sin for the first of a pair, x2 cos + x1 sin for the second (torch's order)."""
        return tl.where(first, x * cos - xp * sin, x * cos + xp * sin)

    @triton.jit(do_not_specialize=["T", "topk_w", "mla_bs", "mla_nslots", "idx_bs", "idx_nslots"])
    def _norm_rope_kernel(pos_ptr, slot_ptr, islot_ptr, T,
                          q_ptr, q_s, qw_ptr, q_eps, qo_ptr, qo_s,
                          kv_ptr, kv_s, kvw_ptr, kv_eps, kvo_ptr, kvo_s,
                          pe_ptr, pe_s, kcs_ptr, kcs_s, peo_ptr, peo_s,
                          ik_ptr, ik_s, ikw_ptr, ikb_ptr, ik_eps, ics_ptr, ics_s, iko_ptr, iko_s,
                          topk_ptr, topk_s0, topk_s1, topk_w,
                          mla_ptr, mla_bstride, mla_estride, mla_bs, mla_nslots, ks_ptr,
                          idx_ptr, idx_pstride, idx_bs, idx_nslots,
                          Q: tl.constexpr, BLOCK_Q: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, I_HALF: tl.constexpr,
                          HAS_INDEXER: tl.constexpr, NEOX: tl.constexpr, HAS_SLOTS: tl.constexpr,
                          HAS_KVO: tl.constexpr, HAS_PEO: tl.constexpr, HAS_IKO: tl.constexpr,
                          HAS_IDX_CACHE: tl.constexpr, SHUFFLE: tl.constexpr,
                          MLA: tl.constexpr, HAS_KS: tl.constexpr, MLA_KIND: tl.constexpr,
                          QO_KIND: tl.constexpr, KVO_KIND: tl.constexpr, PEO_KIND: tl.constexpr,
                          IKO_KIND: tl.constexpr, TOPK_BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        live = True
        if HAS_SLOTS:
            live = tl.load(slot_ptr + t) >= 0  # vLLM's rule: the indexer skips a token whose MLA slot < 0
        if part == 3:
            if HAS_INDEXER:
                for c0 in range(0, topk_w, TOPK_BLOCK):
                    c = c0 + tl.arange(0, TOPK_BLOCK)
                    tl.store(topk_ptr + t * topk_s0 + c.to(tl.int64) * topk_s1,
                             tl.full([TOPK_BLOCK], -1, tl.int32).to(topk_ptr.dtype.element_ty), mask=c < topk_w)
        elif part == 2:
            q = tl.arange(0, BLOCK_Q)
            qm = q < Q
            x = tl.load(q_ptr + t * q_s + q, mask=qm, other=0.0).to(tl.float32)
            w = tl.load(qw_ptr + q, mask=qm, other=0.0).to(tl.float32)
            _store_f(qo_ptr + t * qo_s + q, _rms(x, w, q_eps, Q), qm, QO_KIND)
        elif part == 1:
            if HAS_KVO or HAS_PEO or MLA != 0:
                c = tl.arange(0, L)
                kv = _rms(tl.load(kv_ptr + t * kv_s + c).to(tl.float32), tl.load(kvw_ptr + c).to(tl.float32),
                          kv_eps, L)
                pos = tl.load(pos_ptr + t).to(tl.int64)
                r = tl.arange(0, R)
                _, partner, first, i = rope_columns(r, R // 2, False)
                cos = tl.load(kcs_ptr + pos * kcs_s + i).to(tl.float32)
                sin = tl.load(kcs_ptr + pos * kcs_s + R // 2 + i).to(tl.float32)
                pe = _rotate(tl.load(pe_ptr + t * pe_s + r).to(tl.float32),
                             tl.load(pe_ptr + t * pe_s + partner).to(tl.float32), cos, sin, first)
                if HAS_KVO:
                    _store_f(kvo_ptr + t * kvo_s + c, kv, c < L, KVO_KIND)
                if HAS_PEO:
                    _store_f(peo_ptr + t * peo_s + r, pe, r < R, PEO_KIND)
                if MLA != 0:
                    slot = tl.load(slot_ptr + t).to(tl.int64)
                    if (slot >= 0) & (slot < mla_nslots):
                        dst = mla_ptr + (slot // mla_bs) * mla_bstride + (slot % mla_bs) * mla_estride
                        if MLA == 1:  # native: the values rounded to the cache's dtype
                            _store_f(dst + c, kv, c < L, MLA_KIND)
                            _store_f(dst + L + r, pe, r < R, MLA_KIND)
                        elif MLA == 2:  # fp8 per tensor: saturate(x / k_scale)
                            s = 1.0
                            if HAS_KS:
                                s = tl.load(ks_ptr)
                            tl.store(dst + c, _encode_e4m3(_div(kv, s)).to(tl.uint8))
                            tl.store(dst + L + r, _encode_e4m3(_div(pe, s)).to(tl.uint8))
                        else:  # fp8_ds_mla: 4 x 128 e4m3 + 4 fp32 power-of-two scales + 64 bf16
                            x = tl.reshape(kv, (4, 128))
                            a = tl.abs(x)
                            sc = _ds_tile_scale(tl.max(tl.where(a == a, a, 0.0), axis=1))  # NaN ignored
                            code = _encode_e4m3(tl.math.div_rn(x, tl.broadcast_to(sc[:, None], (4, 128))))
                            tl.store(dst + c, tl.reshape(code, (512,)).to(tl.uint8))
                            sb = sc.to(tl.int32, bitcast=True)
                            by = tl.arange(0, 4)
                            tl.store(dst + 512 + tl.arange(0, 4)[:, None] * 4 + by[None, :],
                                     ((sb[:, None] >> (by[None, :] * 8)) & 0xFF).to(tl.uint8))
                            h = _bf16_bits(pe)
                            two = tl.arange(0, 2)
                            tl.store(dst + 528 + r[:, None] * 2 + two[None, :],
                                     ((h[:, None] >> (two[None, :] * 8)) & 0xFF).to(tl.uint8))
        else:
            if HAS_INDEXER & (HAS_IKO | HAS_IDX_CACHE):
                if live:
                    d = tl.arange(0, BLOCK_D)
                    dm = d < D
                    x = tl.load(ik_ptr + t * ik_s + d, mask=dm, other=0.0).to(tl.float32)
                    w = tl.load(ikw_ptr + d, mask=dm, other=0.0).to(tl.float32)
                    b = tl.load(ikb_ptr + d, mask=dm, other=0.0).to(tl.float32)
                    mean = _mean(x, D)
                    diff = tl.where(dm, x - mean, 0.0)
                    rstd = _rsqrt(_mean(diff * diff, D) + ik_eps)
                    y = diff * rstd * w + b
                    # the rotation partner, normalized with the same mean / rstd (no scratch round trip)
                    rot, partner, first, i = rope_columns(d, I_HALF, NEOX)
                    xp = tl.load(ik_ptr + t * ik_s + partner, mask=dm, other=0.0).to(tl.float32)
                    wp = tl.load(ikw_ptr + partner, mask=dm, other=0.0).to(tl.float32)
                    bp = tl.load(ikb_ptr + partner, mask=dm, other=0.0).to(tl.float32)
                    yp = (xp - mean) * rstd * wp + bp
                    pos = tl.load(pos_ptr + t).to(tl.int64)
                    cos = tl.load(ics_ptr + pos * ics_s + i, mask=rot, other=1.0).to(tl.float32)
                    sin = tl.load(ics_ptr + pos * ics_s + I_HALF + i, mask=rot, other=0.0).to(tl.float32)
                    k = tl.where(rot, _rotate(y, yp, cos, sin, first), y)
                    if HAS_IKO:
                        _store_f(iko_ptr + t * iko_s + d, k, dm, IKO_KIND)
                    if HAS_IDX_CACHE:
                        islot = tl.load(islot_ptr + t).to(tl.int64)
                        if (islot >= 0) & (islot < idx_nslots):
                            k = tl.where(dm, k, 0.0)
                            s = _ue8m0(tl.max(tl.abs(k), axis=0))
                            code = _encode_e4m3(_div(k, s))
                            page = idx_ptr + (islot // idx_bs) * idx_pstride
                            o = islot % idx_bs
                            if SHUFFLE:
                                col = ((o // 16) * 16 * D + (o % 16) * 16 + (d // 16) * 256 + d % 16)
                            else:
                                col = o * D + d
                            tl.store(page + col, code.to(tl.uint8), mask=dm)
                            by = tl.arange(0, 4)
                            sb = s.to(tl.int32, bitcast=True)
                            tl.store(page + idx_bs * D + 4 * o + by, ((sb >> (by * 8)) & 0xFF).to(tl.uint8))

    @triton.jit(do_not_specialize=["H", "NI"])
    def _q_kernel(pos_ptr, H, NI, pe_ptr, pe_s0, pe_s1, cs_ptr, cs_s, ln_ptr, ln_s0, ln_s1, qs_ptr,
                  mqa_ptr, mqa_s0, mqa_s1, iq_ptr, iq_s0, iq_s1, ics_ptr, ics_s, iqo_ptr, iqo_s0, iqo_s1,
                  w_ptr, w_s0, w_s1, wo_ptr, wo_s0, softmax_scale, head_scale,
                  L: tl.constexpr, BLOCK_L: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, I_HALF: tl.constexpr, HAS_INDEXER: tl.constexpr, NEOX: tl.constexpr,
                  QUANT: tl.constexpr, OUT_KIND: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        if h < H:
            r = tl.arange(0, R)
            _, partner, first, i = rope_columns(r, R // 2, False)
            cos = tl.load(cs_ptr + pos * cs_s + i).to(tl.float32)
            sin = tl.load(cs_ptr + pos * cs_s + R // 2 + i).to(tl.float32)
            src = pe_ptr + t * pe_s0 + h * pe_s1
            pe = _rotate(tl.load(src + r).to(tl.float32), tl.load(src + partner).to(tl.float32), cos, sin, first)
            dst = mqa_ptr + t * mqa_s0 + h * mqa_s1
            if QUANT:
                s = tl.load(qs_ptr)
                c = tl.arange(0, BLOCK_L)
                x = tl.load(ln_ptr + t * ln_s0 + h * ln_s1 + c, mask=c < L, other=0.0).to(tl.float32)
                tl.store(dst + c, _encode_e4m3(_div(x, s)).to(tl.uint8), mask=c < L)
                tl.store(dst + L + r, _encode_e4m3(_div(pe, s)).to(tl.uint8))
            else:
                _store_f(dst + r, pe, r < R, OUT_KIND)
        if HAS_INDEXER:
            if h < NI:
                d = tl.arange(0, BLOCK_D)
                dm = d < D
                rot, partner, first, i = rope_columns(d, I_HALF, NEOX)
                src = iq_ptr + t * iq_s0 + h * iq_s1
                x = tl.load(src + d, mask=dm, other=0.0).to(tl.float32)
                xp = tl.load(src + partner, mask=dm & rot, other=0.0).to(tl.float32)
                cos = tl.load(ics_ptr + pos * ics_s + i, mask=rot, other=1.0).to(tl.float32)
                sin = tl.load(ics_ptr + pos * ics_s + I_HALF + i, mask=rot, other=0.0).to(tl.float32)
                k = tl.where(rot, _rotate(x, xp, cos, sin, first), x)
                k = tl.where(dm, k, 0.0)
                s = _ue8m0(tl.max(tl.abs(k), axis=0))
                tl.store(iqo_ptr + t * iqo_s0 + h * iqo_s1 + d, _encode_e4m3(_div(k, s)).to(tl.uint8),
                         mask=dm)
                w = tl.load(w_ptr + t * w_s0 + h * w_s1).to(tl.float32)
                tl.store(wo_ptr + t * wo_s0 + h, ((w * s) * softmax_scale) * head_scale)


not_supported_reasons = device_reasons


def out_kind(t: Tensor) -> int:
    import torch

    return {torch.float32: OUT_F32, torch.bfloat16: OUT_BF16, torch.float16: OUT_F16}[t.dtype]


def store_view(t: Tensor) -> Tensor:
    """The view a float row is stored through (bf16 as its int16 bits)."""
    import torch

    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# Compile options on a GPU: fp contraction off, so x * c - y * s rounds as torch's separate ops
# (no fma); tests/sparse/test_sparse_aot.py compiles with them.
GPU_OPTIONS = {"enable_fp_fusion": False}


def _launch_opts() -> dict:
    return {} if interpreting() else dict(GPU_OPTIONS)


def norm_rope_triton(x, mla_mode: int) -> None:
    """One launch of _norm_rope_kernel for dsa_model_ops' checked NormRopeInputs `x`."""
    import torch

    T = x.positions.shape[0]
    if T == 0:
        return
    dummy = x.q_c  # any valid pointer for an argument the constexprs never read
    has_idx = x.has_indexer
    ik = x.index_k if has_idx else dummy
    ikw = x.index_k_layer_norm_w if has_idx else dummy
    ikb = x.index_k_layer_norm_bias if has_idx else dummy
    ics = x.index_k_rope_cos_sin_cache if has_idx else x.k_rope_cos_sin_cache
    D = ik.shape[-1] if has_idx else 1
    slots = x.slot_mapping if x.slot_mapping is not None else x.positions
    islots = x.indexer_slot_mapping if x.indexer_slot_mapping is not None else slots
    idx = x.indexer_k_cache
    idx_u8 = idx.view(torch.uint8) if idx is not None else dummy
    mla = x.mla_kv_cache
    if mla is None:
        mla_v, mla_s, mla_kind = dummy, (0, 0), OUT_F32
    elif mla_mode == MLA_NATIVE:
        mla_v, mla_kind = store_view(mla), out_kind(mla)
        mla_s = (mla_v.stride(0), mla_v.stride(1))
    else:
        mla_v, mla_kind = mla.view(torch.uint8), OUT_F32
        mla_s = (mla_v.stride(0), mla_v.stride(1))
    has_ks = mla_mode == MLA_FP8 and x.mla_k_scale is not None  # None: skip_scale or no scale
    outs = {}
    for name in ("kv_c_out", "k_pe_out", "index_k_out"):
        o = getattr(x, name)
        outs[name] = (store_view(o), o.stride(0), out_kind(o)) if o is not None else (dummy, 0, OUT_F32)
    qo = x.q_out
    kvo, peo, iko = outs["kv_c_out"], outs["k_pe_out"], outs["index_k_out"]
    topk = x.topk_indices_buffer
    with launch_guard(x.q_c):
        _norm_rope_kernel[(T, 4)](
            x.positions, slots, islots, T,
            x.q_c, x.q_c.stride(0), x.q_rms_norm_w, float(x.q_rms_eps), store_view(qo), qo.stride(0),
            x.kv_c, x.kv_c.stride(0), x.kv_rms_norm_w, float(x.kv_rms_eps), kvo[0], kvo[1],
            x.k_pe, x.k_pe.stride(0), x.k_rope_cos_sin_cache, x.k_rope_cos_sin_cache.stride(0), peo[0], peo[1],
            ik, ik.stride(0), ikw, ikb, float(x.index_k_layer_norm_eps), ics, ics.stride(0), iko[0], iko[1],
            topk, topk.stride(0), topk.stride(1), topk.shape[1],
            mla_v, mla_s[0], mla_s[1], mla.shape[1] if mla is not None else 1,
            mla.shape[0] * mla.shape[1] if mla is not None else 0, x.mla_k_scale if has_ks else dummy,
            idx_u8, idx_u8.stride(0) if idx is not None else 0, idx.shape[1] if idx is not None else 1,
            idx.shape[0] * idx.shape[1] if idx is not None else 0,
            Q=x.q_c.shape[1], BLOCK_Q=_pad(x.q_c.shape[1]), L=x.kv_c.shape[1], R=x.k_pe.shape[1],
            D=D, BLOCK_D=_pad(D), I_HALF=x.index_k_rope_cos_sin_cache.shape[1] // 2 if has_idx else 1,
            HAS_INDEXER=has_idx, NEOX=not x.index_rope_interleave, HAS_SLOTS=x.slot_mapping is not None,
            HAS_KVO=x.kv_c_out is not None, HAS_PEO=x.k_pe_out is not None,
            HAS_IKO=has_idx and x.index_k_out is not None, HAS_IDX_CACHE=has_idx and idx is not None,
            SHUFFLE=bool(x.indexer_cache_shuffled), MLA=mla_mode if mla is not None else MLA_NONE, HAS_KS=has_ks,
            MLA_KIND=mla_kind, QO_KIND=out_kind(qo), KVO_KIND=kvo[2], PEO_KIND=peo[2], IKO_KIND=iko[2],
            TOPK_BLOCK=TOPK_BLOCK, num_warps=1 if interpreting() else NORM_ROPE_WARPS, num_stages=1,
            **_launch_opts())


def q_triton(x, mqa_q: Tensor, index_q_out: Tensor | None, w_out: Tensor | None) -> None:
    """One launch of _q_kernel for dsa_model_ops' checked QInputs `x` into the allocated outputs
    (mqa_q: uint8 view when quantized, else q_pe's dtype; index_q_out uint8 [T, NI, D])."""
    T, H, R = x.q_pe.shape
    NI = x.index_q.shape[1] if x.has_indexer else 0
    if T == 0 or max(H, NI) == 0:
        return
    L = x.ql_nope.shape[2]
    iq = x.index_q if x.has_indexer else x.q_pe
    ics = x.index_q_cos_sin_cache if x.has_indexer else x.q_pe_cos_sin_cache
    iqo = index_q_out if x.has_indexer else mqa_q
    w = x.index_weights if x.has_indexer else x.q_scale.reshape(1, 1)
    wo = w_out if x.has_indexer else x.q_scale.reshape(1, 1)
    D = iq.shape[2]
    mqa_v = mqa_q if x.quantize_mqa else store_view(mqa_q)
    with launch_guard(x.q_pe):
        _q_kernel[(T, max(H, NI))](
            x.positions, H, NI, x.q_pe, x.q_pe.stride(0), x.q_pe.stride(1), x.q_pe_cos_sin_cache,
            x.q_pe_cos_sin_cache.stride(0), x.ql_nope, x.ql_nope.stride(0), x.ql_nope.stride(1), x.q_scale,
            mqa_v, mqa_v.stride(0), mqa_v.stride(1), iq, iq.stride(0), iq.stride(1), ics, ics.stride(0),
            iqo, iqo.stride(0), iqo.stride(1), w, w.stride(0), w.stride(1), wo, wo.stride(0),
            float(x.index_weights_softmax_scale), float(x.index_weights_head_scale),
            L=L, BLOCK_L=_pad(max(L, 1)), R=R, D=D, BLOCK_D=_pad(D),
            I_HALF=ics.shape[1] // 2, HAS_INDEXER=x.has_indexer, NEOX=not x.index_rope_interleave,
            QUANT=x.quantize_mqa, OUT_KIND=OUT_F32 if x.quantize_mqa else out_kind(mqa_q),
            num_warps=1 if interpreting() else Q_WARPS, num_stages=1, **_launch_opts())
