"""Shared test helpers (tests/ is on sys.path: `from helpers.numeric import rel_fro`).

numeric: how a result is compared with its reference (SPEC §9 metrics, bit-exact and
one-ulp checks); the other modules build inputs for one stage each (gather, prefill,
kv_b_proj, sparse, ...). tests/build/test_test_layout.py keeps the comparison helpers here
only, so copies do not creep back into the test files.
"""
from .numeric import (  # noqa: F401  (the comparisons, importable from the package too)
    REL_TOL,
    assert_close_rel,
    assert_same_bits,
    assert_within_one_ulp,
    rel_fro,
    rel_mean_abs,
    same_bits,
    same_bytes,
)
