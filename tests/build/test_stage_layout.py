"""A newcomer finds each stage's pieces by its name alone: the float32 reference, the CPU kernel,
the CUDA kernel, the Triton kernel, the binding file, the tests and the benchmark (the prefill
stage composes the others: reference, tests, benchmark). Each compiled op is registered by the
binding file of the stage whose section of csrc/registration.cpp declares it, and the built
library serves it on the CPU."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from mla_ext import _ext

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_STAGES = ("cache", "kv_b_proj", "attention", "sparse")
PIECES = {
    "reference": lambda s: [ROOT / "mla_ext" / s / "reference.py"],
    "cpu_kernel": lambda s: sorted((ROOT / "csrc" / s).glob("*_cpu.cpp")),
    "cuda_kernel": lambda s: sorted((ROOT / "csrc" / s).glob("*.cu")),
    "triton_kernel": lambda s: sorted((ROOT / "mla_ext" / s).glob("triton_*.py")),
    "binding": lambda s: [ROOT / "csrc" / s / f"{s}_ops.cpp"],
    "tests": lambda s: sorted((ROOT / "tests" / s).glob("test_*.py")),
    "benchmark": lambda s: [ROOT / "benchmarks" / f"bench_{s}.py"],
}
CASES = [(s, p) for s in KERNEL_STAGES for p in PIECES] + [("prefill", p) for p in ("reference", "tests", "benchmark")]


@pytest.mark.parametrize("stage,piece", CASES)
def test_a_stage_piece_is_found_by_the_stage_name(stage, piece):
    found = [p for p in PIECES[piece](stage) if p.is_file()]
    assert found, f"{stage}: no {piece} at {PIECES[piece](stage)[0].relative_to(ROOT) if PIECES[piece](stage) else piece}"


def _ops_by_section() -> dict[str, str]:
    """op -> the binding file named by the comment heading its section of registration.cpp."""
    out, current = {}, None
    for line in (ROOT / "csrc" / "registration.cpp").read_text().splitlines():
        m = re.match(r"\s*// \w+ \((csrc/[\w/]+\.cpp)\)", line)
        if m:
            current = m.group(1)
        m = re.search(r'm\.def\(\s*"(\w+)\(', line) or re.match(r'\s*"(\w+)\(', line)
        if m and current:
            out[m.group(1)] = current
    return out


OPS = _ops_by_section()


def test_every_schema_is_in_a_stage_section():
    reg = (ROOT / "csrc" / "registration.cpp").read_text()
    assert set(re.findall(r'"(\w+)\((?:Tensor|str|int|ScalarType|\))', reg)) <= set(OPS)
    assert len(OPS) >= 14


@pytest.mark.parametrize("op", sorted(OPS))
def test_each_op_is_bound_by_its_stage_file_only(op):
    home = OPS[op]
    for path in sorted((ROOT / "csrc").rglob("*_ops.cpp")):
        rel = path.relative_to(ROOT).as_posix()
        bound = f'm.impl("{op}"' in path.read_text()
        assert bound == (rel == home), f"{op}: bound by {rel}, its section names {home}"
    if _ext.available():  # the built library serves it on the CPU (a CPU or a composite kernel)
        name = f"mla_ext::{op}"
        assert any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
                   for k in ("CPU", "CompositeImplicitAutograd")), name
