"""The cases tests/clients/vllm_forward_mha.py runs through vLLM's forward_mha
(no vLLM import here: the test module reads them to parametrize)."""
import torch

# The formats vLLM's dense forward_mha has a branch for: "auto" (model dtype),
# fp8 per tensor (e4m3, e5m2) through gather_and_maybe_dequant_cache, fp8_ds_mla
# through cp_gather_and_upconvert_fp8_kv_cache; and nvfp4_ds_mla, which vLLM
# serves on SM100 sparse layers only: on this path it reaches
# gather_and_maybe_dequant_cache(kv_cache_dtype="nvfp4_ds_mla"), which only
# mla_ext's routed op decodes.
FORMATS = ("auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla")
# (format, model dtype): every format in bf16 (the ds_mla formats' rows are
# bf16), and the native and per-tensor caches of fp32 / fp16 models.
CASES = tuple((f, torch.bfloat16) for f in FORMATS) + (
    ("auto", torch.float32), ("auto", torch.float16), ("fp8", torch.float16))
# (format, model dtype, MLA_EXT_VLLM_CONTEXT): vLLM's own up-projecting chunk loop
# for every case above, and mla_ext's latent-space context attention in its place
# (absorbed for every format; the cost model's choice once).
CONTEXT_CASES = tuple((f, d, "vllm") for f, d in CASES) + tuple(
    (f, torch.bfloat16, "absorbed") for f in FORMATS) + (
    ("auto", torch.float32, "absorbed"), ("fp8_ds_mla", torch.bfloat16, "auto"))

# (name, context lengths, new-token lengths, workspace rows): workspace rows
# decide how vLLM's planner cuts the contexts into chunks.
BATCHES = (
    ("one_chunk", [40, 23, 9], [3, 2, 4], 512),
    ("split_requests", [70, 45, 33], [2, 3, 1], 48),  # a request split over chunks: continuations
    ("empty_contexts", [0, 52, 0, 17], [2, 3, 1, 2], 32),
    ("many_chunks", [150, 1, 96], [4, 1, 2], 16),
    ("no_context", [0, 0], [3, 5], 64),
    # Many new tokens per request: past the cost model's absorbed/up-project
    # crossover for these dims (FLOP count alone: L(P+V)/(2L-P-V) = 34 tokens).
    ("long_queries", [40, 20], [90, 70], 64),
)
