"""Prints the fuzz tally (a table per entry point) at the end of the session."""
from __future__ import annotations

import os


def pytest_terminal_summary(terminalreporter):
    from fuzz_harness import ALL_RESULTS, format_tally

    if not ALL_RESULTS:
        return
    text = format_tally(ALL_RESULTS)
    terminalreporter.section("fuzz tally (tests/fuzz)")
    terminalreporter.write_line(text)
    slow = sorted(ALL_RESULTS, key=lambda r: -r.seconds)[:5]
    terminalreporter.write_line("slowest: " + ", ".join(f"{r.case.id} {r.seconds:.1f}s" for r in slow))
    bad = [r for r in ALL_RESULTS if not r.ok]
    if bad:
        terminalreporter.write_line("")
        terminalreporter.write_line(f"{len(bad)} cases not OK:")
        for r in bad:
            terminalreporter.write_line("  " + r.line())
    path = os.environ.get("MLA_EXT_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            f.write(text + "\n\n" + "\n".join(r.line() for r in ALL_RESULTS) + "\n")
