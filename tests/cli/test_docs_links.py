"""The README and docs/ point at pages that exist: every relative markdown link inside the
repository resolves to a file, and a `#section` anchor to a heading of that page (a moved or
renamed doc would otherwise leave the README pointing nowhere)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}


def _links(page: Path):
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        yield target, (page.parent / path).resolve() if path else page, anchor


def test_the_docs_pages_exist():
    names = {p.name for p in PAGES}
    assert {"vllm.md", "sglang.md", "transformers.md", "gpu-check.md", "build-facts.md", "layout.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_inside_the_repository_resolves(page):
    bad = []
    for target, dest, anchor in _links(page):
        if ROOT not in dest.parents and dest != ROOT:
            continue  # outside the checkout (the shared SPEC): not this repository's to hold
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)
