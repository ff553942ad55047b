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

Two paths (mla_ext.dispatch; MLA_EXT_FORCE_DSA_FUSED_NORM_ROPE / _DSA_FUSED_Q=triton|torch):
"triton" (triton_dsa_model_ops.py: one launch per op, software e4m3, no fp8 types) is chosen on
CUDA for every configuration these ops serve (latent cache auto/bf16/fp16/fp32, fp8 per tensor,
fp8_ds_mla or none; index cache plain or shuffled or none; shared layers), except tensors whose
rows are not unit-stride, a cache whose rows are not contiguous, fp8_ds_mla with L != 512 or
R != 64, q_c wider than 8192, kv_c not a power of two <= 1024, index heads above 512 (those take
the torch path). "torch" (fp32 torch ops and mla_ext's cache writers, 20-40 launches) is the CPU
path; the Triton one runs on the CPU only when forced, under TRITON_INTERPRET=1.

Where vLLM's kernel reads or writes out of bounds, these raise ValueError (or skip, for a
negative indexer slot) instead; formats vLLM's kernel cannot serve on these GPUs (nvfp4_ds_mla:
an sm_100 instruction; fp8_e5m2: vLLM's kernel writes e4m3 bytes into it) are refused. The
indexer cache's scales are fp32, as vLLM writes them everywhere but SM100 (MX scales).
Reference: dsa_model_ops_reference.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext.cache import api as cache_api
from mla_ext.cache.reference import quantize_fp8_per_tensor
from mla_ext.config.formats import QuantMode, get_format
from mla_ext.dispatch import Backend, Dispatcher, report_device
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


def _slots(t, arg: str, T: int, device) -> None:
    """A slot mapping with at least T entries (kept as given: an int32 -> int64 copy would be a
    launch; the Triton kernel reads either, the torch path converts)."""
    _tensor(t, arg, 1, _INTS, device)
    if t.shape[0] < T:
        raise ValueError(f"{arg}: expected at least {T} entries (one per token), got {t.shape[0]}")


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


def _check_latent(cache: Tensor, kv_cache_dtype: str, k_scale: Tensor | None, skip_scale: bool):
    """The MLA cache's format (served, and cache's dtype fits it) and the fp8 per-tensor scale its
    writer divides by (None: 1, as for every other format, skip_scale or no k_scale)."""
    fmt = get_format(kv_cache_dtype, "mla_kv_cache_dtype")
    if fmt.name in _REFUSED_MLA_FORMATS:
        raise ValueError(f"mla_kv_cache_dtype: {fmt.name!r} is not served by mla_ext's fused_norm_rope "
                         f"({_REFUSED_MLA_FORMATS[fmt.name]}); expected auto, bfloat16, float16, fp8 or fp8_ds_mla")
    if fmt.quant_mode == QuantMode.NONE:
        if cache.dtype not in _FLOATS:
            raise ValueError(f"mla_kv_cache: a {fmt.name!r} cache holds bf16/fp16/fp32, got {cache.dtype}")
        return fmt, None
    if cache.element_size() != 1:
        raise ValueError(f"mla_kv_cache: a {fmt.name!r} cache holds bytes (uint8 or float8), got {cache.dtype}")
    if fmt.quant_mode == QuantMode.FP8_PER_TENSOR and not skip_scale and k_scale is not None:
        if not isinstance(k_scale, Tensor) or k_scale.numel() != 1 or k_scale.dtype != torch.float32 \
                or k_scale.device != cache.device:
            raise ValueError(f"mla_k_scale: expected a float32 tensor with one element on {cache.device}, "
                             f"got {k_scale!r}")
        return fmt, k_scale.reshape(1)
    return fmt, None


def _write_latent(kv_n: Tensor, kpe_r: Tensor, cache: Tensor, slots: Tensor, fmt, scale: Tensor | None) -> None:
    """[kv_c_normed, k_pe_roped] (fp32) into the MLA cache at slots (negative skipped), as vLLM's
    kernel: native formats store the fp32 values rounded to the cache's dtype; fp8 stores
    saturate(x / scale); fp8_ds_mla per-128 power-of-two scales. `fmt`, `scale`: _check_latent's."""
    ones = torch.ones(1, dtype=torch.float32, device=cache.device)
    if fmt.quant_mode == QuantMode.NONE:
        with _Naming("mla_kv_cache"):
            cache_api.concat_and_cache_mla(kv_n.to(cache.dtype), kpe_r.to(cache.dtype), cache, slots, "auto", ones)
        return
    with _Naming(f"mla_kv_cache ({fmt.name})"):
        cache_api.concat_and_cache_mla(kv_n, kpe_r, cache.view(torch.uint8), slots, fmt.name,
                                       ones if scale is None else scale)


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


