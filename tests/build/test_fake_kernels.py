"""torch.compile support: every tensor op of csrc/registration.cpp has a fake kernel
(mla_ext/_fake.py) that agrees with the real one, proven by
`torch.library.opcheck` (schema, fake tensor, autograd registration, AOT
dispatch) on small CPU inputs. A new op without a case here fails
`test_every_op_has_a_case`, so a missing fake kernel cannot slip in.
"""
from __future__ import annotations

import pytest
import torch

from mla_ext import _ext

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

# Ops that take no tensors: torch.compile never traces them through fake tensors.
NO_TENSOR_OPS = {"format_info", "ds_mla_layout", "build_info", "index_cache_format_info"}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cache_case():
    g = _gen(1)
    L, R, B, nb = 32, 16, 4, 3
    kv_c = torch.randn(5, L, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(5, R, generator=g).to(torch.bfloat16)
    cache = torch.full((nb, B, L + R), 0xFF, dtype=torch.uint8)
    slots = torch.tensor([0, 1, 5, 9, -1], dtype=torch.int64)
    scale = torch.tensor([0.05], dtype=torch.float32)
    return kv_c, k_pe, cache, slots, scale


def _gather_case():
    kv_c, k_pe, cache, slots, scale = _cache_case()
    ops = _ext.ops()
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", scale)
    bt = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    starts = torch.tensor([1, 0], dtype=torch.int32)
    return cache, bt, cu, starts, scale


def _case_concat_and_cache_mla():
    kv_c, k_pe, cache, slots, scale = _cache_case()
    return (kv_c, k_pe, cache, slots, "fp8", scale)


def _case_gather_and_maybe_dequant_cache():
    cache, bt, cu, starts, scale = _gather_case()
    dst = torch.full((5, cache.size(2)), float("nan"), dtype=torch.bfloat16)
    return (cache, dst, bt, cu, 2, "fp8", scale, starts)


def _case_cp_gather_cache():
    cache, bt, cu, starts, _ = _gather_case()
    dst = torch.full((5, cache.size(2)), 0xAB, dtype=torch.uint8)
    return (cache, dst, bt, cu, 2, starts)


def _case_compute_kv_scale():
    kv_c, k_pe, *_ = _cache_case()
    return (kv_c, k_pe, "fp8")


def _marlin_weight():
    g = _gen(2)
    w = (torch.randn(70, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    s = torch.rand(70, generator=g) + 0.5
    return w, s


def _case_marlin_fp8_repack():
    w, s = _marlin_weight()
    return (w, s, -1, torch.bfloat16)


def _packed():
    w, s = _marlin_weight()
    return _ext.ops().marlin_fp8_repack(w, s, -1, torch.bfloat16)


def _case_marlin_fp8_dequantize():
    q, s = _packed()
    return (q, s, 70, 128, -1, torch.bfloat16)


def _case_marlin_fp8_gemm():
    q, s = _packed()
    a = torch.randn(3, 128, generator=_gen(3)).to(torch.bfloat16)
    return (a, q, s, 70, 128, -1, torch.bfloat16, torch.float32)


def _case_merge_attn_states():
    g = _gen(4)
    T, N, D = 3, 2, 8
    o1, o2 = (torch.randn(T, N, D, generator=g) for _ in range(2))
    l1, l2 = (torch.randn(N, T, generator=g) for _ in range(2))
    out = torch.full((T, N, D), float("nan"))
    out_lse = torch.full((N, T), float("nan"))
    return (out, out_lse, o1, l1, o2, l2)


def _index_cache():
    from mla_ext.sparse.index_cache import get_index_format

    return get_index_format("fp8").empty(2, 4, 32, 16).fill_(0x3C)


def _case_index_cache_write():
    k = torch.randn(3, 32, generator=_gen(5)).to(torch.bfloat16)
    return (k, _index_cache(), torch.tensor([0, 5, -1]), "fp8", 16, "ue8m0")


def _case_index_cache_gather():
    bt, cu = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    return (_index_cache(), torch.full((6, 32), float("nan")), bt, cu, "fp8", 32)


CASES = {
    name.removeprefix("_case_"): fn for name, fn in globals().items() if name.startswith("_case_")
}


def _registered_ops() -> set[str]:
    return {
        s.name.removeprefix("mla_ext::") for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("mla_ext::")
    }


def test_every_op_has_a_case():
    ops = _registered_ops()
    assert ops, "no mla_ext ops registered"
    missing = ops - NO_TENSOR_OPS - set(CASES)
    assert not missing, f"ops without an opcheck case (add one and a fake kernel): {sorted(missing)}"


# opcheck's schema test re-runs the op under a mode that compares inputs with
# arithmetic CPU torch lacks for float8 ("mul_cpu_reduced_float" not implemented
# for Float8_e4m3fn); the op is still checked for fake tensors, autograd
# registration and AOT dispatch.
NO_SCHEMA_TEST = {"marlin_fp8_repack"}


@pytest.mark.parametrize("op_name", sorted(CASES))
def test_opcheck(op_name):
    op = getattr(_ext.ops(), op_name)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    if op_name not in NO_SCHEMA_TEST:
        utils = ("test_schema",) + utils
    torch.library.opcheck(op, CASES[op_name](), test_utils=utils)


@pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")
@pytest.mark.parametrize("op_name", sorted(CASES) if _ext.available() else [])
def test_meta_tensor_mixed_with_cpu_tensors_is_an_error(op_name):
    """Any one tensor argument on `meta`: the dispatcher picks the fake kernel,
    which must refuse instead of returning an uncomputed meta result."""
    args = CASES[op_name]()
    op = getattr(torch.ops.mla_ext, op_name)
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i in tensor_pos:
        mixed = list(args)
        mixed[i] = torch.empty_like(args[i], device="meta")
        with pytest.raises(ValueError, match="meta"):
            op(*mixed)
