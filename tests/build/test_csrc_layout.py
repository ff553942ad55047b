"""The csrc/ layout the build relies on: one schema file, one binding file per stage
beside its kernels, torch-free kernel sources and no test code in the product tree."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
STAGE_BINDINGS = ["cache/cache_ops.cpp", "kv_b_proj/kv_b_proj_ops.cpp", "attention/attention_ops.cpp",
                  "sparse/sparse_ops.cpp", "common/info_ops.cpp"]
TORCH_INCLUDE = re.compile(r'#include\s*[<"](torch/|ATen/|c10/|Python\.h)')


def _sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu", ".cuh", ".h"))


def _is_binding(path: pathlib.Path) -> bool:
    rel = path.relative_to(CSRC).as_posix()
    return rel in ("registration.cpp", "common/torch_checks.h") or rel.endswith("_ops.cpp")


def test_every_stage_has_its_binding_file():
    for rel in STAGE_BINDINGS:
        assert (CSRC / rel).is_file(), rel
    assert not (CSRC / "bindings.cpp").exists()


def test_kernel_sources_include_no_torch_header():
    torchy = [p.relative_to(ROOT).as_posix() for p in _sources()
              if not _is_binding(p) and TORCH_INCLUDE.search(p.read_text())]
    assert torchy == [], f"kernel sources must stay torch-free: {torchy}"


def test_schemas_live_in_registration_cpp_only():
    reg = (CSRC / "registration.cpp").read_text()
    assert reg.count("TORCH_LIBRARY(mla_ext, m)") == 1 and "m.impl(" not in reg
    for p in _sources():
        if p.name == "registration.cpp":
            continue
        text = p.read_text()
        rel = p.relative_to(ROOT).as_posix()
        assert "TORCH_LIBRARY(" not in text and "TORCH_LIBRARY_FRAGMENT(" not in text, rel
        assert "m.def(" not in text, rel
    # Every op a binding file registers has its schema in registration.cpp.
    defined = set(re.findall(r'm\.def\(\s*"(\w+)\(', reg))
    for rel in STAGE_BINDINGS:
        for name in re.findall(r'm\.impl\("(\w+)"', (CSRC / rel).read_text()):
            assert name in defined, (rel, name)


def test_no_test_code_in_the_product_tree():
    assert [p.name for p in CSRC.rglob("*emulator*")] == []
    assert (ROOT / "tests" / "cache" / "emulator" / "paged_gather_emulator.cpp").is_file()
