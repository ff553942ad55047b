"""Real client code (vLLM, SGLang) for the CPU tests: fetched once into a cached folder.

The plugin tests run a serving engine's own Python code, not a copy of its calls.
Its wheel is fetched from the package index with ``pip download --no-deps``; only
its pure-Python files (and metadata) are kept, compiled extensions never: on the
CPU the engines import without them. The engine's import-chain dependencies are
installed ``--no-deps`` into the same folder; the venv's torch, triton,
transformers and numpy are used as they are.

Folder: ``$MLA_EXT_CLIENT_CACHE`` or ``<repo>/.clients`` (beside ``.venv``), one
sub-folder per client, completed atomically (a partial fill is never used). A fill
that cannot be done (no index, no network) raises ``ClientUnavailable`` with pip's
own last lines, and the tests skip with that reason.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIP_TIMEOUT_S = 600


class ClientUnavailable(RuntimeError):
    """The client's folder could not be filled; str() says why."""


@dataclass(frozen=True)
class ClientSpec:
    wheel: str  # pip requirement of the client itself, e.g. "vllm==0.33.0"
    package: str  # its top-level import name
    deps: tuple[str, ...]  # its import chain, installed --no-deps
    keep_suffixes: tuple[str, ...] = (".py", ".json", ".jinja", ".typed", ".txt", ".pyi")


# vLLM 0.33.0: what `import vllm.model_executor.layers.attention.mla_attention` and
# `vllm.config` pull in beyond the venv (measured by importing on a CPU machine).
VLLM = ClientSpec(
    wheel="vllm==0.33.0",
    package="vllm",
    deps=("psutil", "pyzmq", "urllib3", "cbor2", "aiohttp", "multidict", "attrs", "yarl", "propcache",
          "aiohappyeyeballs", "aiosignal", "frozenlist", "requests", "charset-normalizer", "certifi",
          "openai-harmony", "openai", "sniffio", "pybase64", "cachetools", "msgspec", "cloudpickle", "uvloop",
          "py-cpuinfo", "prometheus-client", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11",
          "fastapi>=0.133,<0.137", "starlette", "partial-json-parser", "llguidance>=1.7,<1.8", "einops"),
)

# SGLang 0.5.23: what `import sglang.srt.models.deepseek_v2` (with ServerArgs, the
# MLA KV pool, ForwardBatch and the plugin loader) pulls in beyond the venv on a
# CPU machine, where is_cuda() is false and sgl_kernel/flashinfer/deep_gemm are
# never imported.
SGLANG = ClientSpec(
    wheel="sglang==0.5.23",
    package="sglang",
    deps=("aiohappyeyeballs", "aiohttp", "aiosignal", "apache-tvm-ffi==0.1.11", "attrs", "certifi",
          "charset-normalizer", "compressed-tensors", "dill", "einops", "frozenlist", "gguf", "ipython",
          "loguru", "msgspec", "multidict", "openai", "orjson", "partial-json-parser", "propcache", "psutil",
          "pybase64", "pyzmq", "requests", "sentencepiece", "sniffio", "starlette", "traitlets", "urllib3",
          "yarl"),
    # sglang.kernels.jit checks at import that its C++ source folders (include/, csrc/) exist.
    keep_suffixes=ClientSpec.keep_suffixes + (".h", ".cuh", ".cu", ".cpp", ".hpp", ".cc"),
)

CLIENTS = {"vllm": VLLM, "sglang": SGLANG}


def cache_root() -> Path:
    return Path(os.environ.get("MLA_EXT_CLIENT_CACHE") or REPO / ".clients")


def _pip(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ClientUnavailable(f"`pip {' '.join(args[:2])} ...` took over {PIP_TIMEOUT_S} s") from None
    if proc.returncode:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ClientUnavailable(f"`pip {' '.join(args[:4])} ...` failed: {tail}")


def _extract_python_tree(wheel: Path, spec: ClientSpec, site: Path) -> int:
    """The wheel's package files with a kept suffix, and its .dist-info (so that
    importlib.metadata knows the version); never a compiled extension."""
    kept = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            top = name.split("/", 1)[0]
            if top.endswith(".dist-info") or (top == spec.package and name.endswith(spec.keep_suffixes)):
                z.extract(info, site)
                kept += 1
    return kept


def ensure(name: str) -> Path:
    """The folder to put on sys.path for client `name` (filled on first use)."""
    spec = CLIENTS[name]
    root = cache_root()
    final = root / spec.wheel.replace("==", "-")
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one filler at a time; the others wait, then reuse
        if (final / ".complete").exists():
            return final
        work = root / f".{name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        site, dl = work / "site", work / "download"
        site.mkdir(parents=True)
        dl.mkdir()
        _pip("download", "--no-deps", "--only-binary", ":all:", "-d", str(dl), spec.wheel, cwd=work)
        wheels = sorted(dl.glob("*.whl"))
        if len(wheels) != 1:
            raise ClientUnavailable(f"pip download {spec.wheel} gave {len(wheels)} wheels")
        if _extract_python_tree(wheels[0], spec, site) < 100:
            raise ClientUnavailable(f"{wheels[0].name} holds no {spec.package} package")
        _pip("install", "--no-deps", "--no-compile", "--target", str(site), *spec.deps, cwd=work)
        shutil.rmtree(dl)
        shutil.rmtree(final, ignore_errors=True)
        site.rename(final)
        shutil.rmtree(work, ignore_errors=True)
        (final / ".complete").write_text(spec.wheel + "\n")
    return final


# Whole packages installed as they are (compiled parts included) into a target
# folder, for tools a test runs beside the venv's own: Triton 3.6 is the lent GPU
# machine's, whose compiler the ptxas-budget and specialization tests also run.
TARGETS = {"triton36": "triton==3.6.0"}


def ensure_target(name: str) -> Path:
    """The `pip install --no-deps --target` folder of TARGETS[name] (filled on first
    use, atomically, under the same lock discipline as `ensure`)."""
    requirement = TARGETS[name]
    root = cache_root()
    final = root / requirement.replace("==", "-")
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():
            return final
        work = root / f".{name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        _pip("install", "--no-deps", "--no-compile", "--target", str(work / "site"), requirement, cwd=work)
        shutil.rmtree(final, ignore_errors=True)
        (work / "site").rename(final)
        shutil.rmtree(work, ignore_errors=True)
        (final / ".complete").write_text(requirement + "\n")
    return final


if __name__ == "__main__":  # fill ahead of the tests: python tests/clients/client_tree.py vllm
    for arg in sys.argv[1:] or sorted(CLIENTS) + sorted(TARGETS):
        print(arg, ensure_target(arg) if arg in TARGETS else ensure(arg))
