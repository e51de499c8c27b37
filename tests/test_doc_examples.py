"""The `python` code blocks of README.md and docs/*.md run as written.

Convention: every fenced block whose info string starts with `python` is an example, and
the runnable ones of a page run in order in one namespace (a later block may use the names
of an earlier one), in this process. A block that is a fragment (it needs a loaded model, a
process group, a GPU, or names the page leaves to the reader) carries the line
`<!-- illustrative -->` (optionally `<!-- illustrative: why -->`) right above its fence:
it is compiled, not run. A `>>>` session is compiled line by line. README.md's first
`python` block must run: it is the first example a reader copies.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\S*)")
MARK = re.compile(r"^<!--\s*illustrative(?::[^>]*)?\s*-->\s*$")


def blocks(page: str) -> list[tuple[int, str, bool]]:
    """(line number, code, runnable) for every python block of `page`."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if lang.split(",")[0] not in ("python", "py", "pycon"):
            continue
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        out.append((start + 1, "\n".join(body) + "\n", not MARK.match(above)))
    return out


def source_of(code: str) -> str:
    """The code of a block; of a `>>>` session, its input lines."""
    if not code.lstrip().startswith(">>>"):
        return code
    src = [ln[4:] for ln in code.splitlines() if ln.startswith((">>> ", "... "))]
    return "\n".join(src) + "\n"


def test_pages_have_examples_and_the_readme_starts_with_a_runnable_one():
    found = {page: blocks(page) for page in PAGES}
    assert found["README.md"], "README.md has no python example"
    line, _, runnable = found["README.md"][0]
    assert runnable, f"README.md:{line}: the first example is marked illustrative"
    assert sum(len(b) for b in found.values()) >= 10


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_doc_examples(page):
    found = blocks(page)
    namespace: dict = {"__name__": f"doc_example_{Path(page).stem}"}
    for line, code, runnable in found:
        where = f"{page}:{line}"
        src = source_of(textwrap.dedent(code))
        try:
            compiled = compile(src, where, "exec")
        except SyntaxError as e:
            pytest.fail(f"{where}: the block does not compile: {e}")
        if not runnable:
            continue
        try:
            exec(compiled, namespace)
        except Exception as e:  # the page's reader would see this
            raise AssertionError(f"{where}: the example fails as written "
                                 f"({type(e).__name__}: {e}); mark a fragment with "
                                 "<!-- illustrative --> above its fence") from e
