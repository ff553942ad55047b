"""Attention backends from PyTorch itself: flex_attention and varlen_attn (FA2).

Both serve `varlen_attention` (api.py) through the attention dispatcher; each
states why it cannot serve an input (`*_reasons`), probing what this torch
has instead of comparing version strings.

flex_attention (`torch.nn.attention.flex_attention`)
    The packed varlen batch is one sequence (batch 1) with a document mask
    built from cu_seqlens_q / cu_seqlens_k on the device (no host sync): query
    row i of request b sees key j of request b, and, causal, only j - k_end[b]
    <= i - q_end[b] (bottom-right aligned, as reference.py defines it). QK dim
    (192) and V dim (128) are passed as they are. The BlockMask is built from
    the offsets directly (block ranges of request ids: O(blocks²), never the
    O(Tq·Tk) dense mask create_block_mask would evaluate without compiling).
    flex's LSE is natural-log ([1, N, Tq] -> [N, Tq]); rows with no visible
    key come back o = 0, lse = -inf (normalised again here: +inf/NaN -> -inf).
    On CUDA it runs compiled: one `torch.compile(flex_attention, dynamic=True)`
    per (device, dtype, heads, head dims) bucket, cached, with one mask_mod
    code for causal and non-causal, so sequence lengths do not recompile. On
    the CPU torch.compile cannot return the LSE (torch 2.14: "torch.compile on
    CPU only supports inference and `return_lse` is not supported yet"), so
    the CPU runs flex eagerly: unfused, the [N, Tq, Tk] fp32 scores of the
    whole packed batch are materialised, hence a size cap.

varlen_attn (`torch.nn.attention.varlen`, FlashAttention-2; cuDNN on sm_90 /
sm_100 for long queries in newer torch)
    CUDA only, bf16/fp16, one head dim for Q/K/V: V is zero-padded to the QK
    dim (192, as vLLM does for FA2) and the output sliced back. LSE through
    `return_aux=AuxRequest(lse=True)`, `scale=` passed. FA2 marks rows with no
    key lse = +inf and leaves rows past cu_seqlens_q[-1] unwritten; both are
    set to o = 0, lse = -inf here (SPEC §7). Causal is served only for the
    new-token pass (cu_seqlens_k is cu_seqlens_q): FA2 aligns the causal mask
    bottom-right, but the cuDNN path newer torch takes for long queries is not
    documented to, and for q_len == k_len both agree.

Not a backend: torch SDPA (`F.scaled_dot_product_attention`) and its cuDNN
backend. SDPA's public API takes padded [B, N, S, D] batches (or nested
tensors) and returns no LSE, so it can serve neither the packed varlen layout
nor the merge of context chunks (SPEC §7). The cuDNN varlen kernel with LSE
is reachable only through the private aten op that varlen_attn already
calls (`_cudnn_attention_forward` with cum_seq_q/k), i.e. through the
varlen_attn backend on machines where torch routes to it.
"""
from __future__ import annotations

import functools
import inspect
import threading
import warnings

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
# The CPU (eager) flex path materialises the scores of the whole packed batch,
# several fp32 [N, Tq, Tk] tensors (scores, masked scores, softmax): above
# this, the torch reference (per request) is the better CPU fallback.
FLEX_EAGER_MAX_SCORE_BYTES = 256 << 20
FLEX_BLOCK = 128  # BlockMask block size (flex_attention's default, its kernels' tile)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


