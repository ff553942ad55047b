"""The bad-input matrix: every case of every public entry point, each in its
own forked child (tests/fuzz/fuzz_harness.py). One test per entry point; it
fails listing every case that is not OK (VAGUE, WRONG, CRASH, HANG, ERROR).
The tally table is printed at the end of the session (tests/fuzz/conftest.py)."""
from __future__ import annotations

import pytest

import fuzz_cases  # noqa: F401  (registers every case)
from fuzz_harness import ALL_RESULTS, BIG, REGISTRY, format_tally, run_cases

ENTRIES = sorted(REGISTRY)


@pytest.mark.parametrize("entry", ENTRIES)
def test_fuzz_entry_point(entry):
    cases = [c for c in REGISTRY[entry] if BIG or not c.big]
    results = run_cases(cases)
    ALL_RESULTS.extend(results)
    bad = [r for r in results if not r.ok]
    if bad:
        lines = "\n".join(r.line() for r in bad)
        pytest.fail(f"{len(bad)} of {len(results)} fuzz cases of {entry} are not OK:\n{lines}\n\n"
                    + format_tally(results), pytrace=False)
