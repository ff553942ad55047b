"""vLLM 0.33's DeepSeek-V3.2 / GLM-5 model-file kernels `fused_norm_rope` and `fused_q`
(vllm/models/deepseek_v32/common/kernels.py) without Triton's fp8e4nv type, which exists only
from sm_89: mla_ext's vLLM plugin rebinds `vllm.models.deepseek_v32.attention.fused_norm_rope` /
`.fused_q` to these on capability < 8.9 (sparse_plugin.ROUTES).

Same signatures, argument meanings, return values and in-place writes as vLLM's, built from
mla_ext's pieces: RMSNorm / LayerNorm / RoPE in torch (fp32 math, as the Triton kernels do),
the latent-cache writer mla_ext.cache.concat_and_cache_mla (auto/bf16/fp16, fp8 per tensor,
fp8_ds_mla), the index-cache writer mla_ext.sparse.index_cache.write_index_cache (fp8 values +
one power-of-two (ue8m0) fp32 scale per token) and torch's round-to-nearest-even, saturating e4m3
(mla_ext.cache.reference.quantize_fp8_per_tensor, index_cache_torch.quantize_fp8_rows). No host
sync on CUDA (CUDA-graph safe): rows are selected with torch.where, not boolean indexing.

Where vLLM's kernel reads or writes out of bounds, these raise ValueError (or skip, for a
negative indexer slot) instead; formats vLLM's kernel cannot serve on these GPUs (nvfp4_ds_mla:
an sm_100 instruction; fp8_e5m2: vLLM's kernel writes e4m3 bytes into it) are refused. The
indexer cache's scales are fp32, as vLLM writes them everywhere but SM100 (MX scales).
Reference: dsa_model_ops_reference.py."""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.cache import api as cache_api
from mla_ext.cache.reference import quantize_fp8_per_tensor
from mla_ext.config.formats import QuantMode, get_format
from mla_ext.sparse.index_cache import write_index_cache
from mla_ext.sparse.index_cache_torch import quantize_fp8_rows

FP8 = torch.float8_e4m3fn  # vLLM's current_platform.fp8_dtype() on CUDA
# vLLM's shuffled indexer-cache layout (ROCm's reader): tiles of 16 tokens x 16 bytes.
SHUFFLE_BLOCK_TILE = 16
SHUFFLE_HEAD_TILE = 16
# Latent-cache formats vLLM's kernel writes that mla_ext serves here.
_REFUSED_MLA_FORMATS = {
    "nvfp4_ds_mla": "its writer needs sm_100's e2m1 conversion",
    "fp8_e5m2": "vLLM's fused kernel writes e4m3 bytes into it",
}


# -- argument checks -----------------------------------------------------------

def _tensor(t, arg: str, ndim: int, dtypes=None, device=None) -> Tensor:
    if not isinstance(t, Tensor):
        raise ValueError(f"{arg}: expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{arg}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{arg}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{arg}: expected a tensor on {device} (positions' device), got {t.device}")
    return t


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INTS = (torch.int32, torch.int64)


def _rows(t, arg: str, ndim: int, T: int, device, width: int | None = None) -> Tensor:
    """A float activation with T rows (and `width` columns)."""
    _tensor(t, arg, ndim, _FLOATS, device)
    if t.shape[0] != T:
        raise ValueError(f"{arg}: expected {T} rows (positions' length), got shape {tuple(t.shape)}")
    if width is not None and t.shape[-1] != width:
        raise ValueError(f"{arg}: expected last dim {width}, got shape {tuple(t.shape)}")
    return t


def _weight(t, arg: str, dim: int, device) -> Tensor:
    _tensor(t, arg, 1, _FLOATS, device)
    if t.shape[0] != dim:
        raise ValueError(f"{arg}: expected [{dim}], got {tuple(t.shape)}")
    return t


def _out(t, arg: str, like: Tensor) -> Tensor:
    _tensor(t, arg, like.dim(), _FLOATS, like.device)
    if t.shape != like.shape:
        raise ValueError(f"{arg}: expected shape {tuple(like.shape)} (as its input), got {tuple(t.shape)}")
    return t


