"""The versions the front door names are the ones the suite pins (constraints.txt): the README's
table of tested versions and the Hugging Face guide say the same transformers and accelerate."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pinned() -> dict:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(m.groups() for m in (re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line) for line in lines) if m)


def test_the_readme_names_the_pinned_transformers_and_accelerate():
    pins = _pinned()
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| transformers |"))
    assert f"{pins['transformers']} with accelerate {pins['accelerate']}" in row, row


def test_the_hugging_face_guide_names_the_pinned_transformers():
    guide = (ROOT / "docs" / "guides" / "hugging-face.md").read_text()
    named = set(re.findall(r"transformers 5\.x; tested with the versions in `constraints.txt`, (\S+) now", guide))
    assert named == {_pinned()["transformers"]}, named


def test_the_readme_names_the_pinned_torch():
    torch_row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| PyTorch |"))
    pinned = re.search(r'"torch==(\S+?)"', (ROOT / "scripts" / "run.sh").read_text()).group(1)
    assert torch_row.split("|")[2].strip().startswith(f"{pinned} (CPU build)"), torch_row
