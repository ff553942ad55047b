"""The ``MLA_EXT`` MLA prefill backend for vLLM 0.32/0.33 (imported by vLLM only).

vLLM resolves this class from its ``CUSTOM`` registry member (``MLA_EXT`` is
that member's alias), registered by mla_ext/vllm/plugin.py, when
``--attention-config.mla_prefill_backend=MLA_EXT`` is given (on vLLM CPU
through mla_ext/vllm/cpu_platform.py). vLLM's own
MLA code (``MLACommonBaseImpl.forward_mha`` / ``_compute_prefill_context``)
keeps its structure: it gathers each context chunk, up-projects it through
kv_b_proj and concatenates the keys, then calls

* ``run_prefill_new_tokens(q, k, v, return_softmax_lse, out, output_scale)``:
  causal attention of the new tokens (per request, ``query_start_loc``);
* ``run_prefill_context_chunk(chunk, q, k, v, out)``: the chunk's queries
  against its gathered keys, non-causal, with the LSE;

and merges the partials with ``merge_attn_states``. Here both run on
``mla_ext.attention.varlen_attention`` (Triton / flex / FA2 / torch, chosen by
mla_ext's dispatch), LSE natural-log ``[num_heads, num_tokens]`` as vLLM's.
Building the first backend also routes vLLM's MLA cache ops and the merge to
mla_ext's (plugin.route_ops), unless MLA_EXT_VLLM_OPS=0.

Where vLLM's structure stops this backend: it receives up-projected keys, so
mla_ext's absorbed context attention (queries absorbed through W_UK, attention
in latent space straight from the paged cache) cannot be reached through the
backend interface itself. Building the backend therefore also wraps vLLM's
``MLACommonBaseImpl._compute_prefill_context`` (mla_ext/vllm/absorbed_context.py),
which does nothing unless ``MLA_EXT_VLLM_CONTEXT=absorbed`` or ``auto`` asks for
the latent path (auto: mla_ext's cost model per batch). FP8 attention inputs
(vLLM's prefill query quantization) are not taken: ``supports_quant_output``
is False and fp8 dtypes are not in ``supported_dtypes``.
"""
from __future__ import annotations

import os
from typing import ClassVar

import torch
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions, MLAPrefillBackend

from mla_ext.attention.api import varlen_attention
from mla_ext.vllm import plugin

_announced = False  # one INFO line per process when the first layer builds the backend


class MlaExtPrefillBackend(MLAPrefillBackend):
    """vLLM MLA prefill backend over mla_ext's varlen attention."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    # Empty: every MLA geometry (mla_ext has no fixed head dims; R = 0 included).
    supported_mla_dimensions: ClassVar[list[MLADimensions]] = []

    @staticmethod
    def get_name() -> str:
        return plugin.BACKEND_NAME

    @classmethod
    def supports_compute_capability(cls, device_capability) -> bool:
        # None: no GPU (vLLM on a CPU-type platform): the CPU backends serve.
        # The Triton kernels need bf16 mma (sm_80); older GPUs have the torch path only.
        return device_capability is None or device_capability.major >= 8

    @classmethod
    def supports_mla_dimensions(cls, mla_dimensions: MLADimensions) -> bool:
        qk = mla_dimensions.qk_nope_head_dim + mla_dimensions.qk_rope_head_dim
        # 0/0/0 is vLLM's "dims unknown yet" (no model config): accepted.
        unknown = qk == 0 and mla_dimensions.v_head_dim == 0
        return unknown or (qk > 0 and mla_dimensions.v_head_dim > 0)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if plugin.ops_mode() != "off":
            plugin.route_ops()
        # MLA_EXT_VLLM_CONTEXT=absorbed|auto (read per call; unset: vLLM's own loop).
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl

        from mla_ext.vllm import absorbed_context

        absorbed_context.install(MLACommonBaseImpl)
        global _announced
        if not _announced:
            _announced = True
            plugin.logger.info(
                "mla_ext: MLA prefill backend %s chosen (pid %d): new-token and context-chunk attention on "
                "mla_ext.attention.varlen_attention; routed to mla_ext: %s; context path: %s "
                "(MLA_EXT_VLLM_CONTEXT)", plugin.BACKEND_NAME, os.getpid(),
                ", ".join(plugin.routed()) or "nothing (MLA_EXT_VLLM_OPS=0)", absorbed_context.context_mode())

    def supports_out(self) -> bool:
        return True

    def _attend(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool):
        return varlen_attention(q, k, v, cu_q, cu_k, int(max_q), int(max_k), self.scale, causal, True)

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ):
        if output_scale is not None:
            raise ValueError("output_scale: expected None; the MLA_EXT prefill backend does not write fp8 output "
                             "(supports_quant_output is False)")
        plugin.note_call("run_prefill_new_tokens")
        md = self._prefill_metadata
        o, lse = self._attend(q, k, v, md.query_start_loc, md.query_start_loc, md.max_query_len,
                              md.max_query_len, causal=True)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse) if return_softmax_lse else o

    def run_prefill_context_chunk(self, chunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor | None = None):
        plugin.note_call("run_prefill_context_chunk")
        o, lse = self._attend(q, k, v, chunk.query_start_loc, chunk.cu_seq_lens, chunk.max_query_len,
                              chunk.max_seq_len, causal=False)
        if out is not None:
            out.copy_(o)
            o = out
        return o, lse
