"""mla_ext's sparse MLA attention backend for vLLM 0.32/0.33 (DSA: DeepSeek-V3.2, GLM-5), for
the GPUs vLLM has no sparse MLA kernel for (compute capability 8.x; vLLM's own need 9.x+).
mla_ext/vllm/sparse_plugin.py registers `MlaExtSparseMLABackend` under vLLM's CUSTOM member
and, on 8.x, under FLASHMLA_SPARSE.

What is vLLM's and what is mla_ext's:
* The backend class states what it serves: MLA, sparse; bf16 / fp16 (and fp32) models; kv caches
  "auto" (the model dtype), "bfloat16" and "fp8_ds_mla" (656-byte rows); block sizes that are
  multiples of 64 (the indexer's); head size 576 (512 latent + 64 rope) or 512 (NoPE); any
  compute capability from 8.0.
* The builder is vLLM's SparseMLACommonMetadataBuilder (metadata, decode/prefill split,
  prefill chunk plans); graph capture is declared UNIFORM_BATCH (below).
* The impl is vLLM's SparseMLACommonImpl: its forward_mqa turns the indexer's request-local
  top-k into physical cache slots (vLLM's own Triton conversion) and calls the kernel hook `_forward_mqa_kernel`, which here is mla_ext's
  `sparse_latent_attention_slots` (Triton on the GPU, every cache format decoded in the
  loader, software e4m3 below sm_89). Dense-MHA prefill (prefill no longer than index_topk)
  stays vLLM's (its MLA prefill backend).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionLayer, MultipleOf
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
from vllm.v1.kv_cache_interface import AttentionSpec

from mla_ext.config.formats import DsMla
from mla_ext.sparse.slot_attention import sparse_latent_attention_slots

BACKEND_NAME = "MLA_EXT_SPARSE"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
HEAD_SIZES = (576, 512)  # L + R: DeepSeek-V3.2 / GLM-5 (512 + 64); NoPE models (512 + 0)
BLOCK_MULTIPLE = 64  # the indexer's cache insists on 64-token blocks


class MlaExtSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # "fp8" / "fp8_e4m3" are accepted at selection and served as fp8_ds_mla (the plugin's route of
    # vLLM's _canonicalize_sparse_mla_kv_cache_dtype, as vLLM does for FLASHMLA_SPARSE).
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [*KV_CACHE_DTYPES, "fp8", "fp8_e4m3"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        # The kernel reads the cache as flat rows (vLLM's physical slots): blocks whole rows apart.
        return align_blocks_to_rows(spec)

    @staticmethod
    def get_name() -> str:
        # Not an AttentionBackendEnum member name: vLLM looks MLA backends up by class path
        # (registry), and compares get_name() only against its own backends' names.
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type["MlaExtSparseMLAMetadataBuilder"]:
        return MlaExtSparseMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["MlaExtSparseMLAImpl"]:
        return MlaExtSparseMLAImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major >= 8  # Triton's mma.sync; fp8 decoded in software below 8.9

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """The cache one layer holds (vLLM 0.33 sizes it from the spec; kept for older callers)."""
        if cache_dtype_str == "fp8_ds_mla":
            return (num_blocks, block_size, DsMla.ENTRY_BYTES)
        return (num_blocks, block_size, head_size)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: CacheDType | None,
                             block_size: int | None, use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool, device_capability: DeviceCapability) -> str | None:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is None or config.model_config is None:
            return None
        if config.parallel_config.decode_context_parallel_size > 1:
            return f"{BACKEND_NAME} does not support decode context parallelism"
        hf = config.model_config.hf_text_config
        if not hasattr(hf, "index_topk"):
            return f"{BACKEND_NAME} needs a DSA model (index_topk in its config)"
        L, R = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
        if L != DsMla.LATENT_DIM or R not in (DsMla.ROPE_DIM, 0) or head_size != L + R:
            return (f"{BACKEND_NAME} serves kv_lora_rank 512 with qk_rope_head_dim 64 or 0 (head size 576 / 512); "
                    f"got kv_lora_rank={L}, qk_rope_head_dim={R}, head_size={head_size}")
        return None


@dataclass
class MlaExtSparseMLAMetadata(SparseMLACommonMetadata):
    pass


class MlaExtSparseMLAMetadataBuilder(SparseMLACommonMetadataBuilder[MlaExtSparseMLAMetadata]):
    """vLLM's sparse MLA builder. UNIFORM_BATCH: a uniform decode batch (every request the same
    query length, speculative tokens included) is captured in a CUDA graph and replayed. What
    a capture records is safe to replay: the kernel's launches (grid, split-K count, tiles)
    depend only on host shapes (tokens, heads, top-k width) and the device, it never
    synchronises with the host, and everything it reads (the top-k buffer, req_id_per_token,
    block table, cache) is a persistent buffer vLLM refills in place. Mixed and prefill batches
    run eagerly (their prefill side plans chunks on the host)."""

    metadata_cls = MlaExtSparseMLAMetadata
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Any token may take the sparse MQA path (its top-k is causal already): decode and
        # speculative-decode tokens do.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)


class MlaExtSparseMLAImpl(SparseMLACommonImpl[MlaExtSparseMLAMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None,
                 topk_indices_buffer: torch.Tensor | None = None, indexer: Any | None = None,
                 **mla_args: Any) -> None:
        # DSA attention has none of these; vLLM's selector never builds this impl with them, so a
        # value here is a caller's mistake, named.
        for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                            ("logits_soft_cap", logits_soft_cap)):
            if value:
                raise ValueError(f"{name}: {BACKEND_NAME} (DSA sparse MLA) takes none, got {value!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {BACKEND_NAME} expects one of {KV_CACHE_DTYPES} (vLLM's layer passes "
                             f"'fp8' / 'fp8_e4m3' as 'fp8_ds_mla' through mla_ext's plugin), got {kv_cache_dtype!r}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, indexer=indexer,
                         topk_indices_buffer=topk_indices_buffer, **mla_args)
        # Queries stay in the model dtype: the kernel decodes the fp8 cache, it takes no fp8 query.
        self.supports_quant_query_input = False

    def _forward_mqa_kernel(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                            topk_indices: torch.Tensor, valid_counts: torch.Tensor, *, layer: AttentionLayer,
                            block_size: int, is_decode: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [T, H, 512], lse [T, H] natural log): every token attends its physical top-k
        slots (-1 padded, causal already) straight from the paged cache."""
        if isinstance(q, tuple):
            ql_nope, q_pe = q
        else:
            ql_nope, q_pe = q[..., :self.kv_lora_rank], q[..., self.kv_lora_rank:]
        return sparse_latent_attention_slots(ql_nope, q_pe, kv_cache, self.kv_cache_dtype, topk_indices, self.scale,
                                             k_scale=getattr(layer, "_k_scale", None))
