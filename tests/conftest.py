"""Test set-up shared by every stage.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, so it is
set here, before mla_ext is imported, whenever no GPU is visible.
"""
import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- HYPOTHESIS_PROFILE=memcheck (benchmarks/gpu_check.sh) --------------------
# The compiled ops' CUDA tests run under compute-sanitizer, many times slower:
# a few derandomized examples per property test, also where a test's own
# @settings asks for more (pytest_itemcollected lowers it; hypothesis reads the
# wrapped test's settings when the test is called).
MEMCHECK_MAX_EXAMPLES = 3
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("memcheck", derandomize=True, deadline=None, print_blob=True,
                                   max_examples=MEMCHECK_MAX_EXAMPLES)
except ImportError:  # pragma: no cover
    _hyp_settings = None


def pytest_itemcollected(item):
    if _hyp_settings is None or os.environ.get("HYPOTHESIS_PROFILE") != "memcheck":
        return
    test = getattr(item, "obj", None)
    own = getattr(test, "_hypothesis_internal_use_settings", None)
    if own is not None and own.max_examples > MEMCHECK_MAX_EXAMPLES:
        test._hypothesis_internal_use_settings = _hyp_settings(own, max_examples=MEMCHECK_MAX_EXAMPLES)
# -- end of the memcheck profile ------------------------------------------------


try:
    from hypothesis import settings

    # CI must be reproducible: hypothesis draws the same examples every run
    # (HYPOTHESIS_PROFILE=explore gives fresh random examples locally).
    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("explore", deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# -- Triton's interpreter vs this numpy (mla_ext.compat) ----------------------
# Triton 3.6's interpreter breaks under numpy >= 2.4 ("only 0-dimensional arrays
# can be converted to Python scalars"). mla_ext.compat probes the interpreter
# with a tiny kernel and, where its one-line __index__ shim fixes it, installs
# it. Probing here, before any test, lets tests that call kernels directly
# (not through a dispatcher) get the shim too. Should the interpreter still
# fail, the tests that fail with exactly the probe's error are reported as
# skipped, with the probe's reason; the dispatchers already skip Triton
# backends on their own (that reason is in their not_supported_reasons). Any
# other failure stays a failure. MLA_EXT_TRITON_SHIM=0 shows that mode.
_TRITON_INTERP = {"error": None, "reason": ""}


def pytest_sessionstart(session):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from mla_ext import compat

    err = compat.triton_interpreter_error()
    if err:
        _TRITON_INTERP.update(error=err, reason=compat.triton_interpreter_reasons()[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    err = _TRITON_INTERP["error"]
    if err and rep.failed and call.excinfo is not None and err in rep.longreprtext:
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, "Skipped: " + _TRITON_INTERP["reason"])
# -- end of the Triton interpreter block ---------------------------------------
