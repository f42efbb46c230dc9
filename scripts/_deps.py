"""Which of the tested versions (constraints.txt) this environment lacks: scripts/setup_env.sh
installs what it prints, scripts/check_latest.sh compares the newest releases with it.

    python scripts/_deps.py missing NAME...   the pins of NAME... not installed at their version,
                                              and of every other pinned package installed at another
    python scripts/_deps.py pins NAME...      the tested version of each NAME, one "name version" a line
"""
from __future__ import annotations

import pathlib
import re
import sys
from importlib import metadata

CONSTRAINTS = pathlib.Path(__file__).resolve().parents[1] / "constraints.txt"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict:
    """name (normalised) -> (name as written, version) of every line of constraints.txt."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"constraints.txt: {line!r} is not NAME==VERSION")
        out[_norm(name)] = (name.strip(), version.strip())
    return out


def installed(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def missing(wanted: list) -> list:
    table = pins()
    for name in wanted:
        if _norm(name) not in table:
            raise SystemExit(f"{name} has no line in constraints.txt: add the version the suite ran with")
    need = []
    for key, (name, version) in table.items():
        have = installed(name)
        if (key in map(_norm, wanted) and have is None) or (have is not None and have != version):
            need.append(f"{name}=={version}")
    return need


def main(argv: list) -> int:
    if len(argv) < 1 or argv[0] not in ("missing", "pins"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "missing":
        print(" ".join(missing(argv[1:])))
    else:
        table = pins()
        for name in argv[1:]:
            print(name, table[_norm(name)][1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
