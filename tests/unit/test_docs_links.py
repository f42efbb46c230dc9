"""Every relative link of the front door and the docs (README.md, CONTRIBUTING.md, docs/**/*.md)
points at a file of the repository, and a link with a #fragment at a heading of that file (as
GitHub spells a heading's anchor)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code
    return {anchor(m.group(1)) for m in map(HEADING.match, text.splitlines()) if m}


def links(page: Path):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
            yield target


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    problems = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT) or not file.exists():
            problems.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            problems.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_anchor_spelling():
    assert anchor("Which placement for my model") == "which-placement-for-my-model"
    assert anchor("`zero.offload_param`") == "zerooffload_param"
    assert anchor("On a GPU: the GPU check's recorded run") == "on-a-gpu-the-gpu-checks-recorded-run"
    assert anchor("Projection, one node, 1T parameters") == "projection-one-node-1t-parameters"
