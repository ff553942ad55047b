"""Prefill stage: one MLA layer's prefill-with-context pass, one room per job.

layer.py             MLAPrefill: the layer (resolved once from its spec), forward, explain
metadata.py          PrefillMetadata (per batch: chunk plans, device copies, resolved backends)
                     and ContextParallel (the group a layer runs under)
context_parallel.py  the context-parallel row exchange (local lengths, all-gather, reorder)
chunking.py          the context chunk planner in a bounded workspace (SPEC §8)
context.py           which path each context chunk takes (absorbed or up-projected)
context_cost.py      the cost model behind that choice (rates per device)
sparse.py            the sparse (DSA) glue: indexer -> top-k -> sparse latent attention
reference.py         the float32 oracle of the whole pass
synthetic.py, timing.py  synthetic batches and the step clock (demo, benchmarks)
"""
from mla_ext.prefill.chunking import (  # noqa: F401
    ChunkPlan,
    ChunkTensors,
    ContextChunk,
    plan_context_chunks,
    plan_from_config,
    workspace_alignment,
    workspace_rows,
)
