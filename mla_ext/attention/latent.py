"""Context attention in latent space ("absorbed"), straight from the paged cache.

Head h's keys and values are linear in the cached latent row (SPEC §1, §10):
with W_UK[h] = kv_b_proj rows [h(P+V), h(P+V)+P) and W_UV[h] = the next V rows
of the [N(P+V), L] weight,

    q_nope[t,h] . (W_UK[h] kv_c[s])  =  (q_nope[t,h] W_UK[h]) . kv_c[s]  =  q_lat[t,h] . kv_c[s]
    sum_s p[t,h,s] W_UV[h] kv_c[s]    =  W_UV[h] (sum_s p[t,h,s] kv_c[s])  =  W_UV[h] o_lat[t,h]

So a chunk's context can be attended without up-projecting it:
  1. absorb: q_lat = q_nope @ W_UK per head, [N, T, L] (2·T·N·P·L FLOPs);
  2. latent attention: multi-query attention, every head against the one latent
     row per token, q = [q_lat | q_pe] (Dqk = L+R), v = kv_c (Dv = L), with LSE
     (natural log, [N, T], SPEC §7): exactly the head-space scores, so exactly
     the head-space LSE;
  3. un-absorb: o = o_lat @ W_UV^T per head, [T, N, V] (2·T·N·L·V FLOPs).
Nothing is spent per context row except reading it, against 2·N·L·(P+V) FLOPs
per row for the up-projection; per (row, query) pair the latent path costs
2·N·(2L+R) FLOPs against 2·N·(P+R+V). `mla_ext.prefill.context_cost` weighs
the two per chunk; `mla_ext.prefill.context.ContextAttention` picks (MLAPrefill(context_attention=...)).

W_UK and W_UV are views of the layer's dequantized kv_b_proj weight in the
compute dtype (`KvBProj.dense_weight`: built once per layer, dtype and device,
from whichever weight format the layer has, and shared with the dequant_dense
GEMM backend; never first built inside a CUDA graph capture).

Latent attention backends (`LATENT` dispatcher, force with
`LATENT.force(name)` or MLA_EXT_FORCE_LATENT_ATTENTION=name):
  triton  mla_ext/attention/triton_latent.py: reads the paged cache through the
          block table and decodes every format in its loader (no workspace);
          CUDA, or the CPU under TRITON_INTERPRET=1 only when forced (the
          interpreter is for tests, not speed);
  torch   gathers the chunk's rows with the cache gather op (any format, any
          device), then per request fp32 matmuls with query blocks bounding
          the score matrix. The CPU path; a fallback anywhere.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from mla_ext.attention import triton_latent as TL
from mla_ext.cache import api as cache_api
from mla_ext.cache.checks import check_cache_dtype, check_offsets
from mla_ext.dispatch import Backend, Dispatcher
from mla_ext.config.formats import get_format

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The torch backend bounds its fp32 score matrix [N, query block, C] to this.
MAX_SCORE_BYTES = 256 << 20


# -- absorb / un-absorb ------------------------------------------------------------

def absorbed_weights(kv_b_proj, num_heads: int, P: int, V: int, dtype: torch.dtype,
                     device) -> tuple[Tensor, Tensor]:
    """(W_UK [N, P, L], W_UV^T [N, L, V]) of a KvBProj, in `dtype` on `device`:
    views of its cached dequantized weight (no copy)."""
    w = kv_b_proj.dense_weight(dtype, torch.device(device))
    if w.shape[0] != num_heads * (P + V):
        raise ValueError(f"kv_b_proj: expected {num_heads * (P + V)} rows (N*(P+V)), got {w.shape[0]}")
    w = w.view(num_heads, P + V, w.shape[1])
    return w[:, :P], w[:, P:].transpose(1, 2)


def absorb_queries(q_nope: Tensor, w_uk: Tensor) -> Tensor:
    """q_nope [T, N, P] (any strides) -> q_lat [N, T, L] = q_nope[:, h] @ W_UK[h], q's dtype."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk)


def unabsorb(o_lat: Tensor, w_uv_t: Tensor) -> Tensor:
    """o_lat [N, T, L] -> o [T, N, V] (a transposed view; head dim contiguous)."""
    return torch.bmm(o_lat, w_uv_t).transpose(0, 1)


# -- latent attention ----------------------------------------------------------------

