"""`MLAPrefill`: one MLA layer's prefill-with-context (SPEC §1), routed per layer.

Everything that depends on what the layer *is* is resolved once, in
`__init__`, from the layer's own spec (mla_ext.config.policy.LayerCacheSpec) and its
kv_b_proj weights, never from a global cache dtype:

  * the cache format (a skipped layer resolves to `auto`: native, no scales),
  * the gather path (dequantize into the model dtype, or a plain native copy),
  * the workspace dtype and rows (SPEC §8),
  * the kv_b_proj activation dtype (SPEC §5, `kv_b_proj_input_dtype`),
  * whether the layer computes a per-tensor K scale.

`forward` then runs SPEC §1: causal attention of the new tokens, the context
in chunks (gather -> up-project -> non-causal attention with LSE -> merge),
and the final merge. `explain()` prints the resolved plan.

Context attention per chunk (`context_attention=`, mla_ext/attention/latent.py):
"up_project" is the path above; "absorbed" attends the chunk in latent space
straight from the paged cache (queries absorbed through W_UK, the latent output
un-absorbed through W_UV; no up-projection of the context); "auto" (default)
picks the cheaper one per chunk by a cost model (mla_ext/prefill/context_cost.py).
Both give the same answer within SPEC §9.

Checks (`forward`):
  * always, on host data only (no sync, O(1) per argument or O(num_reqs)):
    argument types, shapes, dtypes and devices; every request's context fits
    its block-table row (context_lens[r] <= block_table.shape[1] * block_size,
    the rank's local share under context parallelism); the metadata's
    block size, when it states one, is the layer's;
  * block ids in [0, num_blocks) for every block a request uses
    (`mla_ext.cache.checks.check_block_ids`, the gather API's validate=True
    check) reads the block table: `validate=True` always checks (a host sync
    on a GPU: not for CUDA graphs), `validate=False` never does, and the
    default `validate=None` checks exactly when that is free, i.e. when the
    block table is on the CPU. Unchecked, an out-of-range id gathers zero rows
    (the gather's documented out-of-range result), and those zero keys take
    part in the softmax: the result is wrong, not a crash.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from mla_ext._args import as_device, check_no_meta
from mla_ext.attention.api import merge_attn_states, varlen_attention
from mla_ext.attention.sinks import check_sinks
from mla_ext.attention.scratch import AttentionScratch
from mla_ext.cache import api as cache_api
from mla_ext.cache import checks as cache_checks
from mla_ext.prefill.context_parallel import cp_gather_context, cp_local_lens
from mla_ext.config.formats import QuantMode, ScaleKind
from mla_ext.kv_b_proj.input_dtype import kv_b_proj_input_dtype
from mla_ext.kv_b_proj.linear import KvBProj, activation_quantization
from mla_ext.kv_b_proj.weights import WeightFormat
from mla_ext.config.models import MLAModelConfig
from mla_ext.config.policy import CacheConfig, LayerCacheSpec, check_bool, check_configs, resolve_layer
from mla_ext.prefill import backends as planned
from mla_ext.prefill.chunking import (
    plan_context_chunks,
    workspace_alignment,
    workspace_rows,
)
from mla_ext.prefill.context import ContextAttention
from mla_ext.prefill.metadata import ContextParallel, PrefillMetadata  # noqa: F401  (PrefillMetadata re-exported)
from mla_ext.prefill.sparse import check_index_cache, check_index_inputs, sparse_for, sparse_forward

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _no_clock(step: str) -> None:
    """forward's step marks when no profiling clock is given."""


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
        validate: bool | None = None,
        context_attention: str = "auto",
        sparse=None,
        sinks: Tensor | None = None,
    ):
        """`validate`: the block-id range check of `forward` (module docstring):
        True always (a host sync on a GPU), False never, None (default) only when
        it is free (block table on the CPU). `forward(validate=)` overrides it.
        `context_attention`: "auto" (per chunk, by cost model), "absorbed" or
        "up_project" (every chunk that way); see the module docstring.
        `sinks`: attention-sink logits, a float tensor [num_heads] (this rank's
        heads), or None: each head's logit joins every softmax (attention/sinks.py).
        It is folded once, into the new-token pass, so the LSE merges with the
        context chunks (up-projected or absorbed) stay exact."""
        check_configs(cache_config, model, model_arg="model")
        if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
            raise ValueError(f"context_parallel: expected a ContextParallel or None, got "
                             f"{type(context_parallel).__name__}")
        self.validate = check_bool(validate, "validate", allow_none=True)
        self.spec: LayerCacheSpec = resolve_layer(cache_config, model, layer=layer, prefix=prefix)
        # This layer's own dims (L, R, P, V, heads, scale), where they differ per layer.
        self.model = model = model.for_layer(self.spec.layer_index)
        # The layer's own sparse config: a sparse model's layers without an indexer (dots3_note's
        # sliding layers) are dense; every indexed layer carries the model's SparseConfig.
        sparse = sparse_for(model, sparse, context_parallel)
        self.kv_b_proj = kv_b_proj if isinstance(kv_b_proj, KvBProj) else KvBProj(kv_b_proj)
        want_n = model.num_heads * (model.P + model.V)
        if (self.kv_b_proj.N, self.kv_b_proj.K) != (want_n, model.L):
            raise ValueError(
                f"kv_b_proj: expected a [{want_n}, {model.L}] weight (N*(P+V), L) for "
                f"{model.name}, got [{self.kv_b_proj.N}, {self.kv_b_proj.K}]"
            )
        self.use_fp8_prefill = check_bool(use_fp8_prefill, "use_fp8_prefill")
        self._unit_scale: dict[torch.device, Tensor] = {}
        self._attn_scratch: dict[torch.device, AttentionScratch] = {}
        # SPEC §5: a pure function of the layer. None means "no cast": the
        # activations stay in the model dtype (the linear quantizes itself).
        self.kv_b_proj_input_dtype = kv_b_proj_input_dtype(self.kv_b_proj, self.use_fp8_prefill)
        if self.kv_b_proj_input_dtype is None and self.kv_b_proj.params_dtype != model.model_dtype:
            # "No cast" assumes the linear takes the model dtype. A checkpoint whose
            # kv_b_proj params_dtype differs (fp8 weights declared fp16/fp32 in a bf16
            # model) would otherwise be accepted here and refused by the linear at the
            # first forward: reconcile now by casting to its params dtype, as the
            # dense, int4 and Marlin rows of the table already do (explain() says so).
            self.kv_b_proj_input_dtype = self.kv_b_proj.params_dtype
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
        self.context_attention = ContextAttention(self, context_attention)
        # DSA (mla_ext/prefill/sparse.py): a SparseConfig (given, or the model config's own) makes this
        # layer attend only the tokens its indexer selects; None (dense families) keeps every path
        # above unchanged.
        self.sparse = sparse
        check_no_meta(sinks=sinks)  # it would fail at the first forward's copy to q's device
        if sinks is not None:
            where = sinks.device if isinstance(sinks, Tensor) else torch.device("cpu")
            sinks = check_sinks(sinks, model.num_heads, where).detach().clone()
        self.sinks = sinks
        self._sinks_at: dict[torch.device, Tensor] = {}
        self._backend_key: tuple | None = None  # planned.static_key(self), made on first use

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
        device = as_device(device) if device is not None else self.kv_b_proj.device
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
            f"model dtype {self.model.model_dtype} ({self.model.dtype_source})"
            + ("; attention sinks (one logit per head, folded into the new-token pass)"
               if self.sinks is not None else ""),
            f"  kv_b_proj: {self.kv_b_proj.weight_format.describe()}; input dtype "
            f"{self.activation_dtype} (fp8 prefill {'on' if self.use_fp8_prefill else 'off'})"
            + (f"; params_dtype {self.kv_b_proj.params_dtype} differs from the model dtype "
               f"{self.model.model_dtype}: activations cast to it, its output cast back"
               if self.kv_b_proj.params_dtype != self.model.model_dtype else ""),
        ]
        try:
            backend = self.kv_b_proj.backend_for(self.workspace_rows, device, self._linear_act_dtype())
        except ValueError as exc:
            backend = f"none ({exc})"
        lines.append(f"  kv_b_proj backend at M={self.workspace_rows} on {device}: {backend}")
        quant = activation_quantization(backend, self._linear_act_dtype())
        lines.append(f"  kv_b_proj activations: {quant}")
        lines += self.context_attention.explain(self, device)
        if self.context_attention.mode != "up_project" and not quant.startswith("not quantized"):
            # The absorbed path multiplies by the dequantized weight in the model dtype:
            # its chunks skip the activation quantization the up-projection applies.
            lines.append("  note: absorbed context chunks use the dequantized kv_b_proj weight with unquantized "
                         "activations, up_project chunks and the new tokens the quantized activations above: "
                         "the two context paths differ by that quantization (about 2e-2 per layer on random "
                         "data; context_attention='up_project' makes every chunk quantize alike)")
        if self.sparse is not None:
            lines.append(f"  {self.sparse.describe()}")
        return "\n".join(lines)

    def explain_context(self, metadata: "PrefillMetadata", device: torch.device | str | None = None) -> str:
        """The path every context chunk of `metadata` takes on `device`, and why."""
        if not isinstance(metadata, PrefillMetadata):
            raise ValueError(f"metadata: expected a PrefillMetadata (explain_context(metadata, device=None)), "
                             f"got {type(metadata).__name__} {metadata!r:.60}")
        device = as_device(device) if device is not None else metadata.block_table.device
        return "\n".join([f"layer {self.layer_index}: context chunks on {device}"]
                         + self.context_attention.explain_chunks(self, metadata, device)
                         + self._explain_backends(metadata))

    def _static_backend_key(self) -> tuple:
        """The part of this layer's backend key fixed at construction (mla_ext/prefill/backends.py)."""
        if self._backend_key is None:
            self._backend_key = planned.static_key(self)
        return self._backend_key

    def _explain_backends(self, metadata: PrefillMetadata) -> list[str]:
        """The op backends resolved for `metadata` by forwards of layers with this layer's key."""
        mine = [b for k, b in metadata.resolved_backends().items() if k[0] == self._static_backend_key()]
        if not mine:
            return ["  backends: not resolved for this batch yet (the first forward resolves each op once)"]
        return [f"  backends resolved for this batch (once, reused by every layer of this key): "
                + ", ".join(b.describe()) for b in mine]

    def _linear_act_dtype(self) -> torch.dtype:
        return self.activation_dtype

    def prepare(self, kv_cache: Tensor, *, k_scale: Tensor | None = None,
                warm: bool | None = None, index_cache: Tensor | None = None) -> "MLAPrefill":
        """Compiles every kernel variant this layer will use, before serving (and before
        any CUDA graph capture), so no Triton JIT compile happens mid-run: `warm`
        (default: kv_cache on a CUDA device) runs kv_b_proj once per row bucket up to the
        workspace rows (`KvBProj.prepare`), the cache writer (a padding slot: nothing is
        stored) and KV-scale kernel, the gathers at a small and a >= 64K-row dst (their
        two tile configs), and a tiny two-request forward through each context path
        (absorbed and up-projected). The cache is only read. Integer arguments that
        vary with the batch never cause a compile (`do_not_specialize`).
        `index_cache` (a sparse layer's paged index cache): checked against this layer's latent plan
        now (`check_index_cache`), not at the first batch."""
        self.check_cache(kv_cache)
        if index_cache is not None:
            self.check_index_cache(index_cache, kv_cache)
        device = kv_cache.device
        warm = device.type == "cuda" if warm is None else check_bool(warm, "warm")
        self.kv_b_proj.prepare(device, self.kv_b_proj.params_dtype, warm=warm,
                               max_rows=self.workspace_rows, act_dtype=self._linear_act_dtype())
        if not warm:
            return self
        m, dt = self.model, self.model.model_dtype
        if k_scale is None and self.spec.quant_mode == QuantMode.FP8_PER_TENSOR:
            k_scale = torch.ones(1, dtype=torch.float32, device=device)
        kv_c = torch.zeros(3, m.L, dtype=dt, device=device)
        k_pe = torch.zeros(3, m.R, dtype=dt, device=device)
        self.compute_kv_scale(kv_c, k_pe)
        self.write_cache(kv_c, k_pe, kv_cache, torch.full((3,), -1, dtype=torch.int64, device=device),
                         k_scale, validate=False)
        scale = self._k_scale(k_scale, device)
        table = torch.zeros(2, 1, dtype=torch.int32, device=device)
        cu = torch.tensor([0, 1, 1], dtype=torch.int32, device=device)
        for rows in (2, max(65536, 2)):  # the gathers' tile height changes at 64K dst rows
            if rows > 2 and self.workspace_rows < 65536:
                break
            dst = torch.empty(rows, m.L + m.R, dtype=self.workspace_dtype, device=device)
            cache_api.gather_and_maybe_dequant_cache(kv_cache, dst, table, cu, 1, self.spec.kv_cache_dtype,
                                                     scale)
        meta = PrefillMetadata(table, [1, 0], [1, 2], k_scale, block_size=kv_cache.shape[1])
        q = torch.zeros(3, m.num_heads, m.P + m.R, dtype=dt, device=device)
        kept = self.context_attention
        if self.sparse is not None and self.sparse.drops(meta.context_lens, meta.query_lens):
            return self  # index_topk < 2: this tiny batch would already need the indexer's inputs
        try:
            for mode in ("absorbed", "up_project"):
                self.context_attention = ContextAttention(self, mode)
                self.forward(q, kv_c, k_pe, kv_cache, meta, k_scale=k_scale, validate=False)
        finally:
            self.context_attention = kept
        return self

    # -- cache writes --------------------------------------------------------
    def compute_kv_scale(self, kv_c: Tensor, k_pe: Tensor) -> Tensor | None:
        """The per-tensor K scale for this layer, or None when it computes none
        (skipped/native layers, fp8_ds_mla, calculate_kv_scales off)."""
        if not self.spec.calculate_kv_scales or self.spec.format.scale_kind != ScaleKind.PER_TENSOR:
            return None
        return cache_api.compute_kv_scale(kv_c, k_pe, self.spec.kv_cache_dtype)

    def write_cache(self, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                    k_scale: Tensor | None = None, *, validate: bool | None = None) -> None:
        """Stores new tokens in this layer's cache, in this layer's format.

        `validate` (None: the layer's setting) as in `forward`: the slot range check
        of `concat_and_cache_mla(validate=True)`, by default only where it is free
        (slot_mapping on the CPU)."""
        validate = check_bool(validate, "validate", allow_none=True)
        if not isinstance(kv_c, Tensor):
            raise ValueError(f"kv_c: expected a torch.Tensor, got {type(kv_c).__name__}")
        self.check_cache(kv_cache)
        scale = self._k_scale(k_scale, kv_c.device)
        if validate is None:
            validate = self.validate
        if validate is None:
            validate = isinstance(slot_mapping, Tensor) and slot_mapping.device.type == "cpu"
        cache_api.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, self.spec.kv_cache_dtype,
                                       scale, validate=validate)

    def check_cache(self, kv_cache: Tensor) -> None:
        s = self.spec
        if not isinstance(kv_cache, Tensor) or kv_cache.dim() != 3:
            raise ValueError("kv_cache: expected a [num_blocks, block_size, entry] tensor")
        ok_dtypes = {s.storage_dtype}
        if s.is_quantized:
            ok_dtypes |= {torch.uint8, s.format.fp8_dtype}
        if kv_cache.dtype not in ok_dtypes or tuple(kv_cache.shape[1:]) != (s.block_size, s.entry_elems):
            raise ValueError(
                f"kv_cache: layer {s.layer_index} (kv_cache_dtype {s.kv_cache_dtype!r}) expects "
                f"[num_blocks, {s.block_size}, {s.entry_elems}] {s.storage_dtype}, got "
                f"{tuple(kv_cache.shape)} {kv_cache.dtype}"
            )

    def check_index_cache(self, index_cache: Tensor, kv_cache: Tensor | None = None) -> None:
        """A sparse layer's paged index cache against this layer's latent plan: pages of this layer's
        block_size (one block id names a latent page and an index page), the row width and storage
        dtype of its index_cache_dtype, and (with kv_cache) at least the latent cache's blocks on
        its device. ValueError naming index_cache; a dense layer has no index cache."""
        if self.sparse is None:
            raise ValueError(f"index_cache: layer {self.layer_index} is dense (no SparseConfig); it has no "
                             "index cache")

        if kv_cache is not None:
            self.check_cache(kv_cache)
        check_index_cache(self.sparse, index_cache, self.spec.block_size, kv_cache)

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
            unit = torch.ones(1, dtype=torch.float32, device=device)
            # A tensor made inside a CUDA graph capture is only filled when the graph
            # replays: keep it for this graph, never for later eager calls.
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._unit_scale[device] = unit
        return unit

    def _sinks_on(self, device) -> Tensor | None:
        """The sink logits on `device` (copied once per device), or None."""
        if self.sinks is None:
            return None
        device = torch.device(device)
        if device not in self._sinks_at:
            self._sinks_at[device] = self.sinks.to(device)
        return self._sinks_at[device]

    # -- forward -------------------------------------------------------------
    def _up_project(self, kv_c: Tensor, chosen=None) -> tuple[Tensor, Tensor]:
        """kv_c [M, L] (any row stride) -> k_nope [M, N, P], v [M, N, V]. `chosen`: the call
        site's backend, resolved once per batch (mla_ext/prefill/backends.py)."""
        m = self.model
        x_scale = None
        want = self.kv_b_proj_input_dtype
        if want in FP8_DTYPES:
            # FP8 prefill into an fp8 weight: quantize with one scale per row
            # (per token), computed on the device (no host sync). Per row, not
            # per tensor: a row's scale depends on that row alone, so a
            # non-finite value in one request's latents makes only its own rows
            # non-finite instead of every request's (issue 20).
            amax = kv_c.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
            x_scale = amax / torch.finfo(want).max  # [M, 1]
            x = (kv_c.float() / x_scale).clamp(-torch.finfo(want).max, torch.finfo(want).max).to(want)
        elif want is not None and kv_c.dtype != want:
            x = kv_c.to(want)
        else:
            x = kv_c
        kv = self.kv_b_proj(x, x_scale, chosen=chosen)
        kv = kv.view(-1, m.num_heads, m.P + m.V)
        return kv[..., : m.P], kv[..., m.P :]

    def _keys(self, k_nope: Tensor, k_pe: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The keys in split form, for varlen_attention(k=k_nope, k_rope=k_pe): k_nope
        [M, N, P] (a view of the kv_b_proj output) and k_pe [M, R] (the workspace's
        rope columns), in the attention dtype (no copy when they have it already).
        The keys [M, N, P+R] are not built here: the Triton backend reads both parts
        in its own loads; a backend that takes one key tensor (flex_attention,
        varlen_attn) assembles it in this layer's attention scratch, one per
        device, which every chunk reuses (`_attention_scratch`)."""
        return k_nope.to(dtype), k_pe.to(dtype)

    def _attention_scratch(self, device) -> AttentionScratch:
        """This layer's attention buffers on `device`, sized on first use for
        workspace_rows rows (the largest chunk). One made inside a CUDA graph
        capture serves that graph only (kept out of the cache, as `_k_scale` does)."""
        device = torch.device(device)
        scratch = self._attn_scratch.get(device)
        if scratch is None:
            scratch = AttentionScratch(min_rows=self.workspace_rows)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._attn_scratch[device] = scratch
        return scratch

    def _workspace(self, given: Tensor | None, device, **inputs: Tensor) -> Tensor:
        """The gather's destination: `given` (checked, and disjoint from every input
        the layer still reads after a gather overwrites it) or a new buffer."""
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
        for arg, t in inputs.items():
            cache_checks.check_no_overlap(given, "workspace", t, arg)
        return given

    def _gather(self, kv_cache, workspace, metadata, c, t, scale, chosen=None) -> None:
        """The chunk's context rows into workspace[:c.total_rows], dequantized (`chosen`: the
        call site's backend, resolved once per batch)."""
        table = metadata.block_table[c.req_start:c.req_end]
        if self.cp is None:
            cache_api.gather_and_maybe_dequant_cache(
                kv_cache, workspace[: c.total_rows], table, t.cu_seq_lens, c.num_reqs,
                self.spec.kv_cache_dtype, scale, t.seq_starts, chosen=chosen,
            )
        else:
            cp_gather_context(
                kv_cache, workspace, table, c.chunk_lens, self.spec.kv_cache_dtype, scale,
                cp_size=self.cp.cp_size, rank=self.cp.rank, interleave=self.cp.interleave,
                seq_starts=c.seq_starts, group=self.cp.group,
            )

    @staticmethod
    def _check_types(q, kv_c_normed, k_pe, kv_cache, metadata, clock, k_scale) -> None:
        """Arguments are what forward reads (else a vague AttributeError later)."""
        for name, x in (("q", q), ("kv_c_normed", kv_c_normed), ("k_pe", k_pe),
                        ("kv_cache", kv_cache)):
            if not isinstance(x, Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not isinstance(metadata, PrefillMetadata):
            raise ValueError(f"metadata: expected a PrefillMetadata, got {type(metadata).__name__}")
        if clock is not None and not (callable(getattr(clock, "mark", None))
                                      and callable(getattr(clock, "start", None))):
            raise ValueError(f"clock: expected None or an object with start() and mark(step) "
                             f"(mla_ext.prefill.timing.StepClock), got {type(clock).__name__}")
        if k_scale is not None and not isinstance(k_scale, Tensor):
            raise ValueError(f"k_scale: expected a float32 tensor [1] or None, got "
                             f"{type(k_scale).__name__}")

    def _local_lens(self, lens):
        """This rank's share of each context length (the block table is local under CP)."""
        if self.cp is None:
            return lens
        return cp_local_lens(lens, self.cp.cp_size, self.cp.rank, self.cp.interleave)

    def _check_table(self, metadata: PrefillMetadata, kv_cache: Tensor, validate: bool | None) -> None:
        """The block table covers every request's context (host ints, O(1) unless it
        fails); with validate, every block id a request uses is in [0, num_blocks)."""
        B = self.spec.block_size
        if metadata.block_size is not None and metadata.block_size != B:
            raise ValueError(
                f"metadata: built for block_size {metadata.block_size}, but layer "
                f"{self.layer_index} has block_size {B} (its block ids mean other tokens); "
                "build a PrefillMetadata for this block size"
            )
        bt = metadata.block_table
        width = bt.shape[1]
        # The local share is monotone in the global length: the longest context
        # needs the most blocks, so one comparison covers every request.
        if self._local_lens(metadata.max_context_len) > width * B:
            for r, n in enumerate(metadata.context_lens):
                local = self._local_lens(n)
                if local > width * B:
                    mine = (f" ({local} of them on context-parallel rank {self.cp.rank})"
                            if self.cp is not None else "")
                    raise ValueError(
                        f"context_lens[{r}]: {n} tokens{mine} need {-(-local // B)} blocks of "
                        f"{B}, but metadata.block_table has {width} columns ({width * B} tokens)"
                    )
        if validate is None:
            validate = bt.device.type == "cpu"  # free there: no device sync
        if validate:
            lens = self._local_lens(list(metadata.context_lens))
            cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
            cache_checks.check_block_ids(bt, cu, len(lens), None, kv_cache.shape[0], B)

    def _context(self, q: Tensor, kv_cache: Tensor, metadata: PrefillMetadata, k_scale, workspace, scratch,
                 tick, sites=planned.NO_PLAN, **reads: Tensor) -> tuple[Tensor, Tensor]:
        """Every query against its request's cached context, chunk by chunk: (o [T, N, V]
        in q's dtype, natural-log LSE [N, T] fp32); (0, -inf) where a request has none.
        `reads`: further inputs the caller still reads (kept disjoint from the workspace); `sites`: the
        batch's resolved backends (mla_ext/prefill/backends.py), NO_PLAN to dispatch every call."""
        m = self.model
        T = metadata.num_tokens
        device, dtype = q.device, q.dtype
        plan = metadata.plan(self.workspace_rows, self.chunk_alignment)
        acc_o = torch.zeros(T, m.num_heads, m.V, dtype=dtype, device=device)
        acc_lse = torch.full((m.num_heads, T), float("-inf"), dtype=torch.float32, device=device)
        if plan.chunks:
            workspace = self._workspace(workspace, device, q=q, kv_cache=kv_cache, **reads)
            scale = self._k_scale(k_scale if k_scale is not None else metadata.k_scale, device)
            for c in plan.chunks:
                t = metadata.chunk_tensors(c, device)
                where = f"chunk {c.index}"
                if self.context_attention.choose(c, device).path == "absorbed":
                    qs = slice(c.token_start, c.token_end)
                    o, lse = self.context_attention.run(self, q[qs], kv_cache, workspace, metadata, c, t,
                                                        scale, tick, sites)
                    merge_attn_states(acc_o[qs], acc_lse[:, qs], o, lse,
                                      out=acc_o[qs], out_lse=acc_lse[:, qs], chosen=sites.site(("merge", where)))
                    tick("merge")
                    continue
                rows = c.total_rows
                self._gather(kv_cache, workspace, metadata, c, t, scale, sites.site(("gather", where)))
                tick("gather")
                ck_nope, cv = self._up_project(workspace[:rows, : m.L], sites.site(("kv_b_proj", where)))
                tick("kv_b_proj")
                ck_nope, ck_rope = self._keys(ck_nope, workspace[:rows, m.L :], dtype)
                tick("keys")
                qs = slice(c.token_start, c.token_end)
                o, lse = varlen_attention(q[qs], ck_nope, cv.to(dtype), t.cu_seqlens_q, t.cu_seq_lens,
                                          c.max_query_len, c.max_seq_len, self.softmax_scale,
                                          causal=False, k_rope=ck_rope, scratch=scratch,
                                          chosen=sites.site(("attention", where)))
                tick("attention")
                merge_attn_states(acc_o[qs], acc_lse[:, qs], o, lse,
                                  out=acc_o[qs], out_lse=acc_lse[:, qs], chosen=sites.site(("merge", where)))
                tick("merge")

        return acc_o, acc_lse

    def forward_context(self, q: Tensor, kv_cache: Tensor, metadata: PrefillMetadata, *,
                        k_scale: Tensor | None = None, workspace: Tensor | None = None,
                        validate: bool | None = None) -> tuple[Tensor, Tensor]:
        """The context half of `forward` alone, for an engine that attends the new
        tokens itself and merges: q [T, N, P+R] -> (o [T, N, V], LSE [N, T] fp32,
        natural log). Same cache, metadata, k_scale, workspace and validate rules as
        `forward`; each chunk goes absorbed or up-projected by the layer's
        `context_attention` choice."""
        validate = check_bool(validate, "validate", allow_none=True)
        self._check_types(q, q, q, kv_cache, metadata, None, k_scale)
        m = self.model
        T = metadata.num_tokens
        if q.dim() != 3 or tuple(q.shape) != (T, m.num_heads, m.P + m.R):
            raise ValueError(f"q: expected [{T}, {m.num_heads}, {m.P + m.R}], got {tuple(q.shape)}")
        if q.dtype != m.model_dtype:
            raise ValueError(f"q: expected the model dtype {m.model_dtype}, got {q.dtype}")
        for name, x in (("kv_cache", kv_cache), ("metadata.block_table", metadata.block_table)):
            if x.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (as q), got {x.device}")
        check_no_meta(q=q, kv_cache=kv_cache, block_table=metadata.block_table, k_scale=k_scale, workspace=workspace)
        self.check_cache(kv_cache)
        self._check_table(metadata, kv_cache, self.validate if validate is None else validate)
        self._refuse_sparse_context(metadata)
        sites = planned.for_forward(self, metadata, q, None, None, kv_cache, workspace)
        return self._context(q, kv_cache, metadata, k_scale, workspace, self._attention_scratch(q.device),
                             _no_clock, sites=sites)

    def _refuse_sparse_context(self, metadata: PrefillMetadata) -> None:
        """forward_context attends every context key (the caller attends the new tokens densely and
        merges): for a sparse layer that equals the layer's attention only while nothing is dropped
        (context + new <= index_topk for every request with new tokens, see `forward`); past that it
        is refused, naming index_topk, never answered densely."""
        if self.sparse is None or not self.sparse.drops(metadata.context_lens, metadata.query_lens):
            return
        r, c, n = next((r, c, n) for r, (c, n) in enumerate(zip(metadata.context_lens, metadata.query_lens))
                       if n > 0 and c + n > self.sparse.index_topk)
        raise ValueError(
            f"metadata: layer {self.layer_index} is sparse (index_topk={self.sparse.index_topk}) and request {r} "
            f"has {c} context + {n} new tokens = {c + n} keys for its last query; forward_context computes "
            "dense context attention, which equals the layer's only up to index_topk keys; use "
            "forward(..., index=IndexInputs(...)) (the sparse path) instead")

    def _check_index(self, index, kv_cache: Tensor) -> None:
        """A sparse layer's index cache (in IndexInputs) against the latent plan, whether or not this
        batch needs it: page size, width, dtype and block count (mla_ext.prefill.sparse.check_index_cache)."""
        if self.sparse is None or index is None or isinstance(index, Tensor):
            return
        cache = getattr(index, "cache", None)
        if cache is not None:

            check_index_cache(self.sparse, cache, self.spec.block_size, kv_cache, arg="index.cache")

    def forward(self, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor,
                metadata: PrefillMetadata, clock=None, *, k_scale: Tensor | None = None,
                workspace: Tensor | None = None, validate: bool | None = None,
                attention_scratch: AttentionScratch | None = None, index=None) -> Tensor:
        """q [T, N, P+R], kv_c_normed [T, L], k_pe [T, R] of the new tokens -> [T, N, V].

        `index`: a sparse layer's indexer inputs (mla_ext.prefill.sparse.IndexInputs) or a selection
        made before (int32 [T, K]), needed once some request has more than index_topk tokens
        (context + new); ignored by dense layers.

        `k_scale`: this layer's per-tensor fp32 K scale [1] (per-tensor fp8 layers;
        K scales are per layer). Defaults to `metadata.k_scale`, which one batch's
        layers share, so pass it whenever layers were written with different scales.

        `workspace`: an optional preallocated `[>= workspace_rows, L+R]` buffer of
        this layer's workspace dtype (row stride may exceed L+R), so a serving
        engine can share one bounded buffer across layers; allocated per call
        otherwise.

        `attention_scratch`: an optional `mla_ext.attention.AttentionScratch` for the
        attention backends that assemble the keys [M, N, P+R] (flex_attention,
        varlen_attn; the default Triton backend reads them split and needs none), so
        layers can share one; the layer's own (one per device) otherwise.

        `clock` (optional, for profiling; see mla_ext.prefill.timing.StepClock)
        gets `clock.mark(step)` after every step.

        `validate`: the block-id range check for this call (True / False), or None
        (default) for the layer's setting (see the module docstring).
        """
        validate = check_bool(validate, "validate", allow_none=True)
        self._check_types(q, kv_c_normed, k_pe, kv_cache, metadata, clock, k_scale)
        if attention_scratch is not None and not isinstance(attention_scratch, AttentionScratch):
            raise ValueError(f"attention_scratch: expected an mla_ext.attention.AttentionScratch or None, "
                             f"got {type(attention_scratch).__name__}")
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
        check_no_meta(q=q, kv_c_normed=kv_c_normed, k_pe=k_pe, kv_cache=kv_cache, block_table=metadata.block_table,
                      k_scale=k_scale, workspace=workspace)
        self.check_cache(kv_cache)
        self._check_table(metadata, kv_cache, self.validate if validate is None else validate)
        self._check_index(index, kv_cache)
        if self.sparse is not None and self.sparse.drops(metadata.context_lens, metadata.query_lens):
            if index is None:
                raise ValueError(f"index: layer {self.layer_index} is sparse (index_topk="
                                 f"{self.sparse.index_topk}) and a request has more tokens than that; "
                                 "pass the indexer's inputs (mla_ext.prefill.sparse.IndexInputs)")
            if self.sinks is not None:
                raise ValueError(f"sinks: layer {self.layer_index} has attention sinks and a request past "
                                 f"index_topk={self.sparse.index_topk}; the sparse (DSA) path does not take "
                                 "sinks yet (refused rather than silently dropped)")

            check_index_inputs(self.sparse, index, kv_cache, q)
            return sparse_forward(self, q, kv_c_normed, k_pe, kv_cache, metadata, index, k_scale,
                                  planned.for_forward(self, metadata, q, kv_c_normed, k_pe, kv_cache, None))
        # Dense from here. For a sparse layer this is reached only when every request with new tokens
        # has context + new <= index_topk (`SparseConfig.drops` is False): its last query sees
        # context + new keys, every earlier one fewer, so the indexer's top index_topk of a query's
        # visible keys is all of them, and attending the selection is attending every visible key:
        # exactly this dense causal attention (the indexer's scores only rank keys, they never
        # weight them). A request without new tokens has no query to select for.
        device, dtype = q.device, q.dtype
        cu_q = metadata.cu_seqlens_q(device)
        max_q = max(metadata.query_lens, default=0)
        tick = clock.mark if clock is not None else _no_clock
        # Each op's backend: resolved once per (layer key, batch plan), reused by every later call.
        sites = planned.for_forward(self, metadata, q, kv_c_normed, k_pe, kv_cache, workspace)
        if clock is not None:
            clock.start()

        # 1. New tokens: causal attention over themselves.
        k_nope, v = self._up_project(kv_c_normed, sites.site(("kv_b_proj", "new")))
        tick("kv_b_proj")
        k_nope, k_rope = self._keys(k_nope, k_pe, dtype)
        tick("keys")
        scratch = attention_scratch if attention_scratch is not None else self._attention_scratch(device)
        o_new, lse_new = varlen_attention(q, k_nope, v.to(dtype), cu_q, cu_q, max_q, max_q,
                                          self.softmax_scale, causal=True, k_rope=k_rope, scratch=scratch,
                                          sinks=self._sinks_on(device), chosen=sites.site(("attention", "new")))
        tick("attention")

        # 2. Context, chunk by chunk, merged into (0, -inf).
        acc_o, acc_lse = self._context(q, kv_cache, metadata, k_scale, workspace, scratch, tick,
                                       kv_c_normed=kv_c_normed, k_pe=k_pe, sites=sites)

        # 3. Context result merged with the new-token result.
        out, _ = merge_attn_states(acc_o, acc_lse, o_new, lse_new, chosen=sites.site(("merge", "new")))
        tick("merge")
        return out

    __call__ = forward
