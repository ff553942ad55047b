"""Triton's import and the device rule shared by the sparse kernels' modules."""
from __future__ import annotations

from mla_ext.attention.triton_latent import interpreting

try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # pragma: no cover - depends on the install
    triton = tl = None
    TRITON_IMPORT_ERROR: str | None = str(_exc)
else:
    TRITON_IMPORT_ERROR = None


def device_reasons(t) -> list[str]:
    """Why a Triton kernel cannot run on t's device (empty: it can)."""
    if triton is None:
        return [f"triton is not importable ({TRITON_IMPORT_ERROR})"]
    if t.device.type == "cpu" and not interpreting():
        return ["CPU tensors need TRITON_INTERPRET=1"]
    if t.device.type not in ("cpu", "cuda"):
        return [f"tensors are on {t.device}; Triton needs CUDA (or the CPU under TRITON_INTERPRET=1)"]
    return []