def _check_index_cache(cache, D: int, device) -> Tensor:
    """The fp8 index cache [num_blocks, block_size, D + 4] as uint8 (e4m3 values + fp32 scale)."""
    if not isinstance(cache, Tensor) or cache.dim() != 3 or cache.element_size() != 1:
        raise ValueError(f"indexer_k_cache: expected a 3-D uint8/float8 tensor [num_blocks, block_size, "
                         f"{D + 4}], got {getattr(cache, 'dtype', type(cache).__name__)} "
                         f"{tuple(getattr(cache, 'shape', ()))}")
    if cache.shape[2] != D + 4:
        raise ValueError(f"indexer_k_cache: rows of {cache.shape[2]} bytes, expected {D + 4} "
                         f"(index_head_dim e4m3 values + one fp32 scale, as vLLM's fused kernel writes)")
    if cache.device != device:
        raise ValueError(f"indexer_k_cache: expected a tensor on {device}, got {cache.device}")
    return cache.view(torch.uint8)


def _write_index(k: Tensor, cache: Tensor, slots: Tensor, shuffled: bool) -> None:
    """Index key k [T, D] (fp32) into the checked uint8 index cache: e4m3 values + one ue8m0 fp32 scale."""
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
    _rope_half(k_rope_cos_sin_cache, "k_rope_cos_sin_cache", k_pe.shape[1], dev, exact=True)
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
        _rope_half(index_k_rope_cos_sin_cache, "index_k_rope_cos_sin_cache", D, dev, exact=False)
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
        _slots(slot_mapping, "slot_mapping", T, dev)
    else:
        slot_mapping = indexer_slot_mapping = None  # vLLM's kernel ignores the slots without a cache
    _check_positions(positions, rope_caches)
    fmt = scale = None
    if mla_kv_cache is not None:
        fmt, scale = _check_latent(mla_kv_cache, mla_kv_cache_dtype, mla_k_scale, skip_scale)
    if indexer_k_cache is not None:
        indexer_k_cache = _check_index_cache(indexer_k_cache, index_k.shape[1], dev)
        if indexer_slot_mapping is not None:
            _slots(indexer_slot_mapping, "indexer_slot_mapping", T, dev)
        else:
            indexer_slot_mapping = slot_mapping

    q_out = torch.empty_like(q_c) if q_c_out is None else q_c_out
    NORM_ROPE(NormRopeInputs(
        positions, q_c, q_rms_norm_w, q_rms_eps, kv_c, kv_rms_norm_w, kv_rms_eps, k_pe, k_rope_cos_sin_cache,
        index_k, index_k_layer_norm_w, index_k_layer_norm_bias, index_k_layer_norm_eps, index_k_rope_cos_sin_cache,
        topk_indices_buffer, slot_mapping, indexer_slot_mapping, indexer_k_cache, bool(indexer_cache_shuffled),
        mla_kv_cache, fmt, scale, bool(has_indexer), bool(index_rope_interleave), q_out, kv_c_out, k_pe_out,
        index_k_out))
    return q_out


@dataclass(frozen=True)
class NormRopeInputs:
    """fused_norm_rope's checked arguments (slot tensors raw, with at least T entries; None without
    caches; indexer_slot_mapping defaulted to slot_mapping), the MLA cache's format and the fp8
    per-tensor scale (_check_latent), the index cache as uint8, and q_out allocated."""
    positions: Tensor
    q_c: Tensor
    q_rms_norm_w: Tensor
    q_rms_eps: float
    kv_c: Tensor
    kv_rms_norm_w: Tensor
    kv_rms_eps: float
    k_pe: Tensor
    k_rope_cos_sin_cache: Tensor
    index_k: Tensor | None
    index_k_layer_norm_w: Tensor | None
    index_k_layer_norm_bias: Tensor | None
    index_k_layer_norm_eps: float
    index_k_rope_cos_sin_cache: Tensor | None
    topk_indices_buffer: Tensor
    slot_mapping: Tensor | None
    indexer_slot_mapping: Tensor | None
    indexer_k_cache: Tensor | None
    indexer_cache_shuffled: bool
    mla_kv_cache: Tensor | None
    mla_format: object
    mla_k_scale: Tensor | None
    has_indexer: bool
    index_rope_interleave: bool
    q_out: Tensor
    kv_c_out: Tensor | None
    k_pe_out: Tensor | None
    index_k_out: Tensor | None

    @property
    def device(self) -> torch.device:
        return self.positions.device


