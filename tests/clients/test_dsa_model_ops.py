"""mla_ext's fused_norm_rope / fused_q (mla_ext/vllm/dsa_model_ops.py) against the pure fp32
reference (mla_ext/vllm/dsa_model_ops_reference.py) on the seeded cases of dsa_fused_cases.py
(outputs within one bf16 ulp / 8 fp32 ulps, cache and fp8 bytes within one e4m3 code, scales and
untouched slots exact), and their ValueErrors. No vLLM needed."""
from __future__ import annotations

import pytest
import torch

from clients import dsa_fused_cases as cases
from mla_ext.vllm.dsa_model_ops import fused_norm_rope, fused_q
from mla_ext.vllm.dsa_model_ops_reference import fused_norm_rope_ref, fused_q_ref


@pytest.mark.parametrize("name", list(cases.NORM_ROPE_CASES))
def test_fused_norm_rope_matches_reference(name):
    args, kwargs = cases.norm_rope_case(name)
    ret = fused_norm_rope(*args, **kwargs)
    rargs, rkwargs = cases.norm_rope_case(name)
    rret = fused_norm_rope_ref(*rargs, **rkwargs)
    cases.compare_norm_rope(name, ret, args, kwargs, {"ret": rret, "args": rargs, "kwargs": rkwargs}, exact=False)


@pytest.mark.parametrize("name", list(cases.Q_CASES))
def test_fused_q_matches_reference(name):
    args, kwargs = cases.q_case(name)
    cases.compare_q(args, kwargs, fused_q(*args, **kwargs), fused_q_ref(*cases.q_case(name)[0], **kwargs),
                    exact=False)


def _norm_rope_bad(**change):
    args, kwargs = cases.norm_rope_case("bf16-ds_mla-interleave")
    names = ["positions", "q_c", "q_rms_norm_w", "q_rms_eps", "kv_c", "kv_rms_norm_w", "kv_rms_eps", "k_pe",
             "k_rope_cos_sin_cache", "index_k", "index_k_layer_norm_w", "index_k_layer_norm_bias",
             "index_k_layer_norm_eps", "index_k_rope_cos_sin_cache", "topk_indices_buffer"]
    full = dict(zip(names, args), **kwargs)
    full.update({k: (v(full) if callable(v) else v) for k, v in change.items()})
    return full


NORM_ROPE_ERRORS = {
    "positions": dict(positions=lambda a: a["positions"].float()),
    "q_c": dict(q_c=lambda a: a["q_c"][:3]),
    "kv_rms_norm_w": dict(kv_rms_norm_w=lambda a: a["kv_rms_norm_w"][:8]),
    "k_rope_cos_sin_cache": dict(k_rope_cos_sin_cache=lambda a: a["k_rope_cos_sin_cache"][:, :48]),
    "index_k_rope_cos_sin_cache": dict(index_k_rope_cos_sin_cache=lambda a: torch.ones(40, 6)),
    "topk_indices_buffer": dict(topk_indices_buffer=lambda a: a["topk_indices_buffer"][:2]),
    "slot_mapping": dict(slot_mapping=None),
    "mla_kv_cache_dtype": dict(mla_kv_cache_dtype="nvfp4_ds_mla"),
    "indexer_k_cache": dict(indexer_k_cache=lambda a: a["indexer_k_cache"][:, :, :130]),
    "kv_c_out": dict(kv_c_out=lambda a: a["kv_c_out"][:, :100]),
    "mla_kv_cache": dict(mla_kv_cache=lambda a: a["mla_kv_cache"][:, :, :600]),
}


@pytest.mark.parametrize("arg", list(NORM_ROPE_ERRORS))
def test_fused_norm_rope_errors_name_the_argument(arg):
    bad = _norm_rope_bad(**NORM_ROPE_ERRORS[arg])
    with pytest.raises(ValueError, match=arg):
        fused_norm_rope(**bad)


def test_fused_norm_rope_positions_past_the_cos_sin_cache():
    with pytest.raises(ValueError, match="positions"):
        fused_norm_rope(**_norm_rope_bad(positions=lambda a: a["positions"] + cases.MAX_POS))


Q_ERRORS = {
    "positions": lambda a: a.__setitem__(0, a[0].int()),
    "q_pe": lambda a: a.__setitem__(1, a[1][:, :, :32]),
    "ql_nope": lambda a: a.__setitem__(5, a[5][:, :1]),
    "q_scale": lambda a: a.__setitem__(6, torch.tensor([1.0, 2.0])),
    "index_q": lambda a: a.__setitem__(3, None),
    "index_weights": lambda a: a.__setitem__(7, a[7][:, :1]),
    "index_q_cos_sin_cache": lambda a: a.__setitem__(4, torch.ones(40, 400)),
}


@pytest.mark.parametrize("arg", list(Q_ERRORS))
def test_fused_q_errors_name_the_argument(arg):
    args, kwargs = cases.q_case("bf16-fp8q-neox")
    Q_ERRORS[arg](args)
    with pytest.raises(ValueError, match=arg):
        fused_q(*args, **kwargs)
