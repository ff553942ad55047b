"""The DSA indexer logits in DeepGEMM's contracts (fp8 forms; mla_ext/sparse/indexer_ops_reference.py),
for GPUs DeepGEMM's MQA-logits kernels do not serve (they are SM90+):

mqa_logits(q, k, k_scale, weights, ks, ke, max_seqlen_k)          -> fp32 [M, max_seqlen_k]
paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_model_len)
                                                                  -> fp32 [B * next_n, max_model_len]

Both dispatch (mla_ext.dispatch) to Triton (triton_mqa_logits.py; CPU tensors only when forced,
under TRITON_INTERPRET=1) and torch (below: the keys dequantized in float32, scored with einsum in
row blocks, a bounded workspace). Entries outside each row's range are -inf (DeepGEMM leaves them
unspecified; vLLM's top-k reads only inside the range). No host sync on CUDA: the ranges are
read by the kernels. ValueError naming the argument for a wrong dtype / shape / device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext._args import check_no_meta
from mla_ext.dispatch import Backend, Dispatcher, report_device
from mla_ext.sparse.topk_per_row import decode_row_ends

_FP8 = (torch.float8_e4m3fn, torch.uint8)
ROWS_BUDGET = 1 << 24  # float32 elements of the torch backend's [rows, H, keys] workspace


def _check(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _bytes(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


@dataclass(frozen=True)
class MqaInputs:
    q: Tensor  # uint8 [M, H, D] e4m3 bytes
    k: Tensor  # uint8 [N, D]
    k_scale: Tensor  # fp32 [N]
    weights: Tensor  # [M, H]
    ks: Tensor  # int32 [M]
    ke: Tensor  # int32 [M]
    out: Tensor  # fp32 [M, W], -inf

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass(frozen=True)
class PagedInputs:
    q: Tensor  # uint8 [B, next_n, H, D]
    cache: Tensor  # uint8 [nb, bs, D + 4]
    weights: Tensor  # [B * next_n, H]
    row_ends: Tensor  # int32 [rows]
    block_tables: Tensor  # int32 [B, max_blocks]
    out: Tensor  # fp32 [rows, W], -inf

    @property
    def device(self) -> torch.device:
        return self.q.device


def _dequant(vals: Tensor, scales: Tensor) -> Tensor:
    return vals.view(torch.float8_e4m3fn).to(torch.float32) * scales.to(torch.float32)[..., None]


def _triton_reasons(x, forced_name) -> list[str]:
    from mla_ext.sparse import triton_mqa_logits as TM

    why = TM.not_supported_reasons(x.q)
    if x.device.type == "cpu" and forced_name != "triton":
        why.append("CPU tensors: the Triton interpreter runs only when forced")
    return why + TM._fits(x.q.shape[-1], x.q.shape[-2])


def _mqa_triton(x: MqaInputs) -> Tensor:
    from mla_ext.sparse.triton_mqa_logits import mqa_logits_triton

    return mqa_logits_triton(x.q, x.k, x.k_scale, x.weights, x.ks, x.ke, x.out)


def _mqa_torch(x: MqaInputs) -> Tensor:
    M, H, D = x.q.shape
    N, W = x.k.shape[0], x.out.shape[1]
    if M == 0 or N == 0 or W == 0:
        return x.out
    k = _dequant(x.k, x.k_scale)  # [N, D]
    cols = torch.arange(W, device=x.device, dtype=torch.int64)
    rb = max(1, ROWS_BUDGET // (H * N))
    for r0 in range(0, M, rb):
        r1 = min(M, r0 + rb)
        q = x.q[r0:r1].view(torch.float8_e4m3fn).to(torch.float32)
        s = torch.einsum("mhd,nd->mhn", q, k).clamp_min_(0)
        full = torch.einsum("mhn,mh->mn", s, x.weights[r0:r1].to(torch.float32))  # [rows, N] by absolute key
        st = x.ks[r0:r1].to(torch.int64)[:, None]
        key = st + cols[None, :]
        ok = (cols[None, :] < x.ke[r0:r1].to(torch.int64)[:, None] - st) & (key < N) & (st >= 0)
        vals = full.gather(1, key.clamp(0, N - 1))
        x.out[r0:r1] = torch.where(ok, vals, x.out[r0:r1])
    return x.out


def _paged_triton(x: PagedInputs) -> Tensor:
    from mla_ext.sparse.triton_mqa_logits import paged_mqa_logits_triton

    return paged_mqa_logits_triton(x.q, x.cache, x.weights, x.row_ends, x.block_tables, x.out)


def _page_parts(cache: Tensor, D: int) -> tuple[Tensor, Tensor]:
    nb, bs = cache.shape[0], cache.shape[1]
    flat = cache.as_strided((nb, bs * (D + 4)), (cache.stride(0), 1))
    return flat[:, : bs * D].reshape(nb, bs, D), flat[:, bs * D:].reshape(nb, bs * 4).view(torch.float32)


def _paged_torch(x: PagedInputs) -> Tensor:
    Bq, next_n, H, D = x.q.shape
    rows, W = x.out.shape
    vals, scales = _page_parts(x.cache, D)
    nb, bs = vals.shape[0], vals.shape[1]
    ends = x.row_ends.to(torch.int64).clamp(max=W).cpu()  # the fallback reads the lengths on the host
    q = x.q.view(torch.float8_e4m3fn).to(torch.float32).reshape(rows, H, D)
    for b in range(Bq):
        rs = slice(b * next_n, min(rows, (b + 1) * next_n))
        n = int(ends[rs].max()) if rs.stop > rs.start else 0
        if n <= 0:
            continue
        pos = torch.arange(n, device=x.device)
        lblk = pos // bs
        blk = torch.full_like(pos, -1)
        inside = lblk < x.block_tables.shape[1]
        blk[inside] = x.block_tables[b].to(torch.int64)[lblk[inside]]
        ok = (blk >= 0) & (blk < nb)
        blk, off = blk.clamp(0, max(nb - 1, 0)), pos % bs
        k = _dequant(vals[blk, off], scales[blk, off]) * ok[:, None]  # [n, D]; outside the cache: zero key
        s = torch.einsum("rhd,nd->rhn", q[rs], k).clamp_min_(0)
        lg = torch.einsum("rhn,rh->rn", s, x.weights[rs].to(torch.float32))
        visible = pos[None, :] < ends[rs].to(x.device)[:, None]
        x.out[rs, :n] = torch.where(visible, lg, x.out[rs, :n])
    return x.out


MQA_LOGITS = Dispatcher("mqa_logits", [
    Backend("triton", lambda x: _triton_reasons(x, MQA_LOGITS._forced_name()), _mqa_triton),
    Backend("torch", lambda x: [], _mqa_torch),
])
PAGED_MQA_LOGITS = Dispatcher("paged_mqa_logits", [
    Backend("triton", lambda x: _triton_reasons(x, PAGED_MQA_LOGITS._forced_name()), _paged_triton),
    Backend("torch", lambda x: [], _paged_torch),
])


def _int_vector(t, name: str, n: int, dev) -> Tensor:
    _check(isinstance(t, Tensor) and t.dtype in (torch.int32, torch.int64) and t.numel() >= n,
           f"{name}: expected an int32 tensor of >= {n} entries, got "
           f"{t.dtype if isinstance(t, Tensor) else type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
    _check(t.device == dev, f"{name}: on {t.device}, expected q's device {dev}")
    return t.reshape(-1)[:n].to(torch.int32).contiguous()


def _weights(weights, rows: int, H: int, dev) -> Tensor:
    _check(isinstance(weights, Tensor) and weights.dim() == 2 and tuple(weights.shape) == (rows, H)
           and weights.is_floating_point(),
           f"weights: expected a float [{rows}, {H}] tensor, got {getattr(weights, 'dtype', None)} "
           f"{tuple(getattr(weights, 'shape', ()))}")
    _check(weights.device == dev, f"weights: on {weights.device}, expected q's device {dev}")
    return weights


def mqa_logits(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor, cu_seqlen_ks: Tensor, cu_seqlen_ke: Tensor,
               max_seqlen_k: int, *, out: Tensor | None = None) -> Tensor:
    """DeepGEMM's fp8_fp4_mqa_logits (fp8 form): q e4m3 [M, H, D], k e4m3 [N, D] with fp32 k_scale
    [N], weights [M, H] (the q scales folded in), cu_seqlen_ks/ke int32 [M] -> fp32
    [M, max_seqlen_k]: row m, column c = key ks[m] + c for c < ke[m] - ks[m]; -inf elsewhere."""
    check_no_meta(q=q, k=k, k_scale=k_scale, weights=weights)
    _check(q.dim() == 3 and q.dtype in _FP8, f"q: expected float8_e4m3fn (or uint8) [M, H, D], got {q.dtype} "
           f"{tuple(q.shape)}")
    M, H, D = q.shape
    dev = q.device
    _check(k.dim() == 2 and k.dtype in _FP8 and k.shape[1] == D,
           f"k: expected float8_e4m3fn (or uint8) [N, {D}], got {k.dtype} {tuple(k.shape)}")
    N = k.shape[0]
    _check(k_scale.dtype == torch.float32 and k_scale.numel() == N,
           f"k_scale: expected float32 [{N}] (one scale per key), got {k_scale.dtype} {tuple(k_scale.shape)}")
    _check(k.device == dev and k_scale.device == dev, f"k / k_scale: expected q's device {dev}")
    w = _weights(weights, M, H, dev)
    _check(isinstance(max_seqlen_k, int) and max_seqlen_k >= 0,
           f"max_seqlen_k: expected a non-negative int, got {max_seqlen_k!r}")
    ks = _int_vector(cu_seqlen_ks, "cu_seqlen_ks", M, dev)
    ke = _int_vector(cu_seqlen_ke, "cu_seqlen_ke", M, dev)
    if out is None:
        out = torch.empty(M, max_seqlen_k, dtype=torch.float32, device=dev)
    _check(out.dtype == torch.float32 and tuple(out.shape) == (M, max_seqlen_k) and out.stride(-1) == 1,
           f"out: expected float32 [{M}, {max_seqlen_k}] with a unit last stride, got {out.dtype} {tuple(out.shape)}")
    out.fill_(float("-inf"))
    qb = _bytes(q) if q.stride(-1) == 1 else _bytes(q.contiguous())
    kb = _bytes(k) if k.stride(-1) == 1 else _bytes(k.contiguous())
    return MQA_LOGITS(MqaInputs(qb, kb, k_scale.reshape(-1).contiguous(), w, ks, ke, out))


def paged_mqa_logits(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_tables: Tensor,
                     max_model_len: int, *, out: Tensor | None = None) -> Tensor:
    """DeepGEMM's fp8_fp4_paged_mqa_logits (fp8 form) over vLLM's fp8 index cache: q e4m3
    [B, next_n, H, D], kv_cache uint8 [nb, bs, 1, D + 4] (or [nb, bs, D + 4]; page = bs * D e4m3
    bytes then bs fp32 scales), weights [B * next_n, H], context_lens [B, next_n] per row or
    [B, 1] / [B] per request, block_tables int32 [B, max_blocks] -> fp32 [B * next_n, max_model_len],
    row r valid in its first decode_row_ends(...)[r] columns, -inf elsewhere."""
    check_no_meta(q=q, kv_cache=kv_cache, weights=weights, context_lens=context_lens, block_tables=block_tables)
    _check(q.dim() == 4 and q.dtype in _FP8,
           f"q: expected float8_e4m3fn (or uint8) [B, next_n, H, D], got {q.dtype} {tuple(q.shape)}")
    Bq, next_n, H, D = q.shape
    dev = q.device
    cache = kv_cache.squeeze(2) if kv_cache.dim() == 4 and kv_cache.shape[2] == 1 else kv_cache
    _check(cache.dim() == 3 and cache.dtype in _FP8 and cache.shape[2] == D + 4,
           f"kv_cache: expected uint8 [num_blocks, block_size, 1, {D + 4}] (D e4m3 bytes + one fp32 scale per "
           f"token), got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    cache = _bytes(cache)
    _check(cache.device == dev, f"kv_cache: on {cache.device}, expected q's device {dev}")
    _check(cache.shape[0] == 0 or (cache[0].is_contiguous() and cache.stride(0) % 4 == 0
                                   and cache.storage_offset() % 4 == 0),
           "kv_cache: pages must be contiguous and start at 4-byte multiples (values then fp32 scales)")
    rows = Bq * next_n
    w = _weights(weights.reshape(-1, weights.shape[-1]) if isinstance(weights, Tensor) and weights.dim() == 3
                 else weights, rows, H, dev)
    _check(isinstance(block_tables, Tensor) and block_tables.dim() == 2 and block_tables.shape[0] >= Bq
           and block_tables.dtype in (torch.int32, torch.int64) and block_tables.device == dev,
           f"block_tables: expected int32 [{Bq}, max_blocks] on {dev}, got "
           f"{getattr(block_tables, 'dtype', None)} {tuple(getattr(block_tables, 'shape', ()))}")
    _check(isinstance(context_lens, Tensor) and context_lens.dtype in (torch.int32, torch.int64)
           and context_lens.device == dev, f"context_lens: expected an int32 tensor on {dev}")
    _check(isinstance(max_model_len, int) and max_model_len >= 0,
           f"max_model_len: expected a non-negative int, got {max_model_len!r}")
    ends = decode_row_ends(context_lens, next_n, rows).to(torch.int32).contiguous()
    bt = block_tables.to(torch.int32)
    bt = bt if bt.stride(-1) == 1 else bt.contiguous()
    if out is None:
        out = torch.empty(rows, max_model_len, dtype=torch.float32, device=dev)
    _check(out.dtype == torch.float32 and tuple(out.shape) == (rows, max_model_len) and out.stride(-1) == 1,
           f"out: expected float32 [{rows}, {max_model_len}] with a unit last stride, got {out.dtype} "
           f"{tuple(out.shape)}")
    out.fill_(float("-inf"))
    qb = _bytes(q) if q.stride(-1) == 1 else _bytes(q.contiguous())
    return PAGED_MQA_LOGITS(PagedInputs(qb, cache, w, ends, bt, out))


def backend_report(device=None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] of both logits ops for a probe on `device` (default: CUDA if visible)."""
    dev = report_device(device)
    q = torch.empty(1, 1, 64, 128, dtype=torch.uint8, device=dev)
    i32 = torch.zeros(1, dtype=torch.int32, device=dev)
    f32 = torch.empty(1, 1, dtype=torch.float32, device=dev)
    mqa = MqaInputs(q[0], q[0, 0], f32[0], f32, i32, i32, f32)
    paged = PagedInputs(q, torch.empty(1, 64, 132, dtype=torch.uint8, device=dev), f32, i32, i32.view(1, 1), f32)
    return ([(MQA_LOGITS.op, b.name, b.not_supported_reasons(mqa)) for b in MQA_LOGITS.backends]
            + [(PAGED_MQA_LOGITS.op, b.name, b.not_supported_reasons(paged)) for b in PAGED_MQA_LOGITS.backends])