def _norm_rope_torch(x: NormRopeInputs) -> None:
    """The CPU path: torch ops in fp32 and mla_ext's cache writers (about 20-40 launches)."""
    T = x.positions.shape[0]
    x.q_out.copy_(_rms_norm(x.q_c, x.q_rms_norm_w, x.q_rms_eps))
    if x.has_indexer:
        x.topk_indices_buffer[:T].fill_(-1)
    slots = None if x.slot_mapping is None else x.slot_mapping[:T].to(torch.int64)
    if x.kv_c_out is not None or x.k_pe_out is not None or x.mla_kv_cache is not None:
        kv_n = _rms_norm(x.kv_c, x.kv_rms_norm_w, x.kv_rms_eps)
        half = x.k_rope_cos_sin_cache.shape[1] // 2
        kpe_r = rope_interleaved(x.k_pe.float(), *_cos_sin(x.k_rope_cos_sin_cache, x.positions, half))
        if x.kv_c_out is not None:
            x.kv_c_out.copy_(kv_n)
        if x.k_pe_out is not None:
            x.k_pe_out.copy_(kpe_r)
        if x.mla_kv_cache is not None:
            _write_latent(kv_n, kpe_r, x.mla_kv_cache, slots, x.mla_format, x.mla_k_scale)

    if x.has_indexer and (x.index_k_out is not None or x.indexer_k_cache is not None):
        k = _layer_norm(x.index_k, x.index_k_layer_norm_w, x.index_k_layer_norm_bias, x.index_k_layer_norm_eps)
        half = x.index_k_rope_cos_sin_cache.shape[1] // 2
        k = rope_prefix(k, *_cos_sin(x.index_k_rope_cos_sin_cache, x.positions, half), x.index_rope_interleave)
        live = None if slots is None else slots >= 0  # vLLM's kernel skips the indexer where the MLA slot < 0
        if x.index_k_out is not None:
            out = x.index_k_out
            out.copy_(k if live is None else torch.where(live[:, None], k.to(out.dtype), out))
        if x.indexer_k_cache is not None:
            islots = x.indexer_slot_mapping[:T].to(torch.int64)
            _write_index(k, x.indexer_k_cache, torch.where(live, islots, -1), x.indexer_cache_shuffled)


def _unit_last(**tensors) -> list[str]:
    return [f"{n}: a last-dim stride of {t.stride(-1)} (the kernel reads unit-stride rows)"
            for n, t in tensors.items() if t is not None and t.numel() > 1 and t.stride(-1) != 1]


def _mla_mode(x: NormRopeInputs) -> tuple[int, list[str]]:
    """The Triton kernel's MLA-cache mode, or why it does not write this cache."""
    from mla_ext.vllm import triton_dsa_model_ops as K

    c = x.mla_kv_cache
    if c is None:
        return K.MLA_NONE, []
    L, R, qm = x.kv_c.shape[1], x.k_pe.shape[1], x.mla_format.quant_mode
    if c.stride(2) != 1:
        return -1, ["mla_kv_cache: rows are not contiguous"]
    if qm == QuantMode.FP8_PER_TILE:
        if L != 512 or R != 64 or c.shape[2] * c.element_size() != 656:
            return -1, [f"fp8_ds_mla with L={L}, R={R}, entry {c.shape[2]} (the kernel writes 512 + 64 into 656 B)"]
        return K.MLA_DS, []
    if c.shape[2] != L + R:
        return -1, [f"mla_kv_cache: entry {c.shape[2]}, the kernel writes L + R = {L + R}"]
    if qm == QuantMode.NONE:
        return K.MLA_NATIVE, []
    if qm == QuantMode.FP8_PER_TENSOR and x.mla_format.fp8_dtype == FP8:
        return K.MLA_FP8, []
    return -1, [f"mla cache format {x.mla_format.name!r}: the torch path writes it"]


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _norm_rope_triton_reasons(x: NormRopeInputs) -> list[str]:
    from mla_ext.vllm.triton_dsa_model_ops import not_supported_reasons

    why = list(not_supported_reasons(x.q_c))
    if x.device.type == "cpu" and NORM_ROPE._forced_name() != "triton":
        why.append("CPU tensors: the Triton interpreter runs only when forced")
    why += _unit_last(q_c=x.q_c, kv_c=x.kv_c, k_pe=x.k_pe, k_rope_cos_sin_cache=x.k_rope_cos_sin_cache,
                      index_k=x.index_k, index_k_rope_cos_sin_cache=x.index_k_rope_cos_sin_cache,
                      q_rms_norm_w=x.q_rms_norm_w, kv_rms_norm_w=x.kv_rms_norm_w,
                      index_k_layer_norm_w=x.index_k_layer_norm_w, index_k_layer_norm_bias=x.index_k_layer_norm_bias,
                      q_out=x.q_out, kv_c_out=x.kv_c_out, k_pe_out=x.k_pe_out, index_k_out=x.index_k_out,
                      slot_mapping=x.slot_mapping, indexer_slot_mapping=x.indexer_slot_mapping)
    if x.q_c.shape[1] > 8192 or not _pow2(x.kv_c.shape[1]) or x.kv_c.shape[1] > 1024:
        why.append(f"q_c width {x.q_c.shape[1]} (<= 8192) / kv_c width {x.kv_c.shape[1]} (a power of two <= 1024)")
    if x.has_indexer and x.index_k.shape[1] > 512:
        why.append(f"index_k width {x.index_k.shape[1]} is above the kernel's 512")
    why += _mla_mode(x)[1]
    c = x.indexer_k_cache
    if x.has_indexer and c is not None:
        if c.stride(2) != 1 or c.stride(1) != c.shape[2]:
            why.append("indexer_k_cache: a page's rows are not contiguous")
        D = x.index_k.shape[1]
        if x.indexer_cache_shuffled and (c.shape[1] % SHUFFLE_BLOCK_TILE or D % SHUFFLE_HEAD_TILE):
            why.append("shuffled index cache with block_size or head_dim not a multiple of 16")
    return why