def _rope_half(cache, arg: str, rot_dim_max: int, device, exact: bool) -> int:
    """Half the rotary dim of a cos/sin cache [max_pos, 2 * half]: a power of two (vLLM's kernel
    spans it with tl.arange), equal to (exact) or at most rot_dim_max / 2."""
    _tensor(cache, arg, 2, _FLOATS, device)
    half = cache.shape[1] // 2
    if cache.shape[1] % 2 or half < 1 or half & (half - 1):
        raise ValueError(f"{arg}: expected [max_position, 2 * half] with half a power of two, got "
                         f"{tuple(cache.shape)}")
    if (2 * half != rot_dim_max) if exact else (2 * half > rot_dim_max):
        rel = "equal to" if exact else "at most"
        raise ValueError(f"{arg}: rotary dim {2 * half} must be {rel} the rotated width {rot_dim_max}")
    return half


def _positions(positions, dtypes=_INTS) -> Tensor:
    return _tensor(positions, "positions", 1, dtypes)


def _check_positions(positions: Tensor, caches) -> None:
    """On the CPU (no sync) every position must index each cos/sin cache."""
    if positions.device.type != "cpu" or not positions.numel():
        return
    lo, hi = int(positions.min()), int(positions.max())
    for arg, cache in caches:
        if lo < 0 or hi >= cache.shape[0]:
            raise ValueError(f"positions: expected values in [0, {cache.shape[0]}) ({arg} rows), got [{lo}, {hi}]")


def _slots(t, arg: str, T: int, device) -> Tensor:
    _tensor(t, arg, 1, _INTS, device)
    if t.shape[0] < T:
        raise ValueError(f"{arg}: expected at least {T} entries (one per token), got {t.shape[0]}")
    return t[:T].to(torch.int64)


# -- the math, float32 as vLLM's kernels ----------------------------------------

def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w.float()


def _layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    x = x.float()
    mean = x.mean(dim=-1, keepdim=True)
    diff = x - mean
    rstd = torch.rsqrt((diff * diff).mean(dim=-1, keepdim=True) + eps)
    return diff * rstd * w.float() + b.float()


def _cos_sin(cache: Tensor, positions: Tensor, half: int) -> tuple[Tensor, Tensor]:
    cs = cache[positions.to(torch.int64)].float()
    return cs[:, :half], cs[:, half:2 * half]