# ---------------------------------------------------------------------------
# flex_attention
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _flex_api():
    """(module, use_return_aux, compute_q_blocks_kw, why-not or None)."""
    try:
        from torch.nn.attention import flex_attention as fa
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return None, False, False, f"torch.nn.attention.flex_attention is not importable ({exc})"
    for name in ("flex_attention", "BlockMask"):
        if not hasattr(fa, name):
            return None, False, False, f"torch.nn.attention.flex_attention has no {name}"
    params = inspect.signature(fa.flex_attention).parameters
    use_aux = "return_aux" in params and hasattr(fa, "AuxRequest")
    if not use_aux and "return_lse" not in params:
        return None, False, False, "flex_attention returns no LSE in this torch (no return_aux / return_lse)"
    if not hasattr(fa.BlockMask, "from_kv_blocks"):
        return None, False, False, "BlockMask.from_kv_blocks is missing in this torch"
    kv_params = inspect.signature(fa.BlockMask.from_kv_blocks).parameters
    if "seq_lengths" not in kv_params:
        return None, False, False, "BlockMask.from_kv_blocks takes no seq_lengths in this torch"
    return fa, use_aux, "compute_q_blocks" in kv_params, None


@functools.lru_cache(maxsize=None)
def _has_triton_for_compile() -> str | None:
    try:
        from torch.utils._triton import has_triton
    except Exception:  # noqa: BLE001
        has_triton = None
    if has_triton is not None and not has_triton():
        return "torch.compile has no usable Triton for CUDA (torch.utils._triton.has_triton() is False)"
    return None


# Compile failures, per bucket: later calls report them instead of retrying.
_FLEX_FAILED: dict[tuple, str] = {}
_FLEX_COMPILED: dict[tuple, object] = {}
_FLEX_LOCK = threading.Lock()


def _flex_bucket(x) -> tuple:
    return (x.q.device, x.q.dtype, x.q.shape[1], x.q.shape[2], x.v.shape[2])


def flex_reasons(x) -> list[str]:
    fa, _, _, why = _flex_api()
    if why:
        return [why]
    out = []
    dev = x.q.device
    dqk, dv = x.q.shape[-1], x.v.shape[-1]
    if dev.type == "cuda":
        if torch.version.hip is not None:
            out.append("ROCm: flex_attention's compiled LSE path is not checked there")
        elif _cuda_capability(dev) < (8, 0):
            out.append(f"compiled flex_attention needs sm_80+ here, {dev} is "
                       f"sm_{''.join(map(str, _cuda_capability(dev)))}")
        tri = _has_triton_for_compile()
        if tri:
            out.append(tri)
        if not (16 <= dqk <= 256 and 16 <= dv <= 256):
            out.append(f"compiled flex_attention is used for head dims 16..256 only, got qk {dqk}, v {dv}")
        failed = _FLEX_FAILED.get(_flex_bucket(x))
        if failed:
            out.append(f"compiling flex_attention failed for this bucket: {failed}")
    elif dev.type == "cpu":
        # Eager (unfused): the packed batch's scores, one fp32 [N, Tq, Tk].
        n, tq, tk = x.q.shape[1], x.q.shape[0], x.k.shape[0]
        score_bytes = 4 * n * tq * tk
        if score_bytes > FLEX_EAGER_MAX_SCORE_BYTES:
            out.append(f"on the CPU flex_attention runs unfused and materialises [N, Tq, Tk] fp32 scores "
                       f"of the packed batch ({score_bytes / 2**20:.0f} MiB > "
                       f"{FLEX_EAGER_MAX_SCORE_BYTES >> 20} MiB); torch.compile on the CPU returns no LSE")
    else:
        out.append(f"tensors are on {dev}; flex_attention is used on CUDA (compiled) or the CPU (eager)")
    return out


def flex_heuristic(x) -> list[str]:
    """Stated-order rule (ignored when forced or a measurement decides): on the
    CPU eager flex_attention loses to the per-request reference."""
    if x.q.device.type == "cpu":
        return ["on the CPU eager flex_attention is slower than the torch reference (bench_attention "
                "--quick on a 2-core CPU: 190 ms vs 1.6 ms for 2x128 causal, 4 heads)"]
    return []


def _doc_mask_mod(doc_q, doc_k, rel_q, rel_k):
    # One code object for causal and non-causal (non-causal: rel_q = rel_k = 0),
    # so a compiled flex_attention is not recompiled for either.
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_q[q_idx] == doc_k[kv_idx]) & (rel_k[kv_idx] <= rel_q[q_idx])

    return mask_mod


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> (num [1,1,nq] int32, indices [1,1,nq,nk] int32, the set ones first)."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None].contiguous(), idx[None, None].contiguous()


