"""Module paths that moved in the layout step (0.1 -> 0.2), still importable for one release.

`import mla_ext.models` (or `from mla_ext.formats import ...`) gets the module at its new path,
the same module object, with a DeprecationWarning naming the new path. Nothing else is aliased:
new code imports the new paths (or the public face, `from mla_ext import ...`)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "mla_ext.formats": "mla_ext.config.formats",
    "mla_ext.softmax_scale": "mla_ext.config.softmax_scale",
    "mla_ext.families": "mla_ext.config.families",
    "mla_ext.builtin_configs": "mla_ext.config.builtin_configs",
    "mla_ext.config_facts": "mla_ext.config.facts",
    "mla_ext.config_dict": "mla_ext.config.dict_reader",
    "mla_ext.config_hf": "mla_ext.config.hf_reader",
    "mla_ext.models": "mla_ext.config.models",
    "mla_ext.policy": "mla_ext.config.policy",
    "mla_ext.planner": "mla_ext.config.planner",
    "mla_ext.cache.context_parallel": "mla_ext.prefill.context_parallel",
    "mla_ext.prefill.absorbed": "mla_ext.attention.latent",
    "mla_ext.prefill.absorbed_cost": "mla_ext.prefill.context_cost",
    "mla_ext.prefill.absorbed_reference": "mla_ext.attention.latent_reference",
    "mla_ext.sparse.layer": "mla_ext.prefill.sparse",
    "mla_ext.sparse.from_transformers": "mla_ext.integrations.transformers_indexer",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there (the old path goes in 0.3)",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        """The module is the new one, already executed."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
