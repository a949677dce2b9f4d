"""The README stays a front door, and no relative link in the docs points at a file or a heading that is gone.

Reads README.md, CHANGELOG.md and docs/*.md as text (no torch, no processes): every relative link and image
must name an existing file, and a `#anchor` must match a heading of the file it points into, slugged the way
GitHub renders headings.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250  # issue 22: README <= ~200 lines; the dated measurements live in docs/benchmarks.md
DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text a reader sees as prose: fenced blocks and code spans removed (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the file's headings give (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_slug_matches_githubs_rules():
    assert slug("Library warnings at start-up (`mcore_rl/platform/library_warnings.py`)") == (
        "library-warnings-at-start-up-mcore_rlplatformlibrary_warningspy"
    )
    assert slug("Weight sync actor -> engine") == "weight-sync-actor---engine"
    assert slug("Log-probs + entropy from vocab-parallel logits") == "log-probs--entropy-from-vocab-parallel-logits"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (limit {README_MAX_LINES}): move measurements to docs/benchmarks.md, "
        "history to CHANGELOG.md, details to docs/"
    )


def test_the_readme_links_every_doc():
    linked = {(REPO / t.split("#")[0]).resolve() for t in relative_links(REPO / "README.md")}
    missing = [p.name for p in DOCS[2:] if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files_and_headings(doc):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_checker_sees_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Real section\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#real-section) [gone](missing.md) [bad anchor](a.md#no-such) `[code](x.md)`\n"
        "```\n[fenced](y.md)\n```\n[web](https://example.com)\n"
    )
    assert relative_links(doc) == ["a.md#real-section", "missing.md", "a.md#no-such"]
    assert anchors(tmp_path / "a.md") == {"title", "real-section"}
