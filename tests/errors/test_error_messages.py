"""Errors that were vague, now naming the argument as the caller
wrote it: explain_context given a string, a transformers module whose
kv_lora_rank attribute disagrees with its config, vLLM's concat / gather with
scale=None, and vLLM merge errors that named the native arguments (o1, o2, out)."""
from __future__ import annotations

import pytest
import torch

from mla_ext.cache import api as cache_api
from mla_ext.kv_b_proj import weights as W
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from mla_ext.vllm import _custom_ops as ops
from helpers.prefill import BLOCK, TINY


def test_explain_context_refuses_what_is_not_metadata():
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L) / 32
    layer = MLAPrefill(TINY, CacheConfig("auto", block_size=BLOCK), W.DenseWeight.from_dense(w, torch.bfloat16),
                       layer=0)
    for bad in ("meta", None, 3):
        with pytest.raises(ValueError, match=r"metadata: expected a PrefillMetadata \(explain_context"):
            layer.explain_context(bad)


def test_a_module_whose_kv_lora_rank_disagrees_with_its_config_is_refused():
    pytest.importorskip("transformers")
    from mla_ext.integrations import transformers_deepseek as tx

    module = tx.random_attention("v3", dtype=torch.float32, hidden_size=64, num_heads=2, kv_lora_rank=64,
                                 qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    module.kv_lora_rank = 48
    with pytest.raises(ValueError, match="module.kv_lora_rank=48 but its config says kv_lora_rank=64"):
        tx.TransformersMLA(module, CacheConfig("auto", block_size=BLOCK))


def _write_args():
    kv_c, k_pe = torch.randn(2, 512, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.bfloat16)
    return kv_c, k_pe, torch.zeros(4, 16, 656, dtype=torch.uint8), torch.tensor([0, 1])


@pytest.mark.parametrize("skip_scale", [False, True])
def test_vllm_concat_with_scale_none_names_scale(skip_scale):
    with pytest.raises(ValueError, match=r"scale: expected a float32 tensor \[1\] \(kv_cache_dtype 'fp8_ds_mla'"):
        ops.concat_and_cache_mla(*_write_args(), "fp8_ds_mla", None, skip_scale)
    # The native API names its own argument.
    with pytest.raises(ValueError, match=r"k_scale: expected a float32 tensor \[1\] \(the op takes one even"):
        cache_api.concat_and_cache_mla(*_write_args(), "fp8_ds_mla", None)


def test_vllm_gather_with_scale_none_names_scale():
    cache = torch.zeros(4, 16, 656, dtype=torch.uint8)
    dst = torch.empty(8, 576, dtype=torch.bfloat16)
    bt, cu = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="scale: expected a float32 tensor"):
        ops.gather_and_maybe_dequant_cache(cache, dst, bt, cu, torch.zeros(8, dtype=torch.int32), 8, "fp8_ds_mla",
                                           None)


def _merge_args(T=5, N=2, D=8):
    return dict(output=torch.empty(T, N, D), prefix_output=torch.randn(T, N, D), prefix_lse=torch.randn(N, T),
                suffix_output=torch.randn(T, N, D), suffix_lse=torch.randn(N, T), output_lse=torch.empty(N, T))


@pytest.mark.parametrize("name", ["output", "prefix_output", "suffix_output"])
@pytest.mark.parametrize("fp8_out", [False, True])
def test_vllm_merge_errors_name_vllms_arguments(name, fp8_out):
    a = _merge_args()
    if fp8_out:
        a.update(output=torch.empty(5, 2, 8, dtype=torch.float8_e4m3fn), output_scale=torch.tensor([1.0]))
    a[name] = torch.randn(5, 2, 16, dtype=a[name].dtype if a[name].dtype != torch.float8_e4m3fn
                          else torch.float32).to(a[name].dtype)[..., ::2]
    if fp8_out and name == "output":
        ops.merge_attn_states(**a)  # a float8 output is written by a copy: any strides
        return
    with pytest.raises(ValueError, match=rf"^{name}: the head dim must be contiguous"):
        ops.merge_attn_states(**a)
