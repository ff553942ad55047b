"""Adapters that build mla_ext layers from other libraries' model code.

- `mla_ext.integrations.transformers_deepseek`: Hugging Face transformers'
  DeepseekV2Attention / DeepseekV3Attention modules (imports transformers lazily).
"""
