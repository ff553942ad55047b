"""Prefill stage: the context chunk planner (SPEC §8); the MLA layer that
runs the whole prefill-with-context pass builds on it."""
from mla_ext.prefill.chunking import (  # noqa: F401
    ChunkPlan,
    ChunkTensors,
    ContextChunk,
    plan_context_chunks,
    plan_from_config,
    workspace_alignment,
    workspace_rows,
)
