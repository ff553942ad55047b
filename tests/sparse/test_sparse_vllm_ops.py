"""vLLM 0.33's indexer-cache op names on the mla_ext_vllm surface (mla_ext/vllm/_indexer_ops.py)."""
import pytest
import torch

from mla_ext.sparse import index_cache as ic
from mla_ext.vllm import _custom_ops as ops

SIGS = {
    "indexer_k_quant_and_cache": (["k", "kv_cache", "slot_mapping", "quant_block_size", "kv_cache_dtype"],
                                  {"kv_cache"}),
    "cp_gather_indexer_k_quant_cache": (["kv_cache", "dst_k", "dst_scale", "block_table", "cu_seq_lens"],
                                        {"dst_k", "dst_scale"}),
}


@pytest.mark.parametrize("name", sorted(SIGS))
def test_signature_is_vllms(name):
    schema = getattr(torch.ops.mla_ext_vllm, name).default._schema
    assert [a.name for a in schema.arguments] == SIGS[name][0] and not schema.returns
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == SIGS[name][1]


@pytest.mark.parametrize("scale_fmt", ["", "ue8m0"])
def test_write_then_raw_gather(scale_fmt):
    D, B, Q = 32, 4, 32
    cache = torch.zeros(3, B, D + 4, dtype=torch.uint8)
    k = torch.randn(6, D)
    slots = torch.tensor([9, 0, 5, 1, -1], dtype=torch.int64)  # k padded past the slots; -1 skipped
    ops.indexer_k_quant_and_cache(k, cache, slots, Q, scale_fmt)
    want = torch.zeros_like(cache)
    ic.write_index_cache(k[:5], want, slots, "fp8", quant_block_size=Q, scale_fmt=scale_fmt or None)
    assert torch.equal(cache, want)
    dst_k = torch.full((4, D), 0xEE, dtype=torch.uint8)
    dst_s = torch.full((4, 4), 0xEE, dtype=torch.uint8)
    # request 0: tokens 0, 1 in block 0 (slots 0, 1: k[1], k[3]); request 1: tokens 0, 1 in block 1
    # (slot 4 never written, slot 5: k[2])
    ops.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_s, torch.tensor([[0, 2], [1, 0]], dtype=torch.int32),
                                        torch.tensor([0, 2, 4], dtype=torch.int32))
    v, s = ic.quantize_fp8_rows(k[[1, 3, 2]], Q, scale_fmt or None)
    assert torch.equal(dst_k[[0, 1, 3]], v) and torch.equal(dst_s.view(torch.float32)[[0, 1, 3], 0], s[:, 0])
    assert dst_k[2].eq(0).all() and dst_s[2].eq(0).all()
    torch.library.opcheck(ops.indexer_k_quant_and_cache, (k, cache.clone(), slots, Q, scale_fmt))


def test_refusals_name_the_argument():
    k, cache = torch.randn(2, 32), torch.zeros(2, 4, 36, dtype=torch.uint8)
    with pytest.raises(ValueError, match="quant_block_size"):
        ops.indexer_k_quant_and_cache(k, cache, torch.tensor([0, 1]), 5, "")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ops.indexer_k_quant_and_cache(k, cache, torch.tensor([0, 1]), 32, "mxfp8")
    with pytest.raises(ValueError, match="kv_cache"):
        ops.indexer_k_quant_and_cache(k, cache.float(), torch.tensor([0, 1]), 32, "")
    with pytest.raises(ValueError, match="dst_scale"):
        ops.cp_gather_indexer_k_quant_cache(cache, torch.empty(2, 32, dtype=torch.uint8),
                                            torch.empty(2, 8, dtype=torch.uint8),
                                            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
