"""Adapters that build mla_ext layers from other libraries' model code.

- `mla_ext.integrations.transformers_deepseek`: Hugging Face transformers' MLA
  attention modules of every family in mla_ext.config.families (DeepseekV2Attention,
  DeepseekV3Attention, ..., MistralLarge4TextAttention; imports transformers lazily),
  with `transformers_capture` (running a module's own forward up to its attention)
  and `transformers_random` (tiny random layers of each family, for tests).
"""
