"""The cases tests/clients/sglang_chunked_prefix.py runs through SGLang's DeepSeek
chunked-prefix prefill (no SGLang import here: the test module reads them to parametrize)."""

# SGLang's MLA pools on the chunked path: bf16 (the model dtype) at token
# granularity (page 1, SGLang's default) and fp8_e4m3 (plain cast, scale 1.0)
# with 16-token pages (the [pages, page_size, 576] view with page ids > 1 token).
POOLS = (("bfloat16", 1), ("float8_e4m3fn", 16))

# (name, prefix lengths, new-token lengths, chunk capacity): the capacity is
# SGLANG_MAX_KV_CHUNK_CAPACITY, which sets how SGLang cuts the prefixes
# (capacity // batch_size tokens per request and chunk) and mla_ext's workspace rows.
BATCHES = (
    ("one_chunk", [40, 23, 9], [3, 2, 4], 4096),
    ("long_and_short", [150, 2, 61], [2, 5, 1], 96),  # several chunks; a short prefix ends early
    ("empty_prefixes", [0, 52, 0, 17], [2, 3, 1, 2], 64),
    ("many_chunks", [120], [6], 16),  # 8 chunks of one request
)

# The DSA fp8 pool (64-token pages, 656-byte fp8_ds_mla rows), plugin only.
DSA_BATCHES = (
    ("dsa_two_chunks", [100, 30], [3, 2], 128),
)

# How the plugin attends the context chunks (MLA_EXT_SGLANG_CONTEXT): auto (mla_ext's
# cost model; on these few-query batches it picks the absorbed path), and up_project
# forced (gather, kv_b_proj, head-space attention), so both of mla_ext's paths run.
CONTEXT_MODES = ("auto", "up_project")

# SGLang's FP4 pool: not an mla_ext format; the plugin leaves it to SGLang's loop.
FP4_BATCH = ("fp4_left_to_sglang", [70, 12], [2, 3], 64)