@dataclass
class LatentInputs:
    q_lat: Tensor  # [N, T, L]
    q_pe: Tensor  # [T, N, R]
    kv_cache: Tensor | None  # [num_blocks, B, entry] (None when `rows` is given)
    kv_cache_dtype: str
    block_table: Tensor | None
    cu_seqlens_q: Tensor  # int32 [num_reqs + 1], on the device
    cu_seq_lens: Tensor  # int32 [num_reqs + 1], on the device
    seq_starts: Tensor | None
    k_scale: Tensor | None
    softmax_scale: float
    q_offsets: tuple[int, ...]  # host copies of cu_seqlens_q / cu_seq_lens (no sync)
    ctx_offsets: tuple[int, ...]
    workspace: Tensor | None = None  # torch backend: [>= C, L+R] rows to gather into
    rows: Tensor | None = None  # already gathered rows [C, L+R] (context parallelism)

    @property
    def device(self) -> torch.device:
        return self.q_lat.device

    @property
    def num_reqs(self) -> int:
        return len(self.q_offsets) - 1


def _triton_forced() -> bool:
    return LATENT._forced_name() == "triton"


def _triton_reasons(x: LatentInputs) -> list[str]:
    if x.device.type == "cpu" and not _triton_forced():
        return ["input is on the CPU: the Triton interpreter runs only when this backend is forced"]
    if x.rows is not None:
        cache, fmt = x.rows.unsqueeze(0), "auto"
    else:
        cache, fmt = x.kv_cache, x.kv_cache_dtype
    return TL.not_supported_reasons(cache, x.q_lat, fmt)


