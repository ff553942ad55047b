"""A benchmark script (benchmarks/bench_<stage>.py) loaded as a module, for the tests that run it
end to end. benchmarks/ goes on sys.path first: the scripts import their shared helpers
(bench_common) and each other by name."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def load_benchmark(script: str, module_name: str | None = None) -> ModuleType:
    """benchmarks/<script>.py as a fresh module named `module_name` (default: the script's name)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(module_name or script, os.path.join(BENCHMARKS, f"{script}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