def _rotate(x1: Tensor, x2: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J style RoPE on pairs (2i, 2i+1) of x's whole last dim (= 2 * cos's); fp32."""
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = _rotate(x[..., 0::2], x[..., 1::2], cos, sin)
    return out


def rope_prefix(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """The indexer's RoPE on the first 2 * half values of x (the rest unchanged): adjacent pairs
    (interleave, GLM-5) or the two halves (NeoX, DeepSeek-V3.2); fp32."""
    half = cos.shape[-1]
    out = x.clone()
    if interleave:
        out[..., :2 * half] = rope_interleaved(x[..., :2 * half], cos, sin)
    else:
        out[..., :half], out[..., half:2 * half] = _rotate(x[..., :half], x[..., half:2 * half], cos, sin)
    return out


# -- cache writes ----------------------------------------------------------------

class _Naming:
    """Re-raises a cache writer's ValueError prefixed with this op's argument (the writers name
    their own: kv_cache, k ...)."""

    def __init__(self, arg: str):
        self.arg = arg

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is ValueError:
            raise ValueError(f"{self.arg}: {exc}") from None
        return False


def _write_latent(kv_n: Tensor, kpe_r: Tensor, cache: Tensor, slots: Tensor, kv_cache_dtype: str,
                  k_scale: Tensor | None, skip_scale: bool) -> None:
    """[kv_c_normed, k_pe_roped] (fp32) into the MLA cache at slots (negative skipped), as vLLM's
    kernel: native formats store the fp32 values rounded to the cache's dtype; fp8 stores
    saturate(x / k_scale) (x itself when skip_scale); fp8_ds_mla per-128 power-of-two scales."""
    fmt = get_format(kv_cache_dtype, "mla_kv_cache_dtype")
    if fmt.name in _REFUSED_MLA_FORMATS:
        raise ValueError(f"mla_kv_cache_dtype: {fmt.name!r} is not served by mla_ext's fused_norm_rope "
                         f"({_REFUSED_MLA_FORMATS[fmt.name]}); expected auto, bfloat16, float16, fp8 or fp8_ds_mla")
    ones = torch.ones(1, dtype=torch.float32, device=cache.device)
    if fmt.quant_mode == QuantMode.NONE:
        if cache.dtype not in _FLOATS:
            raise ValueError(f"mla_kv_cache: a {fmt.name!r} cache holds bf16/fp16/fp32, got {cache.dtype}")
        with _Naming("mla_kv_cache"):
            cache_api.concat_and_cache_mla(kv_n.to(cache.dtype), kpe_r.to(cache.dtype), cache, slots, "auto", ones)
        return
    if cache.element_size() != 1:
        raise ValueError(f"mla_kv_cache: a {fmt.name!r} cache holds bytes (uint8 or float8), got {cache.dtype}")
    cache = cache.view(torch.uint8)
    scale = ones
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR and not skip_scale and k_scale is not None:
        if not isinstance(k_scale, Tensor) or k_scale.numel() != 1 or k_scale.dtype != torch.float32:
            raise ValueError(f"mla_k_scale: expected a float32 tensor with one element, got {k_scale!r}")
        scale = k_scale.reshape(1)
    with _Naming(f"mla_kv_cache ({fmt.name})"):
        cache_api.concat_and_cache_mla(kv_n, kpe_r, cache, slots, fmt.name, scale)


def _write_index_shuffled(k: Tensor, cache: Tensor, slots: Tensor) -> None:
    """vLLM's shuffled fp8 index-cache layout (ROCm's reader): within a page, token o's byte j at
    (o // 16) * 16 * D + (o % 16) * 16 + (j // 16) * 256 + j % 16, its fp32 scale after the
    B * D value bytes at 4 * o. Negative slots skipped (host-side selection: ROCm only)."""
    nb, B, width = cache.shape
    D = k.shape[1]
    if B % SHUFFLE_BLOCK_TILE or D % SHUFFLE_HEAD_TILE:
        raise ValueError(f"indexer_k_cache: the shuffled layout needs block_size a multiple of "
                         f"{SHUFFLE_BLOCK_TILE} and head_dim of {SHUFFLE_HEAD_TILE}, got {B} and {D}")
    keep = (slots >= 0) & (slots < nb * B)
    idx = keep.nonzero().flatten()
    blk, off = slots[idx] // B, slots[idx] % B
    vals, scale = quantize_fp8_rows(k[idx], D, "ue8m0")
    page = cache.as_strided((nb, B * width), (cache.stride(0), 1))
    j = torch.arange(D, device=k.device)
    col = ((off // SHUFFLE_BLOCK_TILE) * SHUFFLE_BLOCK_TILE * D + (off % SHUFFLE_BLOCK_TILE) * SHUFFLE_HEAD_TILE)[:, None] \
        + ((j // SHUFFLE_HEAD_TILE) * SHUFFLE_BLOCK_TILE * SHUFFLE_HEAD_TILE + j % SHUFFLE_HEAD_TILE)[None, :]
    page[blk[:, None], col] = vals
    scol = B * D + 4 * off[:, None] + torch.arange(4, device=k.device)[None, :]
    page[blk[:, None], scol] = scale.reshape(-1, 1).contiguous().view(torch.uint8)


def _write_index(k: Tensor, cache, slots: Tensor, shuffled: bool) -> None:
    """Index key k [T, D] (fp32) into the fp8 index cache: e4m3 values + one ue8m0 fp32 scale."""
    if not isinstance(cache, Tensor) or cache.dim() != 3 or cache.element_size() != 1:
        raise ValueError(f"indexer_k_cache: expected a 3-D uint8/float8 tensor [num_blocks, block_size, "
                         f"{k.shape[1] + 4}], got {getattr(cache, 'dtype', type(cache).__name__)} "
                         f"{tuple(getattr(cache, 'shape', ()))}")
    if cache.shape[2] != k.shape[1] + 4:
        raise ValueError(f"indexer_k_cache: rows of {cache.shape[2]} bytes, expected {k.shape[1] + 4} "
                         f"(index_head_dim e4m3 values + one fp32 scale, as vLLM's fused kernel writes)")
    if cache.device != k.device:
        raise ValueError(f"indexer_k_cache: expected a tensor on {k.device}, got {cache.device}")
    cache = cache.view(torch.uint8)
    if shuffled:
        _write_index_shuffled(k, cache, slots)
    else:
        with _Naming("indexer_k_cache"):
            write_index_cache(k, cache, slots, "fp8", quant_block_size=k.shape[1], scale_fmt="ue8m0")


# -- the two ops -------------------------------------------------------------------

def fused_norm_rope(
    positions: Tensor,
    q_c: Tensor,
    q_rms_norm_w: Tensor,
    q_rms_eps: float,
    kv_c: Tensor,
    kv_rms_norm_w: Tensor,
    kv_rms_eps: float,
    k_pe: Tensor,
    k_rope_cos_sin_cache: Tensor,
    index_k: Tensor | None,
    index_k_layer_norm_w: Tensor | None,
    index_k_layer_norm_bias: Tensor | None,
    index_k_layer_norm_eps: float,
    index_k_rope_cos_sin_cache: Tensor | None,
    topk_indices_buffer: Tensor,
    slot_mapping: Tensor | None = None,
    indexer_slot_mapping: Tensor | None = None,
    indexer_k_cache: Tensor | None = None,
    indexer_cache_shuffled: bool = False,
    mla_kv_cache: Tensor | None = None,
    mla_kv_cache_dtype: str = "auto",
    mla_k_scale: Tensor | None = None,
    has_indexer: bool = True,
    index_rope_interleave: bool = False,
    q_c_out: Tensor | None = None,
    kv_c_out: Tensor | None = None,
    k_pe_out: Tensor | None = None,
    index_k_out: Tensor | None = None,
    skip_scale: bool = False,
) -> Tensor:
    """vLLM's fused_norm_rope. For the T = len(positions) tokens:
    returns q_c_out (allocated like q_c when None) = RMSNorm(q_c) * q_rms_norm_w, every row;
    kv_c_out = RMSNorm(kv_c) * kv_rms_norm_w and k_pe_out = interleaved RoPE(k_pe) at positions,
    every row, when given; mla_kv_cache[slot] = [kv_c_out, k_pe_out] in mla_kv_cache_dtype at
    slot_mapping (negative slots skipped). With has_indexer: topk_indices_buffer[:T] = -1;
    index_k' = RoPE(LayerNorm(index_k)) (first rotary dims, NeoX or interleaved) goes to index_k_out
    and (fp8, ue8m0 scale) to indexer_k_cache at indexer_slot_mapping (default slot_mapping), both
    only for tokens whose slot_mapping entry is >= 0 (all tokens without caches)."""
    positions = _positions(positions)
    T, dev = positions.shape[0], positions.device
    _rows(q_c, "q_c", 2, T, dev)
    _weight(q_rms_norm_w, "q_rms_norm_w", q_c.shape[1], dev)
    _rows(kv_c, "kv_c", 2, T, dev)
    _weight(kv_rms_norm_w, "kv_rms_norm_w", kv_c.shape[1], dev)
    _rows(k_pe, "k_pe", 2, T, dev)
    k_half = _rope_half(k_rope_cos_sin_cache, "k_rope_cos_sin_cache", k_pe.shape[1], dev, exact=True)
    _tensor(topk_indices_buffer, "topk_indices_buffer", 2, _INTS, dev)
    if has_indexer and topk_indices_buffer.shape[0] < T:
        raise ValueError(f"topk_indices_buffer: expected at least {T} rows, got {tuple(topk_indices_buffer.shape)}")
    for arg, t in (("q_c_out", q_c_out), ("kv_c_out", kv_c_out), ("k_pe_out", k_pe_out)):
        if t is not None:
            _out(t, arg, {"q_c_out": q_c, "kv_c_out": kv_c, "k_pe_out": k_pe}[arg])
    rope_caches = [("k_rope_cos_sin_cache", k_rope_cos_sin_cache)]
    if has_indexer:
        _rows(index_k, "index_k", 2, T, dev)
        D = index_k.shape[1]
        _weight(index_k_layer_norm_w, "index_k_layer_norm_w", D, dev)
        _weight(index_k_layer_norm_bias, "index_k_layer_norm_bias", D, dev)
        i_half = _rope_half(index_k_rope_cos_sin_cache, "index_k_rope_cos_sin_cache", D, dev, exact=False)
        rope_caches.append(("index_k_rope_cos_sin_cache", index_k_rope_cos_sin_cache))
        if index_k_out is not None:
            _out(index_k_out, "index_k_out", index_k)
    else:
        indexer_k_cache = index_k_out = None  # a shared layer: no indexer work at all
    for arg, t in (("mla_kv_cache", mla_kv_cache), ("indexer_k_cache", indexer_k_cache)):
        if t is not None and (not isinstance(t, Tensor) or t.dim() != 3 or t.device != dev):
            raise ValueError(f"{arg}: expected a 3-D tensor [num_blocks, block_size, entry] on {dev}, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if indexer_k_cache is not None or mla_kv_cache is not None:
        if slot_mapping is None:
            raise ValueError("slot_mapping: required when mla_kv_cache or indexer_k_cache is given")
        slots = _slots(slot_mapping, "slot_mapping", T, dev)
    else:
        slots = None  # vLLM's kernel ignores the slots without a cache
    _check_positions(positions, rope_caches)

    q_out = torch.empty_like(q_c) if q_c_out is None else q_c_out
    q_out.copy_(_rms_norm(q_c, q_rms_norm_w, q_rms_eps))
    if has_indexer:
        topk_indices_buffer[:T].fill_(-1)

    if kv_c_out is not None or k_pe_out is not None or mla_kv_cache is not None:
        kv_n = _rms_norm(kv_c, kv_rms_norm_w, kv_rms_eps)
        kpe_r = rope_interleaved(k_pe.float(), *_cos_sin(k_rope_cos_sin_cache, positions, k_half))
        if kv_c_out is not None:
            kv_c_out.copy_(kv_n)
        if k_pe_out is not None:
            k_pe_out.copy_(kpe_r)
        if mla_kv_cache is not None:
            _write_latent(kv_n, kpe_r, mla_kv_cache, slots, mla_kv_cache_dtype, mla_k_scale, skip_scale)

    if has_indexer and (index_k_out is not None or indexer_k_cache is not None):
        k = _layer_norm(index_k, index_k_layer_norm_w, index_k_layer_norm_bias, index_k_layer_norm_eps)
        k = rope_prefix(k, *_cos_sin(index_k_rope_cos_sin_cache, positions, i_half), index_rope_interleave)
        live = None if slots is None else slots >= 0  # vLLM's kernel skips the indexer where the MLA slot < 0
        if index_k_out is not None:
            index_k_out.copy_(k if live is None else torch.where(live[:, None], k.to(index_k_out.dtype), index_k_out))
        if indexer_k_cache is not None:
            islots = slots if indexer_slot_mapping is None else _slots(indexer_slot_mapping, "indexer_slot_mapping",
                                                                        T, dev)
            _write_index(k, indexer_k_cache, torch.where(live, islots, -1), indexer_cache_shuffled)
    return q_out


def fused_q(
    positions: Tensor,
    q_pe: Tensor,
    q_pe_cos_sin_cache: Tensor,
    index_q: Tensor | None,
    index_q_cos_sin_cache: Tensor | None,
    ql_nope: Tensor,
    q_scale: Tensor,
    index_weights: Tensor | None,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    has_indexer: bool = True,
    index_rope_interleave: bool = False,
    quantize_mqa: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """vLLM's fused_q: returns (index_q_fp8, index_weights_out, mqa_q).

    mqa_q: with quantize_mqa an e4m3 [T, H, L + R] = saturate([ql_nope, RoPE(q_pe)] / q_scale),
    else RoPE(q_pe) in q_pe's dtype [T, H, R] (interleaved RoPE at positions either way).
    With has_indexer: index_q_fp8 e4m3 [T, NI, D] = RoPE(index_q) (first rotary dims, NeoX or
    interleaved) / s per (token, head), s = 2^ceil(log2(max(amax, 1e-4) / 448)), and
    index_weights_out fp32 [T, NI] = index_weights * s * softmax_scale * head_scale (fp32, in that
    order). Without: both are uninitialized (1, 1, 1) / (1, 1) placeholders, as vLLM's."""
    positions = _positions(positions, (torch.int64,))
    T, dev = positions.shape[0], positions.device
    _rows(q_pe, "q_pe", 3, T, dev)
    half = _rope_half(q_pe_cos_sin_cache, "q_pe_cos_sin_cache", q_pe.shape[2], dev, exact=True)
    _rows(ql_nope, "ql_nope", 3, T, dev)
    if ql_nope.shape[1] != q_pe.shape[1]:
        raise ValueError(f"ql_nope: expected {q_pe.shape[1]} heads (q_pe's), got shape {tuple(ql_nope.shape)}")
    if not isinstance(q_scale, Tensor) or q_scale.dtype != torch.float32 or q_scale.device != dev \
            or q_scale.numel() != 1:
        raise ValueError(f"q_scale: expected a float32 tensor with one element on {dev}, got {q_scale!r}")
    rope_caches = [("q_pe_cos_sin_cache", q_pe_cos_sin_cache)]
    if has_indexer:
        _rows(index_q, "index_q", 3, T, dev)
        NI, D = index_q.shape[1], index_q.shape[2]
        i_half = _rope_half(index_q_cos_sin_cache, "index_q_cos_sin_cache", D, dev, exact=False)
        rope_caches.append(("index_q_cos_sin_cache", index_q_cos_sin_cache))
        _rows(index_weights, "index_weights", 2, T, dev, NI)
    _check_positions(positions, rope_caches)

    H, L = q_pe.shape[1], ql_nope.shape[2]
    q_pe_r = rope_interleaved(q_pe.float(), *(c[:, None] for c in _cos_sin(q_pe_cos_sin_cache, positions, half)))
    if quantize_mqa:
        mqa_q = torch.empty(T, H, L + q_pe.shape[2], dtype=FP8, device=dev)
        raw = mqa_q.view(torch.uint8)
        scale = q_scale.reshape(1)
        raw[..., :L] = quantize_fp8_per_tensor(ql_nope, scale, FP8)
        raw[..., L:] = quantize_fp8_per_tensor(q_pe_r, scale, FP8)
    else:
        mqa_q = torch.empty_like(q_pe)
        mqa_q.copy_(q_pe_r)

    if not has_indexer:
        return (torch.empty(1, 1, 1, dtype=FP8, device=dev), torch.empty(1, 1, dtype=torch.float32, device=dev),
                mqa_q)
    iq = rope_prefix(index_q.float(), *(c[:, None] for c in _cos_sin(index_q_cos_sin_cache, positions, i_half)),
                     index_rope_interleave)
    vals, s = quantize_fp8_rows(iq.reshape(T * NI, D), D, "ue8m0")
    index_q_fp8 = vals.view(FP8).reshape(T, NI, D)
    w = index_weights.float() * s.reshape(T, NI)
    w = w * float(index_weights_softmax_scale)  # a Python scalar multiplies in fp32 (torch's opmath), as
    w = w * float(index_weights_head_scale)  # vLLM's kernel's fp32 scalar arguments; no host->device copy
    return index_q_fp8, w.contiguous(), mqa_q
