"""What the installed software stack can actually do, probed once and cached.

The code supports torch >= 2.11 and the Triton that comes with it. Some
behaviour differs between those releases in ways a version string does not
tell reliably (a numpy upgrade can break an old Triton's interpreter; a CPU
kernel gains a feature in a later torch), so each question here is answered
by trying a tiny instance of the real operation, once per process:

- `triton_interpreter_reasons()`: can Triton kernels run on the CPU under
  TRITON_INTERPRET=1? Triton 3.6's interpreter converts kernel scalars with
  `int(ndarray)`, which numpy >= 2.4 refuses for 1-element arrays of ndim > 0
  ("only 0-dimensional arrays can be converted to Python scalars"): every
  `range(n)` over a scalar kernel argument fails. When the probe hits that, a
  one-line shim (what Triton 3.8 itself does) is installed and the probe is
  re-run; a reason is returned only when the interpreter still fails.
  MLA_EXT_TRITON_SHIM=0 leaves Triton untouched (the reason is then reported).
- `cpu_rowwise_scaled_mm_reasons()`: does CPU `torch._scaled_mm` take
  row-wise (per-token x per-channel) scales? torch 2.11's CPU kernel accepts
  per-tensor scales only ("_scaled_mm only supports per-tensor scaling for CPU
  backend"); 2.14's takes both.

Both return a list of reasons (empty: supported), in the form the dispatcher's
`not_supported_reasons` uses. Imports nothing from the rest of the package.
"""
from __future__ import annotations

import functools
import os
import threading

_LOCK = threading.Lock()
_interp_probed = False
_interp_error: str | None = None   # the probe kernel's error (None: the interpreter works)
_interp_reason = ""                 # that error as a not-supported reason
_interp_shimmed = False


def interpreting() -> bool:
    """TRITON_INTERPRET is on: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _run_interpreter_probe() -> str | None:
    """Run a tiny kernel with a scalar-bounded loop; None if it gives the right answer,
    else the error as the interpreter words it (the text a failing kernel also raises)."""
    import torch
    import triton
    import triton.language as tl

    # Defined here, not at import: @triton.jit reads TRITON_INTERPRET when it
    # wraps the function, and the caller may set it after importing mla_ext.
    @triton.jit
    def _probe_kernel(out_ptr, n):
        acc = tl.zeros((2,), dtype=tl.float32)
        for _ in range(n):  # range() of a kernel scalar: tensor.__index__
            acc += 1.5
        tl.store(out_ptr + tl.arange(0, 2), acc)

    out = torch.zeros(2, dtype=torch.float32)
    try:
        _probe_kernel[(1,)](out, 3)
    except Exception as exc:  # the interpreter wraps errors in InterpreterError
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if out.tolist() != [4.5, 4.5]:
        return f"a 3-step loop produced {out.tolist()}, expected [4.5, 4.5]"
    return None


def _install_index_shim() -> bool:
    """Make the interpreter's `tensor.__index__` take 1-element arrays of any ndim.

    Triton 3.6 patches `tl.tensor.__index__` to `int(self.handle.data)` while a
    kernel is interpreted; Triton 3.8 uses `int(self.handle.data.squeeze())`.
    We wrap the interpreter's `_patch_lang_tensor` so that, after it has
    patched the tensor class, `__index__` is re-patched the 3.8 way (through
    the same scope object, so the interpreter restores the original on exit).
    Nothing else in Triton is touched. Returns False if the interpreter does
    not have the expected shape, or MLA_EXT_TRITON_SHIM=0 (then nothing is changed).
    """
    if os.environ.get("MLA_EXT_TRITON_SHIM", "1") == "0":
        return False
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or not callable(orig):
        return False
    if getattr(orig, "_mla_ext_index_shim", False):
        return True

    @functools.wraps(orig)
    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._mla_ext_index_shim = True
    interp._patch_lang_tensor = _patch_lang_tensor
    return True


def triton_interpreter_reasons() -> list[str]:
    """Why Triton kernels cannot run under TRITON_INTERPRET=1 here (empty: they can).

    Not interpreting (a GPU run): nothing to check, returns []. Otherwise the
    probe runs once per process (one tiny kernel, well under a second once
    Triton is imported), installing the `__index__` shim if that fixes it.
    """
    _probe_interpreter()
    return [] if _interp_error is None or not interpreting() else [_interp_reason]


def triton_interpreter_error() -> str | None:
    """The probe kernel's error, as kernels that hit the same problem word it (None: works)."""
    _probe_interpreter()
    return _interp_error if interpreting() else None


def triton_interpreter_shimmed() -> bool:
    """True once the `__index__` shim had to be installed (after a probe)."""
    return _interp_shimmed


def _probe_interpreter() -> None:
    global _interp_error, _interp_reason, _interp_shimmed, _interp_probed
    if _interp_probed or not interpreting():
        return
    with _LOCK:
        if _interp_probed:
            return
        try:
            import numpy
            import triton
        except ImportError as exc:
            _interp_error = _interp_reason = f"the Triton interpreter is not importable ({exc})"
        else:
            err = _run_interpreter_probe()
            if err is not None and _install_index_shim():
                _interp_shimmed = True
                if _run_interpreter_probe() is None:
                    err = None
            if err is not None:
                _interp_error = err
                _interp_reason = (f"triton {triton.__version__} interpreter is incompatible with "
                                  f"numpy {numpy.__version__}: {err}")
        _interp_probed = True


@functools.lru_cache(maxsize=None)
def _cpu_rowwise_scaled_mm_error() -> str | None:
    import torch

    if not hasattr(torch, "_scaled_mm"):
        return "torch._scaled_mm is missing from this torch build"
    try:
        a = torch.ones(16, 32).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
        sa = torch.full((16, 1), 0.5)
        sb = torch.full((1, 16), 0.25)
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception as exc:  # RuntimeError (an internal assert) on torch 2.11
        return (f"CPU torch._scaled_mm of torch {torch.__version__} takes per-tensor scales only, "
                f"not row-wise ({_first_line(exc)})")
    if y.shape != (16, 16) or not bool((y.float() == 4.0).all()):
        return f"CPU torch._scaled_mm of torch {torch.__version__} gives wrong row-wise results"
    return None


def cpu_rowwise_scaled_mm_reasons() -> list[str]:
    """Why CPU `torch._scaled_mm` cannot do row-wise (per-token, per-channel) scales (empty: it can)."""
    err = _cpu_rowwise_scaled_mm_error()
    return [] if err is None else [err]