def _norm_rope_triton(x: NormRopeInputs) -> None:
    from mla_ext.vllm.triton_dsa_model_ops import norm_rope_triton

    norm_rope_triton(x, _mla_mode(x)[0])


NORM_ROPE = Dispatcher("dsa_fused_norm_rope", [
    Backend("triton", _norm_rope_triton_reasons, _norm_rope_triton),
    Backend("torch", lambda x: [], _norm_rope_torch),
])


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
    _rope_half(q_pe_cos_sin_cache, "q_pe_cos_sin_cache", q_pe.shape[2], dev, exact=True)
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
        _rope_half(index_q_cos_sin_cache, "index_q_cos_sin_cache", D, dev, exact=False)
        rope_caches.append(("index_q_cos_sin_cache", index_q_cos_sin_cache))
        _rows(index_weights, "index_weights", 2, T, dev, NI)
    _check_positions(positions, rope_caches)

    H, L = q_pe.shape[1], ql_nope.shape[2]
    if quantize_mqa:
        mqa_q = torch.empty(T, H, L + q_pe.shape[2], dtype=FP8, device=dev)
    else:
        mqa_q = torch.empty_like(q_pe)
    if not has_indexer:
        index_q_fp8 = torch.empty(1, 1, 1, dtype=FP8, device=dev)
        w_out = torch.empty(1, 1, dtype=torch.float32, device=dev)
    else:
        index_q_fp8 = torch.empty(T, NI, D, dtype=FP8, device=dev)
        w_out = torch.empty(T, NI, dtype=torch.float32, device=dev)
    FUSED_Q(QInputs(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope, q_scale,
                    index_weights, float(index_weights_softmax_scale), float(index_weights_head_scale),
                    bool(has_indexer), bool(index_rope_interleave), bool(quantize_mqa), mqa_q, index_q_fp8, w_out))
    return index_q_fp8, w_out, mqa_q


@dataclass(frozen=True)
class QInputs:
    """fused_q's checked arguments and its allocated outputs (placeholders without the indexer)."""
    positions: Tensor
    q_pe: Tensor
    q_pe_cos_sin_cache: Tensor
    index_q: Tensor | None
    index_q_cos_sin_cache: Tensor | None
    ql_nope: Tensor
    q_scale: Tensor
    index_weights: Tensor | None
    index_weights_softmax_scale: float
    index_weights_head_scale: float
    has_indexer: bool
    index_rope_interleave: bool
    quantize_mqa: bool
    mqa_q: Tensor
    index_q_fp8: Tensor
    index_weights_out: Tensor

    @property
    def device(self) -> torch.device:
        return self.positions.device


