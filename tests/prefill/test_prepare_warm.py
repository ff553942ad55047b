"""MLAPrefill.prepare / KvBProj.prepare warm every variant a layer will use (no compile
while serving): kv_b_proj once per row bucket up to the workspace rows, the writer (a padding
slot), the KV scale, the gathers and both context paths. The cache is only read.
On a GPU this compiles the Triton variants; here (CPU backends) it checks what runs."""
import math

import pytest
import torch

from mla_ext.kv_b_proj import linear
from mla_ext.kv_b_proj.linear import KvBProj, warm_rows
from mla_ext.config.policy import CacheConfig
from mla_ext.prefill.layer import MLAPrefill
from helpers.prefill import BLOCK, TINY, make_weight


def test_warm_rows_reach_every_power_of_two_bucket():
    assert warm_rows(1) == [1]
    assert warm_rows(20) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 20]
    rows = warm_rows(8192)
    for k in range(14):  # each bucket (2^(k-1), 2^k] has a row count in it
        assert any(2 ** (k - 1) < m <= 2 ** k for m in rows) or k == 0
    with pytest.raises(ValueError, match="max_rows"):
        warm_rows(0)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8"])
def test_layer_prepare_runs_each_path_and_leaves_the_cache(monkeypatch, fmt):
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=torch.Generator().manual_seed(0))
    layer = MLAPrefill(TINY, CacheConfig(kv_cache_dtype=fmt, block_size=BLOCK),
                       make_weight("dense", w / math.sqrt(TINY.L)), prefix="model.layers.1.self_attn",
                       workspace_rows_override=64, max_num_seqs=4)
    cache = torch.randint(0, 120, layer.spec.cache_shape(3), dtype=torch.uint8).view(layer.spec.storage_dtype)
    before = cache.clone()
    seen_m, modes = [], []
    real_forward, real_layer_forward = KvBProj.forward, MLAPrefill.forward
    monkeypatch.setattr(KvBProj, "forward", lambda self, x, **kw: (seen_m.append(x.shape[0]),
                                                                   real_forward(self, x, **kw))[1])
    monkeypatch.setattr(MLAPrefill, "forward", lambda self, *a, **kw: (modes.append(self.context_attention.mode),
                                                                       real_layer_forward(self, *a, **kw))[1])
    kept = layer.context_attention
    assert layer.prepare(cache, warm=True) is layer
    assert set(warm_rows(layer.workspace_rows)) <= set(seen_m)
    assert sorted(modes) == ["absorbed", "up_project"] and layer.context_attention is kept
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # nothing written


def test_prepare_without_warm_runs_nothing(monkeypatch):
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L)
    proj = KvBProj(make_weight("dense", w))
    monkeypatch.setattr(KvBProj, "forward", lambda *a, **k: pytest.fail("forward ran"))
    assert proj.prepare("cpu") is proj  # CPU: no compile to warm, so no default warm-up
    assert linear.warm_rows(4) == [1, 2, 3, 4]