def latent_outputs(q_lat: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out [N, T, L] in q_lat's dtype, lse [N, T] float32) for a latent attention op
    (absorbed context attention here, sparse attention in mla_ext/sparse)."""
    N, T, L = q_lat.shape
    return (torch.empty(N, T, L, dtype=q_lat.dtype, device=q_lat.device),
            torch.empty(N, T, dtype=torch.float32, device=q_lat.device))


def _triton_run(x: LatentInputs) -> tuple[Tensor, Tensor]:
    out, lse = latent_outputs(x.q_lat)
    lens_q = [b - a for a, b in zip(x.q_offsets, x.q_offsets[1:])]
    lens_k = [b - a for a, b in zip(x.ctx_offsets, x.ctx_offsets[1:])]
    if x.rows is not None:
        # Gathered rows as a one-block native cache: request r's rows start at cu_seq_lens[r].
        cache, fmt = x.rows.unsqueeze(0), "auto"
        table = torch.zeros(x.num_reqs, 1, dtype=torch.int32, device=x.device)
        starts = x.cu_seq_lens[:-1]
    else:
        cache, fmt, table, starts = x.kv_cache, x.kv_cache_dtype, x.block_table, x.seq_starts
    TL.latent_attention_triton(
        x.q_lat, x.q_pe, cache, fmt, table, x.cu_seqlens_q, x.cu_seq_lens, starts, x.k_scale,
        x.softmax_scale, out, lse, max(lens_q, default=0), max(lens_k, default=0),
    )
    return out, lse


def latent_attention_rows_torch(q_lat: Tensor, q_pe: Tensor, rows: Tensor, q_offsets, ctx_offsets,
                                softmax_scale: float, out: Tensor, lse: Tensor,
                                max_score_bytes: int = MAX_SCORE_BYTES) -> None:
    """Latent attention over gathered rows [C, L+R] (request r: rows ctx_offsets[r]:[r+1],
    queries q_offsets[r]:[r+1]) in fp32 matmuls; fills out [N, T, L] and lse [N, T]."""
    N, _, L = q_lat.shape
    for r in range(len(q_offsets) - 1):
        qa, qb, ka, kb = q_offsets[r], q_offsets[r + 1], ctx_offsets[r], ctx_offsets[r + 1]
        if qb <= qa:
            continue
        if kb <= ka:
            out[:, qa:qb] = 0
            lse[:, qa:qb] = float("-inf")
            continue
        kv = rows[ka:kb].float()
        lat, pe = kv[:, :L], kv[:, L:]
        step = max(1, max_score_bytes // max(1, N * (kb - ka) * 4))
        for a in range(qa, qb, step):
            b = min(qb, a + step)
            s = torch.matmul(q_lat[:, a:b].float(), lat.t())  # [N, tb, C]
            if pe.shape[1]:
                s += torch.matmul(q_pe[a:b].float().transpose(0, 1), pe.t())
            s *= softmax_scale
            ls = torch.logsumexp(s, dim=-1)  # [N, tb]
            p = torch.exp(s - ls[..., None])
            out[:, a:b] = torch.matmul(p, lat).to(out.dtype)
            lse[:, a:b] = ls


def _torch_run(x: LatentInputs) -> tuple[Tensor, Tensor]:
    out, lse = latent_outputs(x.q_lat)
    rows = x.rows
    if rows is None:
        total = x.ctx_offsets[-1]
        E = x.q_lat.shape[-1] + x.q_pe.shape[-1]
        ws = x.workspace
        if ws is None or ws.shape[0] < total:
            ws = torch.empty(total, E, dtype=x.q_lat.dtype, device=x.device)
        rows = ws[:total]
        if total:
            scale = x.k_scale if x.k_scale is not None else torch.ones(1, dtype=torch.float32, device=x.device)
            cache_api.gather_and_maybe_dequant_cache(
                x.kv_cache, rows, x.block_table, x.cu_seq_lens, x.num_reqs, x.kv_cache_dtype, scale,
                x.seq_starts)
    lse.fill_(float("-inf"))
    out.zero_()
    latent_attention_rows_torch(x.q_lat, x.q_pe, rows, x.q_offsets, x.ctx_offsets, x.softmax_scale, out, lse)
    return out, lse


LATENT = Dispatcher(
    "latent_attention",
    [
        Backend("triton", _triton_reasons, _triton_run),
        Backend("torch", lambda x: [], _torch_run),
    ],
)


def _offsets(values, name: str, device) -> tuple[int, ...]:
    if not (isinstance(values, (list, tuple)) and len(values) >= 1
           and all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
        raise ValueError(f"{name}: expected host ints (a list or tuple of offsets, one more than the requests), got "
           f"{type(values).__name__}")
    if not (values[0] == 0 and all(b >= a for a, b in zip(values, values[1:]))):
        raise ValueError(f"{name}: expected non-decreasing offsets starting at 0, got {list(values[:8])}"
           + ("..." if len(values) > 8 else ""))
    return tuple(values)


def latent_context_attention(
    q_lat: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor | None,
    kv_cache_dtype: str,
    block_table: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seq_lens: Tensor,
    seq_starts: Tensor | None,
    k_scale: Tensor | None,
    softmax_scale: float,
    *,
    q_offsets,
    ctx_offsets,
    workspace: Tensor | None = None,
    rows: Tensor | None = None,
    chosen=None,
) -> tuple[Tensor, Tensor]:
    """Context attention of absorbed queries against the latent rows of the paged cache.

    q_lat [N, T, L] (absorbed q_nope, compute dtype, L contiguous), q_pe [T, N, R]
    (q's rope part, same dtype); request r's queries are rows
    cu_seqlens_q[r]:[r+1] and it attends context tokens seq_starts[r] ...
    seq_starts[r] + (cu_seq_lens[r+1] - cu_seq_lens[r]) - 1 of its block-table
    row (int32 device tensors, as the gather op takes them), decoded from
    `kv_cache_dtype`; `q_offsets` / `ctx_offsets` are the same offsets as host
    ints (they size the launch without a device sync). `rows` instead of a cache:
    already gathered rows [C, L+R] (request r's at ctx_offsets[r]).
    `workspace`: rows the torch backend may gather into. `chosen` (mla_ext.dispatch.Chosen): a call
    site resolved once (MLAPrefill resolves each op once per batch).

    Returns (o_lat [N, T, L] in q_lat's dtype, lse [N, T] float32, natural log);
    a query without context keys has o = 0, lse = -inf.
    """
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seq_lens", cu_seq_lens)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not (q_lat.dim() == 3 and q_lat.dtype in FLOAT_DTYPES):
        raise ValueError(f"q_lat: expected a [N, T, L] bf16/fp16/fp32 tensor, got {q_lat.dim()}-D {q_lat.dtype}")
    N, T, L = q_lat.shape
    if not (q_pe.dim() == 3 and q_pe.shape[:2] == (T, N)):
        raise ValueError(f"q_pe: expected [{T}, {N}, R] (as q_lat [N, T, L]), got {tuple(q_pe.shape)}")
    if not (q_pe.dtype == q_lat.dtype and q_pe.device == q_lat.device):
        raise ValueError(f"q_pe: expected {q_lat.dtype} on {q_lat.device} (as q_lat), got {q_pe.dtype} on {q_pe.device}")
    if not (L <= 1 or q_lat.stride(2) == 1):
        raise ValueError(f"q_lat: L must be contiguous (stride 1), got {q_lat.stride()}")
    if not (q_pe.shape[2] <= 1 or q_pe.stride(2) == 1):
        raise ValueError(f"q_pe: R must be contiguous, got {q_pe.stride()}")
    qo = _offsets(q_offsets, "q_offsets", q_lat.device)
    co = _offsets(ctx_offsets, "ctx_offsets", q_lat.device)
    if len(qo) != len(co):
        raise ValueError(f"ctx_offsets: expected {len(qo)} entries (as q_offsets), got {len(co)}")
    if not (qo[-1] <= T):
        raise ValueError(f"q_offsets: the last offset {qo[-1]} exceeds the {T} query rows")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seq_lens", cu_seq_lens)):
        if not (t.dtype == torch.int32 and t.dim() == 1 and t.numel() == len(qo) and t.device == q_lat.device):
            raise ValueError(f"{name}: expected an int32 tensor [{len(qo)}] on {q_lat.device}, got {t.dtype} "
               f"{tuple(t.shape)} on {t.device}")
    if not (isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
           and 0 < softmax_scale < float("inf")):
        raise ValueError(f"softmax_scale: expected a float > 0, got {softmax_scale!r}")
    R = q_pe.shape[2]
    if rows is not None:
        if not (isinstance(rows, Tensor) and rows.dim() == 2 and rows.shape[1] == L + R
               and rows.shape[0] >= co[-1] and rows.dtype == q_lat.dtype and rows.device == q_lat.device
               and rows.stride(1) == 1):
            raise ValueError(f"rows: expected [>= {co[-1]}, {L + R}] {q_lat.dtype} on {q_lat.device}, unit column stride")
    else:
        fmt = get_format(kv_cache_dtype)
        if not (isinstance(kv_cache, Tensor) and kv_cache.dim() == 3 and kv_cache.device == q_lat.device):
            raise ValueError(f"kv_cache: expected a [num_blocks, block_size, entry] tensor on {q_lat.device}")
        check_cache_dtype(kv_cache, fmt)  # a float8 cache of the other fp8 type would decode wrongly
        if not (isinstance(block_table, Tensor) and block_table.dim() == 2 and block_table.dtype == torch.int32
               and block_table.shape[0] >= len(qo) - 1 and block_table.device == q_lat.device):
            raise ValueError(f"block_table: expected an int32 tensor [>= {len(qo) - 1}, max_blocks] on {q_lat.device}")
        if seq_starts is not None:
            if not (isinstance(seq_starts, Tensor) and seq_starts.dtype == torch.int32
                   and seq_starts.numel() == len(qo) - 1 and seq_starts.device == q_lat.device):
                raise ValueError(f"seq_starts: expected an int32 tensor [{len(qo) - 1}] on {q_lat.device}")
        if cu_seq_lens.device.type == "cpu":  # free here (on CUDA a read would sync; the kernel bounds rows)
            check_offsets(cu_seq_lens, len(qo) - 1, seq_starts)
    x = LatentInputs(q_lat, q_pe, kv_cache, kv_cache_dtype, block_table, cu_seqlens_q, cu_seq_lens, seq_starts,
                     k_scale, float(softmax_scale), qo, co, workspace, rows)
    if T == 0 or N == 0:
        out, lse = latent_outputs(x.q_lat)
        return out, lse
    return LATENT.run(x, chosen)


def backend_report(device: str | torch.device | None = None) -> list[tuple[str, str, list[str]]]:
    """[(op, backend, reasons)] for a probe on `device` (default: CUDA if visible)."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.empty(1, 1, 512, dtype=dt, device=dev)
    cu = torch.zeros(2, dtype=torch.int32, device=dev)
    cache = torch.empty(1, 16, 576, dtype=dt, device=dev)
    x = LatentInputs(q, q.new_empty(1, 1, 64), cache, "auto", cu.view(2, 1), cu, cu, None, None, 1.0,
                     (0, 0), (0, 0))
    return [("latent_attention", b.name, b.not_supported_reasons(x)) for b in LATENT.backends]


# -- the per-layer policy: which path each context chunk takes ----------------------


__all__ = ["LATENT", "absorb_queries", "absorbed_weights", "backend_report", "latent_attention_rows_torch",
           "latent_context_attention", "unabsorb"]
