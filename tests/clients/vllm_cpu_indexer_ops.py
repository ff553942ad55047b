"""Runs vLLM 0.33's own DSA indexer (``sparse_attn_indexer`` in
vllm/model_executor/layers/sparse_attn_indexer.py, its CUDA path) on the CPU with mla_ext's ops, on a
platform stating compute capability 8.6, for one mixed batch (decode requests first, then prefill
requests with and without context), and prints JSON: the top-k rows vLLM wrote and the oracle's.

Run in a subprocess by tests/clients/test_vllm_cpu_indexer_ops.py with vLLM's client tree on
PYTHONPATH. What is vLLM's: the plugin loader (load_general_plugins -> mla_ext's register(), which
routes DeepGEMM's fp8_fp4_mqa_logits / fp8_fp4_paged_mqa_logits, has_deep_gemm and
get_paged_mqa_logits_metadata, vLLM's fused_indexer_q_rope_quant and the _C ops
indexer_k_quant_and_cache / cp_gather_indexer_k_quant_cache / top_k_per_row_prefill /
top_k_per_row_decode to mla_ext at capability 8.x), and all of sparse_attn_indexer: the cache write,
the prefill chunk's raw gather, compressed logits and prefill top-k, the decode paged logits and its
top-k dispatcher (SparseIndexerTopk, "auto": per_row off CUDA), the -1 pre-fill of the buffer.

Plumbing stand-ins (no math):
* the platform: vLLM's UnspecifiedPlatform with tensors on the CPU, dispatch key CPU, stating
  capability 8.6 (so the plugin routes what an A10/A6000 lacks);
* the forward context: a ForwardContext built directly (attn_metadata = {indexer prefix: metadata},
  cudagraph mode NONE), installed with vLLM's override_forward_context;
* the workspace manager: vLLM's own, initialised for the CPU device (init_workspace_manager);
* the indexer metadata: vLLM's dataclasses (DeepseekV32IndexerMetadata, its prefill chunk and
  decode parts) filled by hand with the values its builder computes for this batch (ks = the
  request's start in the gathered keys, ke = ks + causal length; decode seq_lens [B, 1]), since the
  builder needs a full VllmConfig and a GPU's SM count;
* the context keys of earlier steps: written into the index cache with the same routed writer
  before the call (vLLM writes them in earlier forward passes).
The q comes from the routed fused_indexer_q_rope_quant (vLLM's deepseek_v2 indexer's call).
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_PLUGINS", "mla_ext")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stated_platform import install_stated_platform  # noqa: E402

install_stated_platform("8.6")

from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()

import vllm._custom_ops as vllm_ops  # noqa: E402
from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.model_executor.layers import sparse_attn_indexer as SAI  # noqa: E402
from vllm.model_executor.models import deepseek_v2  # noqa: E402
from vllm.utils.torch_utils import _encode_layer_name  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import (  # noqa: E402
    DeepseekV32IndexerMetadata, DeepseekV32IndexerPrefillChunkMetadata, DeepseekV32IndexerPrefillMetadata,
    DeepSeekV32IndexerDecodeMetadata)
from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized  # noqa: E402

from mla_ext.sparse.reference import indexer_scores_reference, select_reference  # noqa: E402
from mla_ext.vllm import sparse_plugin  # noqa: E402

H, D, R, BS, TOPK, MAX_LEN = 8, 128, 64, 16, 16, 128
PREFIX = "model.layers.0.self_attn.indexer.k_cache"
DECODE_CTX, PREFILL_CTX, PREFILL_Q = [30, 45], [0, 20], [6, 9]


def main() -> None:
    g = torch.Generator().manual_seed(0)
    ctx_lens = DECODE_CTX + PREFILL_CTX
    q_lens = [1] * len(DECODE_CTX) + PREFILL_Q
    totals = [c + n for c, n in zip(ctx_lens, q_lens)]
    nreq, T = len(totals), sum(q_lens)
    max_blocks = -(-max(totals) // BS)
    nb = nreq * max_blocks + 3
    bt = torch.randperm(nb, generator=g)[: nreq * max_blocks].view(nreq, max_blocks).to(torch.int32)
    cache = torch.zeros(nb, BS, D + 4, dtype=torch.uint8)
    keys = [torch.randn(t, D, generator=g).to(torch.bfloat16) for t in totals]

    def slots(r, pos):
        return bt[r, pos // BS].to(torch.int64) * BS + pos % BS

    for r, c in enumerate(ctx_lens):  # earlier steps' keys (vLLM wrote them in earlier forwards)
        if c:
            vllm_ops.indexer_k_quant_and_cache(keys[r][:c], cache, slots(r, torch.arange(c)), D, "ue8m0")
    positions = torch.cat([c + torch.arange(n) for c, n in zip(ctx_lens, q_lens)])
    slot_mapping = torch.cat([slots(r, c + torch.arange(n)) for r, (c, n) in enumerate(zip(ctx_lens, q_lens))])
    k_new = torch.cat([keys[r][c:] for r, c in enumerate(ctx_lens)])

    # the indexer q as deepseek_v2's indexer makes it (the routed fused_indexer_q_rope_quant)
    q = (torch.randn(T, H, D, generator=g) * 2).to(torch.bfloat16)
    cos_sin = torch.randn(MAX_LEN, R, generator=g)
    q_fp8, weights = deepseek_v2.fused_indexer_q_rope_quant(
        positions, q, cos_sin, torch.randn(T, H, generator=g).to(torch.bfloat16), D ** -0.5, H ** -0.5, False)

    nd = len(DECODE_CTX)
    cu = [0]
    for t in totals[nd:]:
        cu.append(cu[-1] + t)
    ks = torch.cat([torch.full((n,), cu[i], dtype=torch.int32) for i, n in enumerate(PREFILL_Q)])
    ke = torch.cat([cu[i] + c + torch.arange(1, n + 1, dtype=torch.int32)
                    for i, (c, n) in enumerate(zip(PREFILL_CTX, PREFILL_Q))]).to(torch.int32)
    chunk = DeepseekV32IndexerPrefillChunkMetadata(
        block_table=bt[nd:], cu_seqlen_ks=ks, cu_seqlen_ke=ke, cu_seq_lens=torch.tensor(cu, dtype=torch.int32),
        token_to_seq=torch.repeat_interleave(torch.arange(len(PREFILL_Q)), torch.tensor(PREFILL_Q)).to(torch.int32),
        total_seq_lens=cu[-1], max_seqlen_k=int((ke - ks).max()), token_start=nd, token_end=T,
        num_reqs=len(PREFILL_Q), local_cu_seq_lens=torch.tensor(cu, dtype=torch.int32),
        local_total_seq_lens=cu[-1], max_local_total_seq_lens=cu[-1])
    decode = DeepSeekV32IndexerDecodeMetadata(
        block_table=bt[:nd], seq_lens=torch.tensor([[c + 1] for c in DECODE_CTX], dtype=torch.int32),
        decode_lens=torch.ones(nd, dtype=torch.int32), requires_padding=False,
        schedule_metadata=torch.zeros(9, 2, dtype=torch.int32))
    meta = DeepseekV32IndexerMetadata(
        seq_lens=torch.tensor(totals, dtype=torch.int32), max_seq_len=max(totals), slot_mapping=slot_mapping,
        num_decodes=nd, num_decode_tokens=nd, num_prefills=len(PREFILL_Q), num_prefill_tokens=T - nd,
        decode=decode, prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]))

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    buf = torch.full((T + 4, TOPK), 0x7EEE, dtype=torch.int32)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={PREFIX: meta}, slot_mapping={})
    with override_forward_context(ctx):
        SAI.sparse_attn_indexer(
            torch.zeros(T, 16), _encode_layer_name(PREFIX), cache, q_fp8, None, k_new, weights, D, "ue8m0", TOPK,
            D, MAX_LEN, 256, buf, False, False, False, _encode_layer_name(""))

    # the oracle on the operands vLLM's ops saw: the dequantized cache rows, the e4m3 q, the weights
    dq = []
    for r, t in enumerate(totals):
        kq = torch.empty(t, D, dtype=torch.uint8)
        sc = torch.empty(t, 4, dtype=torch.uint8)
        vllm_ops.cp_gather_indexer_k_quant_cache(cache, kq, sc, bt[r:r + 1], torch.tensor([0, t], dtype=torch.int32))
        dq.append(kq.view(torch.float8_e4m3fn).float() * sc.view(torch.float32))
    want = select_reference(q_fp8.float(), dq, weights, q_lens, ctx_lens, TOPK)
    scores = [row.tolist() for s in indexer_scores_reference(q_fp8.float(), dq, weights, q_lens, ctx_lens)
              for row in s]
    print(json.dumps({
        "got": buf[:T].tolist(), "untouched_tail": bool((buf[T:] == 0x7EEE).all()), "want": want.tolist(),
        "scores": scores, "routed": sorted(sparse_plugin.routed()),
        "mqa_logits": f"{SAI.fp8_fp4_mqa_logits.__module__}.{SAI.fp8_fp4_mqa_logits.__name__}",
    }))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
