"""Loads the compiled library and says what was built, and why not.

Importing mla_ext._C runs the TORCH_LIBRARY registrations in csrc/bindings.cpp,
after which every op is reachable as torch.ops.mla_ext.<name>. Nothing here
raises at import time: a missing or broken build is reported by `available()`
and `load_error()`, and the ops' Python wrappers turn that into a clear error.
"""
from __future__ import annotations

import functools
import struct

import torch

_LOAD_ERROR: str | None = None

try:  # noqa: SIM105 - the error text is kept for `info`
    from mla_ext import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _LOAD_ERROR = f"mla_ext._C failed to import: {exc}"
else:
    from mla_ext import _fake  # noqa: F401  (registers fake kernels for torch.compile)


def available() -> bool:
    """True when the compiled library is loaded."""
    return _LOAD_ERROR is None


def load_error() -> str | None:
    return _LOAD_ERROR


def ops():
    """torch.ops.mla_ext, or a RuntimeError saying why the library is missing (a broken
    install, not a bad argument)."""
    if _LOAD_ERROR is not None:
        raise RuntimeError(
            _LOAD_ERROR + " (build it with `pip install -e . --no-build-isolation`)"
        )
    return torch.ops.mla_ext


@functools.lru_cache(maxsize=None)
def build_info() -> dict:
    """Facts about the compiled library: whether CUDA kernels are in it and for which archs."""
    if _LOAD_ERROR is not None:
        return {"loaded": False, "cuda": False, "archs": [], "error": _LOAD_ERROR}
    raw = torch.ops.mla_ext.build_info()
    fields = dict(kv.split("=", 1) for kv in raw.split("|"))
    archs = [a for a in fields.get("archs", "").replace(",", ";").split(";") if a]
    return {
        "loaded": True,
        "cuda": fields.get("cuda") == "1",
        "archs": archs,
        "so_path": _C.__file__,
        "cubins": _cubins(_C.__file__) if fields.get("cuda") == "1" else [],
    }


def _cubins(so_path: str) -> list[str]:
    """The sm_XX targets actually present in the shared object (read from its fatbin)."""
    from mla_ext import _fatbin

    try:
        return [t for t in _fatbin.targets(so_path) if t.startswith("sm_")]
    except (OSError, ValueError, struct.error, IndexError):
        return []


def cuda_kernels_usable() -> tuple[bool, str]:
    """Whether the CUDA kernels can run here, and if not, why."""
    info = build_info()
    if not info["loaded"]:
        return False, info["error"]
    if not info["cuda"]:
        return False, "the library was built without CUDA kernels"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    have = {a.replace(".", "").rstrip("a") for a in info["archs"]}
    if f"{major}{minor}" not in have:
        return False, f"device is sm_{major}{minor} but kernels were built for {info['archs']}"
    return True, ""
