"""Coverage guard of the offsets fuzz class: every public op of the modules below (and every raw
torch.ops.mla_ext op) that takes an offset argument is declared in fuzz_cases_offsets.OFFSET_OPS,
so it gets the negative / decreasing / past-the-end cases, or is exempt here with the reason.
A new op with such an argument fails here, naming it."""
from __future__ import annotations

import importlib
import inspect

import torch

import fuzz_cases_offsets as F
import mla_ext  # noqa: F401  (loads the compiled ops)

OFFSET_ARGS = {"cu_seq_lens", "seq_starts", "workspace_starts"}
MODULES = ("mla_ext.cache.api", "mla_ext.sparse.index_cache", "mla_ext.sparse.index_cache_torch", "mla_ext.sparse.triton_index_cache",
           "mla_ext.vllm._custom_ops", "mla_ext.vllm._indexer_ops", "mla_ext.attention.latent")
LATENT_POLICY = ("the latent gathers' documented out-of-range policy: zero rows / rows past dst dropped "
                 "(tests/fuzz/fuzz_cases_cache.py, 'either'); mla_ext.cache.api refuses them with validate=True")
EXEMPT = {
    "mla_ext.cache.api:GatherInputs": "the dispatcher's input bundle (checked by the public gathers)",
    "mla_ext.sparse.index_cache_torch:check_gather_offsets": "the checker itself",
    "mla_ext.attention.latent:LatentInputs": "the dispatcher's input bundle of latent_context_attention",
    "mla_ext.attention.latent:latent_context_attention": (
        "no output argument to run past, and its offsets come twice (host ints, checked; the tensors, checked on "
        "CPU): tests/cache/test_offset_checks.py::test_absorbed_context_attention_refuses_bad_offset_tensors_on_the_host"),
    "torch.ops.mla_ext.gather_and_maybe_dequant_cache": LATENT_POLICY,
    "torch.ops.mla_ext.cp_gather_cache": LATENT_POLICY,
}


def _resolve(entry: str):
    if entry.startswith("torch.ops.mla_ext."):
        return getattr(torch.ops.mla_ext, entry.rsplit(".", 1)[1])
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def _ops_with_offsets() -> dict[str, object]:
    found = {}
    for modname in MODULES:
        for name, obj in vars(importlib.import_module(modname)).items():
            fn = getattr(obj, "_init_fn", obj)  # a torch.library custom op: its Python function
            if name.startswith("_") or not callable(fn) or getattr(fn, "__module__", None) != modname:
                continue  # private, not callable, or imported (listed where it is defined)
            try:
                params = set(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                continue
            if params & OFFSET_ARGS:
                found[f"{modname}:{name}"] = obj
    for op in torch._C._dispatch_get_all_op_names():
        if op.startswith("mla_ext::"):
            name = op.split("::", 1)[1]
            schema = str(getattr(torch.ops.mla_ext, name).default._schema)
            if any(f" {a}" in schema for a in OFFSET_ARGS):
                found[f"torch.ops.mla_ext.{name}"] = getattr(torch.ops.mla_ext, name)
    return found


def test_every_op_with_offset_arguments_is_in_the_offsets_class():
    declared = [_resolve(op.entry) for op in F.OFFSET_OPS]
    missing = sorted(entry for entry, obj in _ops_with_offsets().items()
                     if entry not in EXEMPT and not any(obj is d for d in declared))
    assert not missing, ("ops with offset arguments outside tests/fuzz/fuzz_cases_offsets.OFFSET_OPS (declare "
                         "them there, or exempt them here with the reason):\n  " + "\n  ".join(missing))


def test_the_offsets_class_declares_each_op_once_with_real_arguments():
    entries = [op.entry for op in F.OFFSET_OPS]
    assert len(entries) == len(set(entries))
    assert sorted(set(EXEMPT) - set(_ops_with_offsets())) == [], "stale exemptions"
    for op in F.OFFSET_OPS:
        args, _ = op.setup()
        assert set(op.offsets) | set(op.outputs) <= set(args), op.entry
        assert set(op.offsets.values()) <= {"cu", "starts", "row_starts"}, op.entry