def _request_index(cu: torch.Tensor, rows: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions 0..rows-1 (rows >= total: padding): (raw request index in
    [-1, B], monotone; -1 before cu[0], B past cu[-1] or total), and each
    position's offset from the end of its request (used when inside one)."""
    batch = cu.numel() - 1
    cu64 = cu.to(torch.int64)
    pos = torch.arange(rows, device=cu.device, dtype=torch.int64)
    raw = torch.searchsorted(cu64, pos, right=True) - 1
    raw = torch.where(pos < total, raw, batch).clamp(-1, batch)
    end = cu64[(raw.clamp(0, max(batch - 1, 0)) + 1)]
    return raw, pos - end


def document_block_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, tq: int, tk: int,
                        causal: bool, block: int = FLEX_BLOCK):
    """The flex_attention BlockMask of a packed varlen batch (batch 1, heads
    broadcast), built on the offsets' device without a host sync.

    Per block of `block` rows/keys, the range of request ids it touches gives
    the block pairs that may hold a visible pair (partial: mask_mod decides)
    and those whose every pair is visible (full: both blocks inside one
    request, and causal, the whole key block at or below the query block's
    first row). Conservative where a block spans several requests (partial)."""
    fa, _, has_cqb, why = _flex_api()
    if why:
        raise RuntimeError(why)
    batch = cu_seqlens_q.numel() - 1
    nq, nk = -(-tq // block), -(-tk // block)
    raw_q, rel_q = _request_index(cu_seqlens_q, nq * block, tq)
    raw_k, rel_k = _request_index(cu_seqlens_k, nk * block, tk)
    inside_q = (raw_q >= 0) & (raw_q < batch)
    inside_k = (raw_k >= 0) & (raw_k < batch)
    # Ids that never match across q and k outside every request.
    doc_q = torch.where(inside_q, raw_q, -1).to(torch.int32)
    doc_k = torch.where(inside_k, raw_k, -2).to(torch.int32)
    if causal:
        rq, rk = rel_q.to(torch.int32), rel_k.to(torch.int32)
    else:
        rq = torch.zeros_like(doc_q)
        rk = torch.zeros_like(doc_k)

    # Block ranges of the monotone raw ids (padding rows count as B).
    a0, a1 = raw_q[0::block], raw_q[block - 1::block]
    b0, b1 = raw_k[0::block], raw_k[block - 1::block]
    lo_q, hi_q = a0.clamp(min=0), a1.clamp(max=batch - 1)
    lo_k, hi_k = b0.clamp(min=0), b1.clamp(max=batch - 1)
    overlap = torch.maximum(lo_q[:, None], lo_k[None, :]) <= torch.minimum(hi_q[:, None], hi_k[None, :])
    one_q = (a0 == a1) & (a0 >= 0) & (a0 < batch)
    one_k = (b0 == b1) & (b0 >= 0) & (b0 < batch)
    same = one_q[:, None] & one_k[None, :] & (a0[:, None] == b0[None, :])
    if causal:
        # Within one request rel is increasing: the block's first/last entries bound it.
        q_first, q_last = rel_q[0::block], rel_q[block - 1::block]
        k_first, k_last = rel_k[0::block], rel_k[block - 1::block]
        some = torch.where(same, k_first[None, :] <= q_last[:, None], overlap)
        full = same & (k_last[None, :] <= q_first[:, None])
    else:
        some, full = overlap, same
    partial = some & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    kw = dict(BLOCK_SIZE=block, mask_mod=_doc_mask_mod(doc_q, doc_k, rq, rk), seq_lengths=(tq, tk))
    if has_cqb:
        kw["compute_q_blocks"] = False  # forward only
    return fa.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, **kw)


