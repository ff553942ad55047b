"""Which path each context chunk of an MLAPrefill layer takes: the absorbed (latent-space)
attention of mla_ext/attention/latent.py, or the up-projection through kv_b_proj then varlen
attention, decided per chunk by the cost model of context_cost.py (or the user's override)."""
from __future__ import annotations

import torch
from torch import Tensor

from mla_ext.attention.latent import LATENT, LatentInputs, absorb_queries, absorbed_weights, latent_context_attention, unabsorb
from mla_ext.prefill import context_cost as AC
from mla_ext.prefill.backends import NO_PLAN


CONTEXT_ATTENTION_MODES = ("auto", "absorbed", "up_project")


_CHOICE_CACHE_MAX = 4096


def check_context_attention(value) -> str:
    if not (isinstance(value, str) and value in CONTEXT_ATTENTION_MODES):
        raise ValueError(f"context_attention: expected one of {CONTEXT_ATTENTION_MODES}, got {value!r}")
    return value


class ContextAttention:
    """How one MLAPrefill layer attends its context chunks.

    mode "auto": per chunk, the cheaper path by `context_cost` (rates measured for
    the device when a table exists, else stated defaults); "absorbed" /
    "up_project": always that path (the user's override)."""

    def __init__(self, layer, mode: str = "auto"):
        self.mode = check_context_attention(mode)
        self.dims = AC.Dims.of_layer(layer)
        self._layer_cp = layer.cp is not None
        self._choices: dict = {}

    def gathers(self, device: torch.device) -> bool:
        """Whether the absorbed path gathers rows first: under context parallelism
        (the rows are all-gathered), and on the CPU (its torch path)."""
        return self._layer_cp or torch.device(device).type != "cuda"

    def choose(self, chunk, device):
        """The path of one chunk: an `context_cost.Choice`."""
        device = torch.device(device)
        if self.mode != "auto":
            return AC.Choice(self.mode, f"context_attention={self.mode!r} (the layer's override)")
        key = (chunk, device)
        hit = self._choices.get(key)
        if hit is None:
            q_lens = [b - a for a, b in zip(chunk.cu_seqlens_q, chunk.cu_seqlens_q[1:])]
            hit = AC.choose(self.dims, chunk.chunk_lens, q_lens, AC.rates_for(device),
                            absorbed_gathers=self.gathers(device))
            if len(self._choices) >= _CHOICE_CACHE_MAX:
                self._choices.clear()
            self._choices[key] = hit
        return hit

    @staticmethod
    def backend(q_lat: Tensor, kv_cache: Tensor, kv_cache_dtype: str, cu: Tensor, chosen=None) -> str:
        """The latent attention backend that would read this cache (decided from
        devices, dtypes and strides; `cu`, any int32 offsets, is not read). `chosen`:
        the call site's choice when resolved once per batch (mla_ext/prefill/backends.py)."""
        x = LatentInputs(q_lat, q_lat[..., :0].transpose(0, 1), kv_cache, kv_cache_dtype, None, cu, cu, None, None,
                         1.0, (0, 0), (0, 0))
        return (LATENT.choose(x) if chosen is None else chosen.pick(LATENT, x)).name

    def run(self, layer, q: Tensor, kv_cache: Tensor, workspace: Tensor, metadata, c, t, scale: Tensor,
            tick, sites=NO_PLAN) -> tuple[Tensor, Tensor]:
        """One chunk's context attention in latent space: q [Tc, N, P+R] (the chunk's
        query rows) -> (o [Tc, N, V] in q's dtype, lse [N, Tc] float32). `sites`: the
        batch's resolved backends (mla_ext/prefill/backends.py), or NO_PLAN."""
        where = f"chunk {c.index}"
        m = layer.model
        w_uk, w_uv_t = absorbed_weights(layer.kv_b_proj, m.num_heads, m.P, m.V, q.dtype, q.device)
        q_lat = absorb_queries(q[..., : m.P], w_uk)
        tick("kv_b_proj")
        rows = None
        if layer.cp is not None or self.backend(q_lat, kv_cache, layer.spec.kv_cache_dtype, t.cu_seq_lens,
                                                sites.site(("latent_attention probe", where))) != "triton":
            # The rows are gathered first (all-gathered under context parallelism; the
            # torch path reads gathered rows): the layer's own gather, timed as such.
            layer._gather(kv_cache, workspace, metadata, c, t, scale, sites.site(("gather", where)))
            rows = workspace[: c.total_rows]
            tick("gather")
        o_lat, lse = latent_context_attention(
            q_lat, q[..., m.P:], kv_cache, layer.spec.kv_cache_dtype,
            metadata.block_table[c.req_start:c.req_end], t.cu_seqlens_q, t.cu_seq_lens, t.seq_starts, scale,
            layer.softmax_scale, q_offsets=c.cu_seqlens_q, ctx_offsets=c.cu_seq_lens, workspace=workspace,
            rows=rows, chosen=sites.site(("latent_attention", where)),
        )
        tick("attention")
        o = unabsorb(o_lat, w_uv_t)
        tick("kv_b_proj")
        return o, lse

    def explain(self, layer, device) -> list[str]:
        """Lines for MLAPrefill.explain(): the mode, and for auto the predicted
        crossover in new tokens per request and the rates it comes from."""
        device = torch.device(device)
        m = layer.model
        flop_x = AC.flop_crossover(m.L, m.P, m.V)
        if self.mode != "auto":
            return [f"  context attention: {self.mode} for every chunk (context_attention={self.mode!r}, "
                    f"the user's override; the FLOP-count crossover would be {flop_x:.1f} new tokens per request)"]
        rates = AC.rates_for(device)
        gathers = self.gathers(device)
        sizes = sorted({layer.workspace_rows, min(layer.workspace_rows, 4096)})
        cross = ", ".join(f"{_fmt_tokens(AC.crossover_new_tokens(self.dims, c, rates, absorbed_gathers=gathers))}"
                          f" at {c} context rows" for c in sizes)
        return [
            f"  context attention: auto, per chunk by cost model: absorbed (latent space, no up-projection of "
            f"the context) while a chunk's requests have few new tokens, up_project otherwise; predicted "
            f"crossover for one request: {cross} (FLOP count alone: {flop_x:.1f})",
            f"  context attention rates on {device}: {rates.describe()}",
        ]

    def explain_chunks(self, layer, metadata, device) -> list[str]:
        """One line per chunk of `metadata`'s plan: its path and why."""
        plan = metadata.plan(layer.workspace_rows, layer.chunk_alignment)
        out = []
        for c in plan.chunks:
            ch = self.choose(c, device)
            out.append(f"  chunk {c.index}: requests [{c.req_start}, {c.req_end}), {c.total_rows} context rows, "
                       f"{c.token_end - c.token_start} query rows: {ch.path} ({ch.reason})")
        return out


def _fmt_tokens(x: float) -> str:
    if x == float("inf"):
        return "absorbed always"
    if x <= 0:
        return "up_project always"
    return f"absorbed below {x:.0f} new tokens"
