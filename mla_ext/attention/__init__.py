"""Attention stage (SPEC §7): varlen attention with LSE for MLA shapes and
merging of partial results. See api.py for the contract of each op."""
from mla_ext.attention.api import (  # noqa: F401
    ATTENTION,
    MERGE,
    backend_report,
    merge_attn_states,
    varlen_attention,
)
from mla_ext.attention.scratch import AttentionScratch  # noqa: F401
