"""Every relative link in README.md, docs/*.md and bench/results/*.md points at a file of
the repository, and every `#anchor` at a heading of the target (GitHub's heading ids)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "bench" / "results").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_ids(text: str) -> set[str]:
    """GitHub's ids: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    repeats numbered."""
    ids: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in ids:
            slug = f"{base}-{n}"
            n += 1
        ids.add(slug)
    return ids


def links(path: Path):
    text = FENCE.sub("", path.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def test_heading_ids_follow_github():
    assert heading_ids("# A `b` (c), d\n## A `b` (c), d\n") == {"a-b-c-d", "a-b-c-d-1"}
    assert "with-vllm" in heading_ids("## With vLLM\n")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc: Path):
    bad = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
            bad.append(f"{target}: no heading with id #{anchor} in {dest.name}")
    assert not bad, f"{doc.relative_to(ROOT)} has broken links:\n" + "\n".join(bad)


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; details go to docs/"
