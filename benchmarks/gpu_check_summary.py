"""The readable part of gpu_check's summary.md, from its work folder (stdlib only:
it runs after every step, also when torch is broken).

    python benchmarks/gpu_check_summary.py WORK   # prints markdown

Sections: CUDA tests per file (from junit XML), memcheck per file (the
sanitizer's ERROR SUMMARY and pytest's last line), every benchmark CSV (rows,
failed rows and their errors), the kv_b_proj crossovers, the prefill targets.
"""
from __future__ import annotations

import csv
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET


def _tail_line(path: str, pattern: str) -> str:
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return ""
    hits = [ln.strip() for ln in lines if re.search(pattern, ln)]
    return hits[-1] if hits else ""


def cuda_tests(work: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(work, "junit", "*.xml")))
    if not files:
        return []
    out = ["## CUDA tests (pytest -m cuda, one process per file)", "",
           "| file | tests | passed | failed | errors | skipped | seconds |", "|---|---|---|---|---|---|---|"]
    failing = []
    for path in files:
        name = os.path.basename(path)[:-4]
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError) as exc:
            out.append(f"| {name} | unreadable junit XML ({exc}) | | | | | |")
            continue
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        n = sum(int(s.get("tests", 0)) for s in suites)
        fail = sum(int(s.get("failures", 0)) for s in suites)
        err = sum(int(s.get("errors", 0)) for s in suites)
        skip = sum(int(s.get("skipped", 0)) for s in suites)
        secs = sum(float(s.get("time", 0)) for s in suites)
        out.append(f"| {name} | {n} | {n - fail - err - skip} | {fail} | {err} | {skip} | {secs:.0f} |")
        for case in root.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                msg = " ".join((bad.get("message") or "").split())[:160]
                failing.append(f"- {name}::{case.get('name')}: {msg}")
    if failing:
        out += ["", f"failing ({len(failing)}; first 25):"] + failing[:25]
    return out + [""]


def memcheck(work: str) -> list[str]:
    logs = sorted(glob.glob(os.path.join(work, "logs", "memcheck.*.log")))
    if not logs:
        return []
    out = ["## memcheck (compute-sanitizer, C++/CUDA ops)", ""]
    for path in logs:
        name = os.path.basename(path)[len("memcheck."):-4]
        summary = _tail_line(path, r"ERROR SUMMARY") or "no ERROR SUMMARY (interrupted?)"
        result = _tail_line(path, r"(passed|failed|error|no tests ran)") or "no pytest result line"
        out.append(f"- {name}: {summary}; {result}")
    return out + [""]


def benchmarks(work: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(work, "bench", "*.csv")))
    if not files:
        return []
    out = ["## Benchmarks (rows in the CSVs; a failed measurement is a row with its error)", ""]
    for path in files:
        try:
            rows = list(csv.DictReader(open(path, newline="")))
        except (OSError, csv.Error) as exc:
            out.append(f"- {os.path.basename(path)}: unreadable ({exc})")
            continue
        bad = [r for r in rows if r.get("status", "ok") != "ok"]
        out.append(f"- {os.path.basename(path)}: {len(rows)} rows, {len(bad)} failed")
        out += [f"  - {r.get('status')}: {(r.get('error') or '')[:200]}" for r in bad[:8]]
    return out + [""]


def crossovers(work: str) -> list[str]:
    out = []
    for path in sorted(glob.glob(os.path.join(work, "bench", "kv_b_proj_crossovers_*.txt"))):
        lines = open(path, errors="replace").read().splitlines()
        out += ["## kv_b_proj crossovers", "", "```"] + lines[:80] + ["```", ""]
    return out


def prefill_targets(work: str) -> list[str]:
    path = os.path.join(work, "logs", "bench_prefill.log")
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return []
    i = text.rfind("\ntargets (")
    if i < 0:
        return []
    return ["## Prefill targets", "", "```"] + text[i + 1:].splitlines()[:12] + ["```", ""]


def main(argv: list[str]) -> int:
    work = argv[1] if len(argv) > 1 else "."
    for section in (cuda_tests, memcheck, crossovers, prefill_targets, benchmarks):
        try:
            lines = section(work)
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
            lines = [f"({section.__name__}: {type(exc).__name__}: {exc})", ""]
        if lines:
            print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
