"""The package's import graph, read from the source (ast, nothing imported): imports point down
the floors only, no import circle, and a function-local import of mla_ext only where the module it
names is optional (Triton kernels, which need the triton package) or the importer is a plugin
entry point that must stay cheap to load (vLLM / SGLang load plugins in every process).

Floors, bottom up (ARCHITECTURE: cli -> demo -> integrations -> prefill -> stages -> config ->
runtime plumbing -> csrc). A module may import its own floor or any floor below."""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

from mla_ext._moved import MOVED

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "mla_ext"

FLOORS = [  # (floor, module prefixes)
    ("runtime", ("mla_ext._C", "mla_ext._args", "mla_ext.compat", "mla_ext._fatbin", "mla_ext._fake",
                 "mla_ext._ext", "mla_ext.dispatch", "mla_ext.triton_fp8", "mla_ext._moved")),
    ("config", ("mla_ext.config",)),
    ("cache", ("mla_ext.cache",)),
    ("attention", ("mla_ext.attention",)),
    ("kv_b_proj", ("mla_ext.kv_b_proj",)),
    ("sparse", ("mla_ext.sparse",)),
    ("prefill", ("mla_ext.prefill",)),
    ("integrations", ("mla_ext.integrations", "mla_ext.vllm", "mla_ext.sglang")),
    ("front", ("mla_ext.demo", "mla_ext.cli", "mla_ext.__main__")),
]
OPTIONAL_PACKAGES = ("triton", "transformers", "vllm", "sglang")  # not needed to import mla_ext
PLUGINS = ("mla_ext.vllm", "mla_ext.sglang")
LOCAL_EXCEPTIONS = {
    # MarlinFp8Weight.from_vllm_layer (public since 0.1) is the module reader's marlin_vllm_layer, which
    # builds on the weight classes: the one deliberate deferred import, so the top-level graph has no circle.
    ("mla_ext.kv_b_proj.weights", "mla_ext.kv_b_proj.from_module"),
}  # entry points loaded in every engine process: lazy by design


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


MODS = _modules()


def _floor(mod: str) -> int:
    if mod == "mla_ext":
        return len(FLOORS)  # the public face sits on top
    for i, (_, prefixes) in enumerate(FLOORS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{mod}: on no floor; add it to FLOORS in {__file__}")


def _targets(mod: str, node) -> list[str]:
    is_pkg = MODS[mod].name == "__init__.py"
    base = mod if is_pkg else mod.rpartition(".")[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            parts = base.split(".")
            root = ".".join(parts[: len(parts) - node.level + 1])
            src = f"{root}.{node.module}" if node.module else root
        else:
            src = node.module or ""
        names = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODS or a.name == "_C" else src for a in node.names]
    out = []
    for t in names:
        if not t.startswith("mla_ext"):
            continue
        while t not in MODS and not t.endswith("._C") and "." in t:
            t = t.rpartition(".")[0]
        out.append(t)
    return out


def _graph():
    top, local, external = defaultdict(set), [], defaultdict(set)
    for mod, path in MODS.items():
        tree = ast.parse(path.read_text())
        in_func = {id(s) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for s in ast.walk(f) if isinstance(s, (ast.Import, ast.ImportFrom))}
        guarded = {id(s) for tr in ast.walk(tree) if isinstance(tr, ast.Try) for s in ast.walk(tr)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in in_func | guarded:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                external[mod].update(n.split(".")[0] for n in names if node.__dict__.get("level", 0) == 0)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, node):
                    if t == mod:
                        continue
                    (local.append((mod, t)) if id(node) in in_func else top[mod].add(t))
    return top, local, external


TOP, LOCAL, EXTERNAL = _graph()


def _needs_optional(mod: str, seen=None) -> bool:
    """Whether importing `mod` needs an optional package (an unguarded module-level import, in it or
    in what it imports): such a module may be imported inside the function that needs it."""
    seen = set() if seen is None else seen
    if mod in seen or mod not in MODS:
        return False
    seen.add(mod)
    return bool(EXTERNAL[mod] & set(OPTIONAL_PACKAGES)) or any(_needs_optional(t, seen) for t in TOP.get(mod, ()))


def test_every_module_has_a_floor():
    for mod in MODS:
        _floor(mod)


def test_imports_point_down():
    up = sorted(f"{a} ({FLOORS[_floor(a)][0]}) -> {b} ({FLOORS[_floor(b)][0] if _floor(b) < len(FLOORS) else 'top'})"
                for a, ts in TOP.items() for b in ts if _floor(b) > _floor(a))
    assert not up, "upward imports:\n" + "\n".join(up)


def test_no_import_circle():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in TOP.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in MODS:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_function_local_imports_only_for_optional_modules():
    bad = sorted(f"{a} -> {b}" for a, b in LOCAL
                 if not _needs_optional(b) and not a.startswith(PLUGINS) and (a, b) not in LOCAL_EXCEPTIONS)
    assert not bad, "function-local imports of required modules (import them at the top):\n" + "\n".join(bad)


def test_local_imports_point_down_too():
    up = sorted(f"{a} -> {b}" for a, b in LOCAL if _floor(b) > _floor(a))
    assert not up, "function-local upward imports:\n" + "\n".join(up)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_paths_still_import(old):
    """Each module path of 0.1 that moved in the layout step imports the moved module itself (one
    object: patches and isinstance checks keep working) and warns naming the new path."""
    import importlib
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(MOVED[old])
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in seen)


def test_public_face():
    import mla_ext

    for name in ("MLAPrefill", "PrefillMetadata", "CacheConfig", "get_model_config", "plan_model", "KvBProj"):
        assert hasattr(mla_ext, name), name