def _compiled_flex(x):
    key = _flex_bucket(x)
    fn = _FLEX_COMPILED.get(key)
    if fn is None:
        with _FLEX_LOCK:
            fn = _FLEX_COMPILED.get(key)
            if fn is None:
                fa = _flex_api()[0]
                fn = torch.compile(fa.flex_attention, dynamic=True, fullgraph=True)
                _FLEX_COMPILED[key] = fn
    return fn


def flex_compiled_buckets() -> list[tuple]:
    """The (device, dtype, heads, qk dim, v dim) buckets compiled so far."""
    return list(_FLEX_COMPILED)


def flex_run(x, keys) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys()` returns the assembled key tensor [Tk, N, Dqk] (api.py)."""
    fa, use_aux, _, _ = _flex_api()
    q, v = x.q, x.v
    tq, n, _ = q.shape
    tk, dv = v.shape[0], v.shape[-1]
    out = torch.zeros(tq, n, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((n, tq), float("-inf"), dtype=torch.float32, device=q.device)
    if tq == 0 or tk == 0 or n == 0 or x.cu_seqlens_q.numel() < 2:
        return out, lse
    k = keys()
    bm = document_block_mask(x.cu_seqlens_q, x.cu_seqlens_k, tq, tk, x.causal)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, N, T, D] views
    kw = dict(block_mask=bm, scale=x.softmax_scale)
    if use_aux:
        kw["return_aux"] = fa.AuxRequest(lse=True)
    else:
        kw["return_lse"] = True
    if q.device.type == "cuda":
        fn = _compiled_flex(x)
        try:
            o, aux = fn(qh, kh, vh, **kw)
        except Exception as exc:
            _FLEX_FAILED[_flex_bucket(x)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            raise
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
            o, aux = fa.flex_attention(qh, kh, vh, **kw)
    l_ = (aux.lse if use_aux else aux)[0].float()  # [N, Tq], natural log
    ok = torch.isfinite(l_)
    torch.where(ok, l_, _scalar(float("-inf"), lse), out=lse)
    torch.where(ok.t().unsqueeze(-1), o[0].transpose(0, 1), _scalar(0.0, out), out=out)
    return out, lse


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    # A 0-dim tensor made on the device by a fill (no host-to-device copy).
    return torch.full((), value, dtype=like.dtype, device=like.device)


# ---------------------------------------------------------------------------
# varlen_attn (FlashAttention-2)
# ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _varlen_api():
    """(varlen_attn, AuxRequest, causal keyword: "window_size" | "is_causal", why-not or None)."""
    try:
        from torch.nn.attention import varlen
    except Exception as exc:  # noqa: BLE001
        return None, None, None, f"torch.nn.attention.varlen is not importable in torch {torch.__version__} ({exc})"
    fn, aux = getattr(varlen, "varlen_attn", None), getattr(varlen, "AuxRequest", None)
    if fn is None or aux is None:
        return None, None, None, "torch.nn.attention.varlen has no varlen_attn / AuxRequest"
    params = inspect.signature(fn).parameters
    if "return_aux" not in params:
        return None, None, None, "varlen_attn takes no return_aux (no LSE) in this torch"
    if "scale" not in params:
        return None, None, None, "varlen_attn takes no scale= in this torch (only 1/sqrt(D))"
    causal_kw = "window_size" if "window_size" in params else ("is_causal" if "is_causal" in params else None)
    return fn, aux, causal_kw, None


@functools.lru_cache(maxsize=None)
def _flash_built() -> str | None:
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if probe is not None and not probe():
        return "this torch was built without FlashAttention (torch.backends.cuda.is_flash_attention_available())"
    return None


def _same_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def varlen_reasons(x) -> list[str]:
    fn, _, causal_kw, why = _varlen_api()
    if why:
        return [why]
    out = []
    dev = x.q.device
    if dev.type != "cuda":
        out.append(f"tensors are on {dev}; varlen_attn (FlashAttention-2) runs on CUDA only")
    else:
        if torch.version.hip is not None:
            out.append("ROCm: varlen_attn's LSE conventions are not checked there")
        elif _cuda_capability(dev) < (8, 0):
            cap = "".join(map(str, _cuda_capability(dev)))
            out.append(f"FlashAttention-2 needs sm_80+, {dev} is sm_{cap}")
        built = _flash_built()
        if built:
            out.append(built)
    if x.q.dtype not in LOW_PRECISION:
        out.append(f"dtype {x.q.dtype}: FlashAttention-2 takes bfloat16 or float16")
    dqk, dv = x.q.shape[-1], x.v.shape[-1]
    if dqk % 8 or dqk > 256:
        out.append(f"qk head dim {dqk}: FlashAttention-2 takes multiples of 8 up to 256")
    if dv > dqk:
        out.append(f"v head dim {dv} > qk head dim {dqk}: V is padded to the QK dim, not the other way")
    if x.causal:
        if causal_kw is None:
            out.append("varlen_attn takes neither window_size nor is_causal in this torch")
        elif not _same_offsets(x.cu_seqlens_q, x.cu_seqlens_k):
            out.append("causal with cu_seqlens_k other than cu_seqlens_q: served only for the new-token pass "
                       "(q_len == k_len), where every causal alignment agrees")
    return out


def varlen_run(x, keys, scratch_take) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys()`: the assembled keys; `scratch_take(name, shape)`: a reusable buffer."""
    fn, aux_cls, causal_kw, _ = _varlen_api()
    q, v = x.q, x.v
    tq, n, dqk = q.shape
    tk, dv = v.shape[0], v.shape[-1]
    batch = x.cu_seqlens_q.numel() - 1
    max_q, max_k = min(x.max_seqlen_q, tq), min(x.max_seqlen_k, tk)
    if tq == 0 or tk == 0 or n == 0 or batch == 0 or max_q == 0 or max_k == 0:
        return (torch.zeros(tq, n, dv, dtype=q.dtype, device=q.device),
                torch.full((n, tq), float("-inf"), dtype=torch.float32, device=q.device))
    k = keys()
    if dv < dqk:
        vp = scratch_take("v_padded", (tk, n, dqk))
        vp[..., :dv].copy_(v)
        vp[..., dv:].zero_()
    else:
        vp = v
    kw = dict(return_aux=aux_cls(lse=True), scale=x.softmax_scale)
    if x.causal:
        kw[causal_kw] = (-1, 0) if causal_kw == "window_size" else True
    o, l_ = fn(q, k, vp, x.cu_seqlens_q, x.cu_seqlens_k, max_q, max_k, **kw)
    l_ = l_.float()
    if l_.dim() == 3 and l_.shape[-1] == 1:
        l_ = l_[..., 0]
    if tuple(l_.shape) == (tq, n) and (tq, n) != (n, tq):
        l_ = l_.t()
    if tuple(l_.shape) != (n, tq):
        raise RuntimeError(f"varlen_attn returned an LSE of shape {tuple(l_.shape)}, expected [{n}, {tq}]")
    # Rows past the last request are not written; rows with no key have lse +inf.
    rows = torch.arange(tq, device=q.device)
    in_req = (rows >= x.cu_seqlens_q[0]) & (rows < x.cu_seqlens_q[-1])
    ok = torch.isfinite(l_) & in_req[None, :]
    lse = torch.empty(n, tq, dtype=torch.float32, device=q.device)
    torch.where(ok, l_, _scalar(float("-inf"), lse), out=lse)
    out = torch.empty(tq, n, dv, dtype=q.dtype, device=q.device)
    torch.where(ok.t().unsqueeze(-1), o[..., :dv], _scalar(0.0, out), out=out)
    return out, lse


def backend_facts() -> dict[str, str]:
    """What this torch offers, for reports: probe results, never versions compared."""
    facts = {}
    why = _flex_api()[3]
    facts["flex_attention"] = why or "available (CUDA: compiled per bucket; CPU: eager, capped)"
    why = _varlen_api()[3]
    facts["varlen_attn"] = why or f"available (causal via {_varlen_api()[2]})"
    return facts

