"""The documentation's relative links lead somewhere: every linked file exists and every ``#anchor`` is a heading
of the page it points to (as GitHub renders heading anchors), and the README links every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "patches" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(root)}: {target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{page.relative_to(root)}: {target}: no heading #{fragment} in {dest.relative_to(root)}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = [p for page in PAGES for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    missing = [page.name for page in (REPO / "docs").glob("*.md") if f"(docs/{page.name})" not in readme]
    assert not missing, "README.md links no " + ", ".join(f"docs/{name}" for name in missing)


def test_the_checker_sees_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n\n## The simulator's speed\n")
    page.write_text("[ok](b.md#the-simulators-speed) [bad](b.md#speed) [gone](c.md)\n")
    problems = broken_links(page, tmp_path)
    assert len(problems) == 2 and "#speed" in problems[0] and "c.md" in problems[1], problems