def _q_torch(x: QInputs) -> None:
    """The CPU path: torch ops in fp32 and mla_ext's fp8 quantizers."""
    T, H, R = x.q_pe.shape
    L = x.ql_nope.shape[2]
    cs = _cos_sin(x.q_pe_cos_sin_cache, x.positions, R // 2)
    q_pe_r = rope_interleaved(x.q_pe.float(), *(c[:, None] for c in cs))
    if x.quantize_mqa:
        raw = x.mqa_q.view(torch.uint8)
        scale = x.q_scale.reshape(1)
        raw[..., :L] = quantize_fp8_per_tensor(x.ql_nope, scale, FP8)
        raw[..., L:] = quantize_fp8_per_tensor(q_pe_r, scale, FP8)
    else:
        x.mqa_q.copy_(q_pe_r)
    if not x.has_indexer:
        return
    NI, D = x.index_q.shape[1], x.index_q.shape[2]
    cs = _cos_sin(x.index_q_cos_sin_cache, x.positions, x.index_q_cos_sin_cache.shape[1] // 2)
    iq = rope_prefix(x.index_q.float(), *(c[:, None] for c in cs), x.index_rope_interleave)
    vals, s = quantize_fp8_rows(iq.reshape(T * NI, D), D, "ue8m0")
    x.index_q_fp8.view(torch.uint8).copy_(vals.reshape(T, NI, D))
    w = x.index_weights.float() * s.reshape(T, NI)
    w = w * x.index_weights_softmax_scale  # a Python scalar multiplies in fp32 (torch's opmath), as
    w = w * x.index_weights_head_scale  # vLLM's kernel's fp32 scalar arguments; no host->device copy
    x.index_weights_out.copy_(w)


def _q_triton_reasons(x: QInputs) -> list[str]:
    from mla_ext.vllm.triton_dsa_model_ops import not_supported_reasons

    why = list(not_supported_reasons(x.q_pe))
    if x.device.type == "cpu" and FUSED_Q._forced_name() != "triton":
        why.append("CPU tensors: the Triton interpreter runs only when forced")
    why += _unit_last(q_pe=x.q_pe, q_pe_cos_sin_cache=x.q_pe_cos_sin_cache, ql_nope=x.ql_nope, index_q=x.index_q,
                      index_q_cos_sin_cache=x.index_q_cos_sin_cache)
    if x.ql_nope.shape[2] > 1024 or (x.has_indexer and x.index_q.shape[2] > 512):
        why.append("ql_nope width above 1024 or index head above 512 (the kernel's tiles)")
    return why


def _q_triton(x: QInputs) -> None:
    from mla_ext.vllm.triton_dsa_model_ops import q_triton

    q_triton(x, x.mqa_q.view(torch.uint8) if x.quantize_mqa else x.mqa_q,
             x.index_q_fp8.view(torch.uint8) if x.has_indexer else None,
             x.index_weights_out if x.has_indexer else None)


FUSED_Q = Dispatcher("dsa_fused_q", [
    Backend("triton", _q_triton_reasons, _q_triton),
    Backend("torch", lambda x: [], _q_torch),
])


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for a DeepSeek-V3.2-shaped probe on `device` (default: CUDA if visible)."""
    dev = report_device(device)
    bf = dict(dtype=torch.bfloat16, device=dev)
    pos = torch.zeros(1, dtype=torch.int64, device=dev)
    cs = torch.ones(4, 64, device=dev)
    q_c, kv_c, k_pe, ik = (torch.ones(1, n, **bf) for n in (1536, 512, 64, 128))
    w = torch.ones(1, device=dev)
    nr = NormRopeInputs(pos, q_c, q_c[0], 1e-6, kv_c, kv_c[0], 1e-6, k_pe, cs, ik, ik[0], ik[0], 1e-6, cs,
                        torch.empty(1, 2048, dtype=torch.int32, device=dev), pos, pos,
                        torch.empty(1, 64, 132, dtype=torch.uint8, device=dev), False,
                        torch.empty(1, 64, 656, dtype=torch.uint8, device=dev), get_format("fp8_ds_mla"), None,
                        True, False, q_c, None, None, None)
    q_pe, ql, iq = torch.ones(1, 1, 64, **bf), torch.ones(1, 1, 512, **bf), torch.ones(1, 1, 128, **bf)
    q = QInputs(pos, q_pe, cs, iq, cs, ql, w, torch.ones(1, 1, **bf), 1.0, 1.0, True, False, True,
                torch.empty(1, 1, 576, dtype=FP8, device=dev), torch.empty(1, 1, 128, dtype=FP8, device=dev),
                torch.empty(1, 1, device=dev))
    return ([(NORM_ROPE.op, b.name, b.not_supported_reasons(nr)) for b in NORM_ROPE.backends]
            + [(FUSED_Q.op, b.name, b.not_supported_reasons(q)) for b in FUSED_Q.backends])
