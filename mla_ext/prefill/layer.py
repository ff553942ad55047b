"""`MLAPrefill`: one MLA layer's prefill-with-context (SPEC §1), routed per layer.

Everything that depends on what the layer *is* is resolved once, in
`__init__`, from the layer's own spec (mla_ext.policy.LayerCacheSpec) and its
kv_b_proj weights, never from a global cache dtype:

  * the cache format (a skipped layer resolves to `auto`: native, no scales),
  * the gather path (dequantize into the model dtype, or a plain native copy),
  * the workspace dtype and rows (SPEC §8),
  * the kv_b_proj activation dtype (SPEC §5, `kv_b_proj_input_dtype`),
  * whether the layer computes a per-tensor K scale.

`forward` then runs SPEC §1: causal attention of the new tokens, the context
in chunks (gather -> up-project -> non-causal attention with LSE -> merge),
and the final merge. `explain()` prints the resolved plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mla_ext.attention.api import merge_attn_states, varlen_attention
from mla_ext.cache import api as cache_api
from mla_ext.cache.context_parallel import cp_gather_context
from mla_ext.formats import QuantMode, ScaleKind
from mla_ext.kv_b_proj.input_dtype import kv_b_proj_input_dtype
from mla_ext.kv_b_proj.linear import KvBProj
from mla_ext.kv_b_proj.weights import WeightFormat
from mla_ext.models import MLAModelConfig
from mla_ext.policy import CacheConfig, LayerCacheSpec, resolve_layer
from mla_ext.prefill.chunking import (
    ChunkPlan,
    lengths,
    plan_context_chunks,
    workspace_alignment,
    workspace_rows,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _no_clock(step: str) -> None:
    """forward's step marks when no profiling clock is given."""


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism over a torch.distributed group (SPEC §6).

    Each rank's paged cache holds the context tokens with
    `(pos // interleave) % cp_size == rank`, in local order, and
    `PrefillMetadata.block_table` is that rank's LOCAL block table. Context
    lengths in the metadata stay global. Every rank gathers its local rows of
    a chunk, the rows are all-gathered and reordered, and every rank then
    computes the same attention for the (replicated) queries.
    """

    group: object
    cp_size: int
    rank: int
    interleave: int = 1

    def __post_init__(self):
        for name in ("cp_size", "interleave"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.cp_size:
            raise ValueError(f"rank: expected an int in [0, {self.cp_size}), got {self.rank!r}")


@dataclass
class PrefillMetadata:
    """Per-batch inputs shared by every layer of a forward pass.

    block_table [num_reqs, max_blocks] int32 (block ids, shared by all layers);
    context_lens / query_lens: host lists (the scheduler knows them; planning
    chunks needs no device sync). k_scale: fp32 [1] per-tensor K scale for
    per-tensor fp8 layers (ignored by others); a default only, since K scales
    are per layer: `MLAPrefill.forward(..., k_scale=)` overrides it.
    """

    block_table: Tensor
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    k_scale: Tensor | None = None
    _plans: dict = field(default_factory=dict, repr=False)
    _cu_q: dict = field(default_factory=dict, repr=False)
    _chunk_t: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.context_lens = tuple(lengths(self.context_lens, "context_lens"))
        self.query_lens = tuple(lengths(self.query_lens, "query_lens"))
        if len(self.context_lens) != len(self.query_lens):
            raise ValueError(
                f"query_lens: expected {len(self.context_lens)} entries (as context_lens), "
                f"got {len(self.query_lens)}"
            )
        bt = self.block_table
        if not isinstance(bt, Tensor) or bt.dim() != 2 or bt.dtype != torch.int32:
            raise ValueError("block_table: expected an int32 tensor [num_reqs, max_blocks]")
        if bt.size(0) < len(self.context_lens):
            raise ValueError(
                f"block_table: expected >= {len(self.context_lens)} rows (one per request), "
                f"got {bt.size(0)}"
            )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def plan(self, rows: int, alignment: int) -> ChunkPlan:
        """The chunk plan for a workspace of `rows` (cached: layers share it)."""
        key = (rows, alignment)
        if key not in self._plans:
            self._plans[key] = plan_context_chunks(self.context_lens, self.query_lens, rows, alignment)
        return self._plans[key]

    def cu_seqlens_q(self, device) -> Tensor:
        device = torch.device(device)
        if device not in self._cu_q:
            offs = [0]
            for n in self.query_lens:
                offs.append(offs[-1] + n)
            host = torch.tensor(offs, dtype=torch.int32)
            if device.type == "cuda":  # pinned + async: no host sync, capturable
                host = host.pin_memory()
            self._cu_q[device] = host.to(device, non_blocking=True)
        return self._cu_q[device]

    def chunk_tensors(self, chunk, device):
        """A chunk's int32 metadata on `device`, copied once per batch: every
        layer with the same plan reuses it (one host-to-device copy, not one per layer)."""
        key = (chunk, torch.device(device))
        if key not in self._chunk_t:
            self._chunk_t[key] = chunk.tensors(device)
        return self._chunk_t[key]


class MLAPrefill:
    """Prefill-with-context for one MLA layer."""

    def __init__(
        self,
        model: MLAModelConfig,
        cache_config: CacheConfig,
        kv_b_proj: KvBProj | WeightFormat,
        *,
        layer: int | None = None,
        prefix: str | None = None,
        use_fp8_prefill: bool = False,
        max_num_seqs: int = 256,
        workspace_rows_override: int | None = None,
        softmax_scale: float | None = None,
        context_parallel: ContextParallel | None = None,
    ):
        self.model = model
        self.spec: LayerCacheSpec = resolve_layer(cache_config, model, layer=layer, prefix=prefix)
        self.kv_b_proj = kv_b_proj if isinstance(kv_b_proj, KvBProj) else KvBProj(kv_b_proj)
        want_n = model.num_heads * (model.P + model.V)
        if (self.kv_b_proj.N, self.kv_b_proj.K) != (want_n, model.L):
            raise ValueError(
                f"kv_b_proj: expected a [{want_n}, {model.L}] weight (N*(P+V), L) for "
                f"{model.name}, got [{self.kv_b_proj.N}, {self.kv_b_proj.K}]"
            )
        self.use_fp8_prefill = bool(use_fp8_prefill)
        self._unit_scale: dict[torch.device, Tensor] = {}
        # SPEC §5: a pure function of the layer. None means "no cast": the
        # activations stay in the model dtype (the linear quantizes itself).
        self.kv_b_proj_input_dtype = kv_b_proj_input_dtype(self.kv_b_proj, self.use_fp8_prefill)
        self.workspace_dtype = self.spec.workspace_dtype
        self.cp = context_parallel
        cp_size, cp_i = (self.cp.cp_size, self.cp.interleave) if self.cp else (1, 1)
        # Under CP a split point must be a whole number of interleave periods
        # as well as of blocks, so every rank's share of a chunk is contiguous.
        self.chunk_alignment = workspace_alignment(self.spec.block_size, cp_size, cp_i)
        self.workspace_rows = workspace_rows(
            model.max_model_len, max_num_seqs, self.spec.block_size, cp_size, cp_i,
            override=workspace_rows_override,
        )
        # SPEC §10: the model's own scale (yarn-corrected for DeepSeek/Kimi), unless
        # the caller overrides it.
        if softmax_scale is None:
            self.softmax_scale = model.softmax_scale
            self.softmax_scale_source = f"model config: {model.softmax_scale_source}"
        else:
            ok = not isinstance(softmax_scale, bool) and isinstance(softmax_scale, (int, float))
            if not ok or not math.isfinite(softmax_scale) or softmax_scale <= 0:
                raise ValueError(f"softmax_scale: expected a finite number > 0 or None (the "
                                 f"model's {model.softmax_scale:.5f}); got {softmax_scale!r}")
            self.softmax_scale = float(softmax_scale)
            self.softmax_scale_source = (f"given by the caller (the model config says "
                                         f"{model.softmax_scale:.5f})")

    # -- plan ----------------------------------------------------------------
    @property
    def layer_index(self) -> int:
        return self.spec.layer_index

    @property
    def kv_cache_dtype(self) -> str:
        return self.spec.kv_cache_dtype

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype kv_b_proj actually receives."""
        return self.kv_b_proj_input_dtype or self.model.model_dtype

    def explain(self, device: torch.device | str | None = None) -> str:
        """The resolved per-layer plan, one fact per line."""
        s = self.spec
        device = torch.device(device) if device is not None else self.kv_b_proj.device
        why = f" (skipped: {s.skip_reason})" if s.skipped else ""
        lines = [
            f"layer {s.layer_index}: kv_cache_dtype={s.kv_cache_dtype}{why}, "
            f"quant_mode={s.quant_mode.name}, calculate_kv_scales={s.calculate_kv_scales}",
            f"  cache: {s.bytes_per_token} B/token, page {s.page_bytes()} B (block {s.block_size}), "
            f"entry [{s.entry_elems}] {s.storage_dtype}",
            f"  gather: {'dequantize ' + s.format.name + ' ->' if s.is_quantized else 'native copy ->'} "
            f"{self.workspace_dtype} workspace [{self.workspace_rows}, {self.model.L + self.model.R}]"
            + (f", context parallel {self.cp.cp_size} ranks (interleave {self.cp.interleave})"
               if self.cp else ""),
            f"  attention: softmax scale {self.softmax_scale:.5f} ({self.softmax_scale_source}); "
            f"model dtype {self.model.model_dtype} ({self.model.dtype_source})",
            f"  kv_b_proj: {self.kv_b_proj.weight_format.describe()}; input dtype "
            f"{self.activation_dtype} (fp8 prefill {'on' if self.use_fp8_prefill else 'off'})",
        ]
        try:
            backend = self.kv_b_proj.backend_for(self.workspace_rows, device, self._linear_act_dtype())
        except ValueError as exc:
            backend = f"none ({exc})"
        lines.append(f"  kv_b_proj backend at M={self.workspace_rows} on {device}: {backend}")
        return "\n".join(lines)

    def _linear_act_dtype(self) -> torch.dtype:
        return self.activation_dtype

    # -- cache writes --------------------------------------------------------
    def compute_kv_scale(self, kv_c: Tensor, k_pe: Tensor) -> Tensor | None:
        """The per-tensor K scale for this layer, or None when it computes none
        (skipped/native layers, fp8_ds_mla, calculate_kv_scales off)."""
        if not self.spec.calculate_kv_scales or self.spec.format.scale_kind != ScaleKind.PER_TENSOR:
            return None
        return cache_api.compute_kv_scale(kv_c, k_pe, self.spec.kv_cache_dtype)

    def write_cache(self, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                    k_scale: Tensor | None = None) -> None:
        """Stores new tokens in this layer's cache, in this layer's format."""
        self.check_cache(kv_cache)
        scale = self._k_scale(k_scale, kv_c.device)
        cache_api.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, self.spec.kv_cache_dtype, scale)

    def check_cache(self, kv_cache: Tensor) -> None:
        s = self.spec
        if not isinstance(kv_cache, Tensor) or kv_cache.dim() != 3:
            raise ValueError("kv_cache: expected a [num_blocks, block_size, entry] tensor")
        ok_dtypes = {s.storage_dtype}
        if s.is_quantized:
            ok_dtypes |= {torch.uint8, s.format.fp8_dtype}
        if kv_cache.dtype not in ok_dtypes or tuple(kv_cache.shape[1:]) != (s.block_size, s.entry_elems):
            raise ValueError(
                f"kv_cache: layer {s.layer_index} ({s.kv_cache_dtype}) expects "
                f"[num_blocks, {s.block_size}, {s.entry_elems}] {s.storage_dtype}, got "
                f"{tuple(kv_cache.shape)} {kv_cache.dtype}"
            )

    def _k_scale(self, k_scale: Tensor | None, device) -> Tensor:
        if self.spec.quant_mode == QuantMode.FP8_PER_TENSOR:
            if k_scale is None:
                raise ValueError(
                    f"k_scale: layer {self.layer_index} ({self.kv_cache_dtype}) needs a per-tensor "
                    "fp32 K scale [1]"
                )
            return k_scale
        # Unscaled formats: the ops take a scale argument for signature
        # compatibility and ignore it; one per device, not one per call.
        device = torch.device(device)
        unit = self._unit_scale.get(device)
        if unit is None:
            unit = self._unit_scale[device] = torch.ones(1, dtype=torch.float32, device=device)
        return unit

    # -- forward -------------------------------------------------------------
    def _up_project(self, kv_c: Tensor) -> tuple[Tensor, Tensor]:
        """kv_c [M, L] (any row stride) -> k_nope [M, N, P], v [M, N, V]."""
        m = self.model
        x_scale = None
        want = self.kv_b_proj_input_dtype
        if want in FP8_DTYPES:
            # FP8 prefill into an fp8 weight: quantize with a per-tensor scale
            # computed on the device (no host sync).
            amax = kv_c.abs().amax().float().clamp(min=1e-12)
            x_scale = (amax / torch.finfo(want).max).reshape(1)
            x = (kv_c.float() / x_scale).clamp(-torch.finfo(want).max, torch.finfo(want).max).to(want)
        elif want is not None and kv_c.dtype != want:
            x = kv_c.to(want)
        else:
            x = kv_c
        kv = self.kv_b_proj(x, x_scale)
        kv = kv.view(-1, m.num_heads, m.P + m.V)
        return kv[..., : m.P], kv[..., m.P :]

    def _keys(self, k_nope: Tensor, k_pe: Tensor, dtype: torch.dtype) -> Tensor:
        m = self.model
        k = torch.empty(k_nope.shape[0], m.num_heads, m.P + m.R, dtype=dtype, device=k_nope.device)
        k[..., : m.P] = k_nope
        k[..., m.P :] = k_pe[:, None, :]
        return k

    def _workspace(self, given: Tensor | None, device) -> Tensor:
        E = self.model.L + self.model.R
        if given is None:
            return torch.empty(self.workspace_rows, E, dtype=self.workspace_dtype, device=device)
        if (not isinstance(given, Tensor) or given.dim() != 2 or given.shape[0] < self.workspace_rows
                or given.shape[1] != E or given.dtype != self.workspace_dtype
                or given.device != torch.device(device) or given.stride(1) != 1):
            raise ValueError(
                f"workspace: layer {self.layer_index} expects [>= {self.workspace_rows}, {E}] "
                f"{self.workspace_dtype} on {device} with unit column stride, got "
                + (f"{tuple(given.shape)} {given.dtype} on {given.device}" if isinstance(given, Tensor)
                   else type(given).__name__)
            )
        return given

    def _gather(self, kv_cache, workspace, metadata, c, t, scale) -> None:
        """The chunk's context rows into workspace[:c.total_rows], dequantized."""
        table = metadata.block_table[c.req_start:c.req_end]
        if self.cp is None:
            cache_api.gather_and_maybe_dequant_cache(
                kv_cache, workspace[: c.total_rows], table, t.cu_seq_lens, c.num_reqs,
                self.spec.kv_cache_dtype, scale, t.seq_starts,
            )
        else:
            cp_gather_context(
                kv_cache, workspace, table, c.chunk_lens, self.spec.kv_cache_dtype, scale,
                cp_size=self.cp.cp_size, rank=self.cp.rank, interleave=self.cp.interleave,
                seq_starts=c.seq_starts, group=self.cp.group,
            )

    def forward(self, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor,
                metadata: PrefillMetadata, clock=None, *, k_scale: Tensor | None = None,
                workspace: Tensor | None = None) -> Tensor:
        """q [T, N, P+R], kv_c_normed [T, L], k_pe [T, R] of the new tokens -> [T, N, V].

        `k_scale`: this layer's per-tensor fp32 K scale [1] (per-tensor fp8 layers;
        K scales are per layer). Defaults to `metadata.k_scale`, which one batch's
        layers share, so pass it whenever layers were written with different scales.

        `workspace`: an optional preallocated `[>= workspace_rows, L+R]` buffer of
        this layer's workspace dtype (row stride may exceed L+R), so a serving
        engine can share one bounded buffer across layers; allocated per call
        otherwise.

        `clock` (optional, for profiling; see mla_ext.prefill.timing.StepClock)
        gets `clock.mark(step)` after every step.
        """
        m = self.model
        T = metadata.num_tokens
        if q.dim() != 3 or tuple(q.shape) != (T, m.num_heads, m.P + m.R):
            raise ValueError(f"q: expected [{T}, {m.num_heads}, {m.P + m.R}], got {tuple(q.shape)}")
        if tuple(kv_c_normed.shape) != (T, m.L) or tuple(k_pe.shape) != (T, m.R):
            raise ValueError(
                f"kv_c_normed/k_pe: expected [{T}, {m.L}] and [{T}, {m.R}], got "
                f"{tuple(kv_c_normed.shape)} and {tuple(k_pe.shape)}"
            )
        dt = m.model_dtype
        for name, x in (("q", q), ("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if x.dtype != dt:
                raise ValueError(f"{name}: expected the model dtype {dt}, got {x.dtype}")
            if x.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (as q), got {x.device}")
        for name, x in (("kv_cache", kv_cache), ("metadata.block_table", metadata.block_table)):
            if x.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (as q), got {x.device}")
        self.check_cache(kv_cache)
        device, dtype = q.device, q.dtype
        cu_q = metadata.cu_seqlens_q(device)
        max_q = max(metadata.query_lens, default=0)
        tick = clock.mark if clock is not None else _no_clock
        if clock is not None:
            clock.start()

        # 1. New tokens: causal attention over themselves.
        k_nope, v = self._up_project(kv_c_normed)
        tick("kv_b_proj")
        k = self._keys(k_nope, k_pe, dtype)
        tick("keys")
        o_new, lse_new = varlen_attention(q, k, v.to(dtype), cu_q, cu_q, max_q, max_q,
                                          self.softmax_scale, causal=True)
        tick("attention")

        # 2. Context, chunk by chunk, merged into (0, -inf).
        plan = metadata.plan(self.workspace_rows, self.chunk_alignment)
        acc_o = torch.zeros(T, m.num_heads, m.V, dtype=dtype, device=device)
        acc_lse = torch.full((m.num_heads, T), float("-inf"), dtype=torch.float32, device=device)
        if plan.chunks:
            workspace = self._workspace(workspace, device)
            scale = self._k_scale(k_scale if k_scale is not None else metadata.k_scale, device)
            for c in plan.chunks:
                t = metadata.chunk_tensors(c, device)
                rows = c.total_rows
                self._gather(kv_cache, workspace, metadata, c, t, scale)
                tick("gather")
                ck_nope, cv = self._up_project(workspace[:rows, : m.L])
                tick("kv_b_proj")
                ck = self._keys(ck_nope, workspace[:rows, m.L :], dtype)
                tick("keys")
                qs = slice(c.token_start, c.token_end)
                o, lse = varlen_attention(q[qs], ck, cv.to(dtype), t.cu_seqlens_q, t.cu_seq_lens,
                                          c.max_query_len, c.max_seq_len, self.softmax_scale,
                                          causal=False)
                tick("attention")
                merge_attn_states(acc_o[qs], acc_lse[:, qs], o, lse,
                                  out=acc_o[qs], out_lse=acc_lse[:, qs])
                tick("merge")

        # 3. Context result merged with the new-token result.
        out, _ = merge_attn_states(acc_o, acc_lse, o_new, lse_new)
        tick("merge")
        return out

    __call__ = forward
