"""One index-cache check (mla_ext.sparse.index_cache.check_index_cache) serves the format level
(the indexer, the gathers) and the layer's plan (mla_ext.prefill.sparse.check_index_cache): every
refusal gives the same message, naming the argument, through each entry point."""
import pytest
import torch

from mla_ext.prefill import sparse as layer_sparse
from mla_ext.sparse import index_cache as ic
from mla_ext.sparse.topk import indexer_topk

D, BLOCK, NB = 16, 16, 4
CFG = layer_sparse.SparseConfig(8, 2, D, index_cache_dtype="float32")
KV = torch.empty(NB, BLOCK, 576, dtype=torch.bfloat16)  # the layer's latent cache (only its blocks and device)
F32 = ic.get_index_format("float32")
BAD = {
    "not_a_tensor": ([[0.0] * D], r"expected a paged index cache tensor"),
    "dtype": (ic.get_index_format("bfloat16").empty(NB, BLOCK, D), r"expected a 3-D torch.float32 tensor"),
    "width": (F32.empty(NB, BLOCK, D + 4), rf"rows of {D + 4} torch.float32 elements, expected {D}"),
    "page_size": (F32.empty(NB, BLOCK // 2, D), r"pages of 8 tokens, but the latent cache's block_size is 16"),
    "blocks": (F32.empty(NB - 1, BLOCK, D), r"3 blocks, fewer than the latent cache's 4"),
}


def _message(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("entry", ["format_level", "layer_plan"])
@pytest.mark.parametrize("what", sorted(BAD))
def test_each_refusal_is_the_same_through_each_entry_point(what, entry):
    cache, match = BAD[what]
    direct = _message(lambda: ic.check_index_cache(cache, "float32", D, BLOCK, arg="index_cache", kv_cache=KV))
    assert direct.startswith("index_cache: ")
    if entry == "layer_plan":
        got = _message(lambda: layer_sparse.check_index_cache(CFG, cache, BLOCK, KV))
        assert got == direct
    else:
        got = direct
    assert __import__("re").search(match, got), got


@pytest.mark.parametrize("what", ["dtype", "width"])
def test_the_indexer_refuses_with_the_same_message(what):
    cache, _ = BAD[what]
    g = torch.Generator().manual_seed(0)
    q, w, k = torch.randn(2, 2, D, generator=g), torch.rand(2, 2, generator=g), torch.randn(2, D, generator=g)
    table = torch.zeros(1, 2, dtype=torch.int32)
    got = _message(lambda: indexer_topk(q, w, k, cache, table, [2], [5], 4, index_cache_dtype="float32"))
    assert got == _message(lambda: ic.check_index_cache(cache, "float32", D))
