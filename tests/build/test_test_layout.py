"""The test tree's own rules, so they hold after the next wave of tests:

- every test file sits in a stage folder (tests/<stage>/test_*.py), none loose under tests/,
  none in tests/helpers/;
- tests are named by what they test: no issue number ("issue 11") in any file under
  tests/ (names, docstrings, comments);
- the result comparisons live in tests/helpers/numeric.py only: no other module defines a
  relative-error / bit-equality helper under one of their names, or divides two norms inline.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HELPERS = TESTS / "helpers"
THIS = Path(__file__).resolve()

# Names a local copy of a helpers.numeric comparison has gone by (and the helpers' own names).
COMPARISON_NAME = re.compile(
    r"_?(rel|rel_err|rel_error|rel_fro|rel_frob|frob|frobenius|max_rel|mean_rel|rel_mean_abs|"
    r"assert_close_rel|assert_rel_close|same|same_bits|same_bytes|assert_same_bits|"
    r"assert_within_one_ulp)")
# A relative error computed in place: ||a - b|| / ||b|| or mean|a - b| / mean|b|.
INLINE_RATIO = re.compile(r"\.norm\(\)\s*/[^\n]*\.norm\(|\.abs\(\)\.mean\(\)\s*/[^\n]*\.abs\(\)\.mean\(")
# "issue 11", "Issue #11", "issues 19", "issue19", "issue_20" (an upstream project's "#48378" is a
# fact about that project, not this one's history, and stays).
ISSUE_NUMBER = re.compile(r"(?<![a-z])issues?[ _-]?#?\d+", re.IGNORECASE)


def _python_files():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return str(p.relative_to(TESTS.parent))


def test_every_test_file_is_in_a_stage_folder():
    misplaced = [_rel(p) for p in TESTS.rglob("test_*.py")
                 if p.parent == TESTS or p.parent.parent != TESTS or p.parent == HELPERS]
    assert not misplaced, f"test files outside tests/<stage>/: {misplaced}"


def test_no_issue_numbers_in_the_tests():
    found = []
    for p in _python_files() + sorted(TESTS.rglob("*.md")):
        if p == THIS:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if ISSUE_NUMBER.search(line):
                found.append(f"{_rel(p)}:{n}: {line.strip()}")
    assert not found, "name tests by what they test, not by the issue that asked for them:\n" + "\n".join(found)


def test_comparison_helpers_are_not_copied():
    found = []
    for p in _python_files():
        if p.parent == HELPERS or p == THIS:
            continue
        text = p.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and COMPARISON_NAME.fullmatch(node.name):
                found.append(f"{_rel(p)}:{node.lineno}: def {node.name}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
                for t in node.targets:
                    if isinstance(t, ast.Name) and COMPARISON_NAME.fullmatch(t.id):
                        found.append(f"{_rel(p)}:{node.lineno}: {t.id} = lambda")
        for n, line in enumerate(text.splitlines(), 1):
            if INLINE_RATIO.search(line):
                found.append(f"{_rel(p)}:{n}: {line.strip()}")
    assert not found, ("use tests/helpers/numeric.py (rel_fro, rel_mean_abs, same_bits, ...) "
                       "instead of a local copy:\n" + "\n".join(found))


def test_the_guards_catch_what_they_guard():
    # The patterns themselves, on the spellings they exist to catch (and not on neighbours).
    assert ISSUE_NUMBER.search("Issue 11 (hardening)") and ISSUE_NUMBER.search("(issue #20)")
    assert ISSUE_NUMBER.search("issue19 item 3") and ISSUE_NUMBER.search("def test_issue_20_case")
    assert not ISSUE_NUMBER.search("the kernel's issue / commit sequence")
    assert not ISSUE_NUMBER.search("upstream #38658: the activation was cast")
    assert all(COMPARISON_NAME.fullmatch(n) for n in ("rel", "_rel", "rel_frob", "_frob", "_rel_err", "_same"))
    assert not COMPARISON_NAME.fullmatch("_rel_between_oracles")
    assert INLINE_RATIO.search("err = float((a - b).norm() / b.norm())")
    assert INLINE_RATIO.search("((y - d).abs().mean() / d.abs().mean()).item()")
