"""Loads the compiled library and says what was built, and why not.

Importing mla_ext._C runs the TORCH_LIBRARY registrations (schemas:
csrc/registration.cpp; checks and kernels: csrc/<stage>/*_ops.cpp), after
which every op is reachable as torch.ops.mla_ext.<name>. Nothing here raises
at import time: a missing or broken build is reported by `available()` and
`load_error()`, and the ops' Python wrappers turn that into a clear error.
"""
from __future__ import annotations

import functools
import struct

import torch

from mla_ext import _fatbin

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
    """Facts about the compiled library: whether CUDA kernels are in it, the arch list it
    was built for (informative only) and the binaries and PTX actually in it (`targets`,
    read from its fatbin: what decides where the kernels run)."""
    if _LOAD_ERROR is not None:
        return {"loaded": False, "cuda": False, "archs": [], "ptx_arch": "", "targets": [],
                "cubins": [], "ptx": [], "error": _LOAD_ERROR}
    raw = torch.ops.mla_ext.build_info()
    fields = dict(kv.split("=", 1) for kv in raw.split("|"))
    archs = [a for a in fields.get("archs", "").replace(",", ";").split(";") if a]
    targets = _targets(_C.__file__) if fields.get("cuda") == "1" else []
    return {
        "loaded": True,
        "cuda": fields.get("cuda") == "1",
        "archs": archs,
        "ptx_arch": fields.get("ptx", ""),
        "so_path": _C.__file__,
        "targets": targets,
        "cubins": [str(t) for t in targets if not t.ptx],
        "ptx": [str(t) for t in targets if t.ptx],
    }


def _targets(so_path: str) -> list:
    """The SASS binaries and PTX actually present in the shared object (its fatbin)."""
    try:
        return _fatbin.entries(so_path)
    except (OSError, ValueError, struct.error, IndexError):
        return []


def _device_capability(device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def cuda_target(device=None):
    """The fatbin entry (`_fatbin.Target`) the CUDA kernels run from on `device` (None:
    the current one), or None: no device, no CUDA build, or nothing in the library
    that this device can run."""
    info = build_info()
    if not info["loaded"] or not info["cuda"] or not torch.cuda.is_available():
        return None

    return _fatbin.runs_on(info["targets"], _device_capability(device))


def cuda_target_note(device=None) -> str:
    """One line for `info` / `explain()`: which binary or PTX `device` runs, or why none."""
    ok, why = cuda_kernels_usable(device)
    if not ok:
        return f"CUDA kernels: not usable: {why}"
    t = cuda_target(device)
    cap = "sm_%d%d" % _device_capability(device)
    how = "JIT-compiled from PTX" if t.ptx else "SASS binary"
    return f"CUDA kernels: {cap} runs {t} ({how})"


def cuda_kernels_usable(device=None) -> tuple[bool, str]:
    """Whether the CUDA kernels can run on `device` (None: the current one), and if not, why.
    Decided from the binaries in the library and the device's capability (integers),
    never from an arch string."""
    info = build_info()
    if not info["loaded"]:
        return False, info["error"]
    if not info["cuda"]:
        return False, "the library was built without CUDA kernels"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    if cuda_target(device) is None:
        major, minor = _device_capability(device)
        have = ", ".join(str(t) for t in info["targets"]) or "none"
        return False, (f"device is sm_{major}{minor} but the library holds no binary or PTX it can "
                       f"run (it holds: {have})")
    return True, ""
