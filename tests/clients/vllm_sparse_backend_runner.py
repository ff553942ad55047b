"""Runs vLLM 0.33's own sparse MLA code with mla_ext's backend on a platform stating compute
capability 8.6 (tensors on the CPU) and prints one JSON line of results.

Run in a subprocess by tests/clients/test_vllm_sparse_backend.py with vLLM's client tree on
PYTHONPATH (and TRITON_INTERPRET=1 from the test session).

vLLM's own code: the plugin loader and registry (which class FLASHMLA_SPARSE resolves to on
8.6), AttentionBackend.validate_configuration, ModelConfig / VllmConfig of a tiny DeepSeek-V3.2
config (written to a temporary folder), the KV-cache spec, SparseMLACommonMetadataBuilder.build
for a mixed decode + prefill batch (with the MLA prefill backend vLLM picks, mla_ext's), and
SparseMLACommonImpl.forward_mqa (its top-k -> slot conversion, then the kernel hook).
Plumbing only, stated: the platform class (vLLM's UnspecifiedPlatform, CPU-typed, no pinned
memory, capability 8.6); the per-token request ids of CommonAttentionMetadata (vLLM makes them
with a Triton kernel, a placeholder where vLLM runs without Triton); a one-process gloo group for vLLM's TP state; the attention layer the
builder looks up in static_forward_context is a namespace holding only its prefill backend;
kv_b_proj is None (forward_mqa never touches it); the cache is written by mla_ext's writer;
no-op streams/events for the index group's side stream (stated_platform.install_cpu_streams);
CUDA_VISIBLE_DEVICES="" so vLLM keeps Triton, whose kernels run in the interpreter.
The expected output comes from mla_ext's float64 reference over slots computed here by plain
arithmetic from the block table.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import types

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_PLUGINS", "mla_ext")
os.environ.setdefault("TRITON_INTERPRET", "1")
# Stand-in: vLLM keeps real Triton (here its interpreter: the top-k -> slot conversion) only where the
# visible devices are set empty; otherwise, with no GPU driver, it swaps in its placeholder.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.numeric import rel_fro as rel  # noqa: E402
from stated_platform import install_cpu_streams, install_stated_platform  # noqa: E402

install_stated_platform("8.6")

# Plugins first, as in every vLLM process (before the model's modules are imported).
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()
install_cpu_streams()

import transformers  # noqa: E402
from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode  # noqa: E402

from mla_ext.cache import api as cache_api  # noqa: E402
from mla_ext.sparse.slot_attention import SPARSE_SLOTS  # noqa: E402
from mla_ext.sparse.reference import sparse_latent_attention_slots_reference  # noqa: E402
from mla_ext.vllm import plugin  # noqa: E402

CAPABILITY = DeviceCapability(8, 6)
H, P, V, L, R, B, TOPK = 4, 32, 32, 512, 64, 64, 128  # vLLM converts top-k in 128-wide tiles
LAYER = "model.layers.0.self_attn.attn"
# Mixed batch, decodes first as vLLM orders them: (context, new tokens) per request.
REQS = [(70, 1), (130, 1), (40, 5), (0, 3)]


def model_config(folder: str) -> ModelConfig:
    cfg = transformers.DeepseekV32Config(
        vocab_size=320, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=L, q_lora_rank=96, qk_nope_head_dim=P,
        qk_rope_head_dim=R, v_head_dim=V, max_position_embeddings=512, index_topk=TOPK, index_n_heads=4,
        index_head_dim=128, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1)
    cfg.save_pretrained(folder)
    return ModelConfig(model=folder, tokenizer=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256)


def batch(g: torch.Generator, num_blocks: int):
    """Block table, logical top-k [T, TOPK] (distinct causal positions, -1 padded) and the
    same as flat slots, computed here by arithmetic."""
    width = max(-(-(c + n) // B) for c, n in REQS) + 1
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(REQS), width), num_blocks + 7, dtype=torch.int32)  # junk past the used part
    at, topk, slots = 0, [], []
    for r, (c, n) in enumerate(REQS):
        k = -(-(c + n) // B)
        table[r, :k] = perm[at:at + k]
        at += k
        for i in range(n):
            pos = torch.randperm(c + i + 1, generator=g)[:TOPK]
            row = torch.full((TOPK,), -1, dtype=torch.int32)
            row[:len(pos)] = pos.to(torch.int32)
            topk.append(row)
            slots.append(torch.tensor([int(table[r, p // B]) * B + p % B if p >= 0 else -1 for p in row.tolist()],
                                      dtype=torch.int32))
    return table, torch.stack(topk), torch.stack(slots)


def run(cls, mc: ModelConfig, cache_dtype: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    config = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=B, cache_dtype=cache_dtype),
                        attention_config=AttentionConfig(mla_prefill_backend=plugin.BACKEND_NAME))
    out: dict = {"cache_dtype": cache_dtype}
    with set_current_vllm_config(config):
        common = dict(head_size=L + R, dtype=torch.bfloat16, kv_cache_dtype=cache_dtype, block_size=B, use_mla=True,
                      has_sink=False, use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
                      attn_type=AttentionType.DECODER)
        out["reasons_8_6"] = cls.validate_configuration(device_capability=CAPABILITY, **common)
        out["reasons_7_5"] = cls.validate_configuration(device_capability=DeviceCapability(7, 5), **common)
        out["reasons_dense"] = cls.validate_configuration(device_capability=CAPABILITY,
                                                          **dict(common, use_sparse=False))

        spec = cls.customize_spec(MLAAttentionSpec(
            block_size=B, num_kv_heads=1, head_size=L + R, dtype=torch.uint8 if cache_dtype == "fp8_ds_mla"
            else torch.bfloat16, cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype),
            state_content_bytes=656 if cache_dtype == "fp8_ds_mla" else None, topk_buffer_width=TOPK))
        prefill_backend = get_mla_prefill_backend(config)(
            num_heads=H, scale=(P + R) ** -0.5, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R,
            v_head_dim=V, vllm_config=config)
        config.compilation_config.static_forward_context[LAYER] = types.SimpleNamespace(
            prefill_backend=prefill_backend)
        builder = cls.get_builder_cls()(spec, [LAYER], config, torch.device("cpu"))

        num_blocks = sum(-(-(c + n) // B) for c, n in REQS) + 3
        table, topk, want_slots = batch(g, num_blocks)
        T = topk.shape[0]
        q_lens = [n for _, n in REQS]
        seq_lens = torch.tensor([c + n for c, n in REQS], dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        cam = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(REQS),
            num_actual_tokens=T, max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table, slot_mapping=torch.zeros(T, dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq_lens.clone(),
            # Plumbing: vLLM computes this with a Triton kernel, which is a placeholder on a
            # platform vLLM runs without Triton (its CPU tests); given here as vLLM's cache of it.
            _token_to_req_indices_cache=torch.repeat_interleave(
                torch.arange(len(REQS), dtype=torch.int32), torch.tensor(q_lens)))
        meta = builder.build(0, cam)
        out["builder"] = dict(cls=type(builder).__name__, metadata=type(meta).__name__,
                              cudagraph=builder._cudagraph_support.name, num_decodes=meta.num_decodes,
                              num_prefills=meta.num_prefills, num_decode_tokens=meta.num_decode_tokens,
                              has_prefill=meta.prefill is not None, topk_tokens=meta.topk_tokens,
                              block_size=meta.block_size, req_id_per_token=meta.req_id_per_token[:T].tolist())

        buffer = torch.full((64, TOPK), -1, dtype=torch.int32)
        buffer[:T] = topk

        def make_impl(**over):
            args = dict(num_heads=H, head_size=L + R, scale=(P + R) ** -0.5, num_kv_heads=1, alibi_slopes=None,
                        sliding_window=None, kv_cache_dtype=cache_dtype, logits_soft_cap=None,
                        attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, q_lora_rank=96,
                        kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, qk_head_dim=P + R, v_head_dim=V,
                        kv_b_proj=None, indexer=None, topk_indices_buffer=buffer)
            return cls.get_impl_cls()(**{**args, **over})

        impl = make_impl()
        refusals = {}
        for arg, value in (("sliding_window", 128), ("kv_cache_dtype", "fp8")):
            try:
                make_impl(**{arg: value})
                refusals[arg] = None
            except ValueError as exc:
                refusals[arg] = str(exc)

        width = 656 if cache_dtype == "fp8_ds_mla" else L + R
        cache = torch.full((num_blocks, B, width), 0x7F if cache_dtype == "fp8_ds_mla" else float("nan"),
                           dtype=torch.uint8 if cache_dtype == "fp8_ds_mla" else torch.bfloat16)
        used = sorted({int(s) for s in want_slots.flatten().tolist() if s >= 0})
        used_t = torch.tensor(used, dtype=torch.int64)
        kv = (torch.randn(len(used), L, generator=g) * 2).to(torch.bfloat16)
        pe = torch.randn(len(used), R, generator=g).to(torch.bfloat16)
        cache_api.concat_and_cache_mla(kv, pe, cache, used_t, cache_dtype, torch.tensor([1.0]))
        ql = (torch.randn(T, H, L, generator=g) * 0.05).to(torch.bfloat16)
        # q_pe as forward_impl hands it over: a slice of the [T, H, P + R] query (strided).
        qpe = torch.randn(T, H, P + R, generator=g).to(torch.bfloat16)[..., P:]

        got, lse = impl.forward_mqa((ql, qpe), cache, meta, types.SimpleNamespace(_k_scale=torch.tensor([1.0])))
        want, want_lse = sparse_latent_attention_slots_reference(ql, qpe, cache, cache_dtype, want_slots, impl.scale)
        with SPARSE_SLOTS.force("triton"):  # the Triton kernel under the interpreter
            got_triton, _ = impl.forward_mqa((ql, qpe), cache, meta, types.SimpleNamespace(_k_scale=None))
        slots_got, _ = impl._convert_logical_to_physical_topk(buffer[:T], meta, block_stride_rows=B,
                                                              return_valid_counts=True)
        out["impl"] = dict(cls=type(impl).__name__, shape=list(got.shape), dtype=str(got.dtype),
                           lse_shape=None if lse is None else list(lse.shape), all_written=bool(got.isfinite().all()),
                           rel=rel(got, want), rel_triton=rel(got_triton, want), lse_err=float((lse - want_lse).abs().max()) if lse is not None else None,
                           slots_equal=bool(torch.equal(slots_got, want_slots)),
                           quant_query=impl.supports_quant_query_input, refusals=refusals)
    return out


def main() -> None:
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"file://{tempfile.mkdtemp()}/dist",
                                                backend="gloo")
    with set_current_vllm_config(VllmConfig()):
        parallel_state.initialize_model_parallel(1, 1)
    cls = AttentionBackendEnum.FLASHMLA_SPARSE.get_class()
    custom = AttentionBackendEnum.CUSTOM.get_class()
    with tempfile.TemporaryDirectory() as folder:
        mc = model_config(folder)
        cases = [run(cls, mc, d, seed) for seed, d in enumerate(("auto", "fp8_ds_mla"))]
    print(json.dumps({"backend": f"{cls.__module__}.{cls.__qualname__}", "custom_is_same": custom is cls,
                      "name": cls.get_name(), "cases": cases}))


if __name__ == "__main__":
    sys.exit(main())
