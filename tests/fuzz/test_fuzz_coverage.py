"""Coverage guard: every public entry point has cases in the fuzz matrix.

Public = every function and class defined (not imported) in the modules
below without a leading underscore, and every op of torch.ops.mla_ext. A new
one without a case fails here, naming it. Plain records that take no input
worth fuzzing (dispatcher input bundles, enums, layout constants) are listed
in EXEMPT with the reason; an exemption that no longer names anything fails
too, so the list cannot go stale.
"""
from __future__ import annotations

import importlib
import inspect

import torch

import fuzz_cases  # noqa: F401  (registers every case)
import mla_ext  # noqa: F401  (loads the compiled ops)
from fuzz_harness import ALSO, REGISTRY

MODULES = (
    "mla_ext.cache.api", "mla_ext.attention.api", "mla_ext.kv_b_proj.linear", "mla_ext.kv_b_proj.weights",
    "mla_ext.kv_b_proj.from_module", "mla_ext.kv_b_proj.shard", "mla_ext.kv_b_proj.input_dtype",
    "mla_ext.prefill.layer", "mla_ext.prefill.chunking", "mla_ext.config.models", "mla_ext.config.policy", "mla_ext.config.planner",
    "mla_ext.config.formats", "mla_ext.cli",
)

RECORD = "a plain record of values (no checks of its own); fuzzed through the entry points that build it"
EXEMPT = {
    "mla_ext.cache.api:GatherInputs": "dispatcher input bundle; covered through explain('gather', ...)",
    "mla_ext.cache.api:TensorInputs": "dispatcher input bundle; covered through explain('write', ...)",
    "mla_ext.attention.api:AttentionInputs": "dispatcher input bundle of varlen_attention",
    "mla_ext.attention.api:MergeInputs": "dispatcher input bundle of merge_attn_states",
    "mla_ext.kv_b_proj.linear:KvBProjInputs": "dispatcher input bundle of KvBProj",
    "mla_ext.prefill.chunking:ChunkTensors": RECORD + " (plan_context_chunks, PrefillMetadata)",
    "mla_ext.prefill.chunking:ContextChunk": RECORD + " (plan_context_chunks)",
    "mla_ext.prefill.chunking:ChunkPlan": RECORD + " (plan_context_chunks)",
    "mla_ext.config.planner:LayerPlan": RECORD + " (plan_pool, plan_model)",
    "mla_ext.config.models:LayerDims": RECORD + " (MLAModelConfig(layer_dims=), config_from_dict)",
    "mla_ext.config.formats:QuantMode": "an IntEnum (its values are checked against the C++ registry by format_info)",
    "mla_ext.config.formats:ScaleKind": "an IntEnum (its values are checked against the C++ registry by format_info)",
    "mla_ext.config.formats:DsMla": "byte-layout constants (checked against the kernels by ds_mla_layout)",
    "mla_ext.config.formats:Nvfp4DsMla": "byte-layout constants of a cache format (fuzzed through the cache ops)",
}


def public_entry_points() -> set[str]:
    names = set()
    for modname in MODULES:
        mod = importlib.import_module(modname)
        for name, obj in vars(mod).items():
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) == modname:
                names.add(f"{modname}:{name}")
    for op in torch._C._dispatch_get_all_op_names():
        if op.startswith("mla_ext::"):
            names.add("torch.ops.mla_ext." + op.split("::", 1)[1])
    return names


def covered() -> set[str]:
    """Entry points with cases: the registry's, a method's class, and the `also` links."""
    out = set()
    for entry, cases in REGISTRY.items():
        if cases:
            out.add(entry)
            module, _, qual = entry.partition(":")
            if "." in qual:
                out.add(f"{module}:{qual.split('.')[0]}")
    out |= {e for e, ids in ALSO.items() if ids}
    return out


def test_every_public_entry_point_has_fuzz_cases():
    public = public_entry_points()
    missing = sorted(public - covered() - set(EXEMPT))
    assert not missing, ("public entry points without fuzz cases (add cases in tests/fuzz/fuzz_cases_*.py, "
                         "or an exemption with its reason):\n  " + "\n  ".join(missing))


def _callable_outside_modules(entry: str) -> bool:
    """A case class may fuzz a callable of a module outside MODULES (the offsets class: the sparse and
    vLLM-surface ops): fine when the name resolves to something callable there."""
    module, sep, qual = entry.partition(":")
    if not sep or module in MODULES:
        return False
    try:
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return callable(obj)


def test_exemptions_and_cases_name_real_entry_points():
    public = public_entry_points()
    stale = sorted(set(EXEMPT) - public)
    assert not stale, f"EXEMPT names entry points that no longer exist: {stale}"
    unknown = sorted(e for e in REGISTRY if e not in public and not any(e.startswith(p + ".") for p in public)
                     and not _callable_outside_modules(e))
    assert not unknown, f"cases registered for names that are not public entry points: {unknown}"


def test_every_raw_op_has_a_rejected_and_an_accepted_case():
    """Each raw op is fuzzed both ways: some input it must refuse, one it must serve."""
    ops = sorted(e for e in public_entry_points() if e.startswith("torch.ops."))
    thin = []
    for op in ops:
        kinds = {c.expect for c in REGISTRY.get(op, [])}
        if "accept" not in kinds and not ALSO.get(op):
            thin.append(f"{op}: no valid call")
        if "reject" not in kinds:
            thin.append(f"{op}: no refused input")
    assert not thin, "\n".join(thin)
