"""Regenerate the config reference in README.md from the typed config (infinity.Config).

    python scripts/update_readme.py          # rewrite the block between the markers
    python scripts/update_readme.py --check  # exit 1 if README.md is out of date
"""
import pathlib
import sys

from infinity.config import Config

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def main() -> int:
    path = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{Config.reference_markdown().strip()}\n{END}{tail}"
    if "--check" in sys.argv:
        return 0 if new == text else 1
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
