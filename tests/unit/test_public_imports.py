"""Examples, scripts and benchmarks use only the public API or the documented testing face
(CONTRIBUTING.md, Style): no file under scripts/, examples/ or benchmarks/ imports a private module
of infinity (``infinity._...``) or a private name from the package (``from infinity import _x``).
A name a script needs that is not public goes in ``infinity/testing.py``, with its reason."""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ("scripts", "examples", "benchmarks")


def _files():
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def _private(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "infinity" and any(p.startswith("_") for p in parts[1:])


def private_imports(source: str) -> list:
    """(line, what) of each import of a private part of infinity in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _private(node.module):
                found.append((node.lineno, node.module))
            elif node.module.split(".")[0] == "infinity":  # a private name from a public module
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name.startswith("_")]
    return found


def test_the_check_sees_each_form():
    src = ("import infinity._zero._engine\nfrom infinity._offload import _swap\nfrom infinity import _checkpoint\n"
           "import infinity, infinity.aio\nfrom infinity.testing import new_aio\nfrom infinity import telemetry\n"
           "from . import _local\nfrom infinity.aio._clone import fs_type\nfrom infinity.config import _parse_bytes\n"
           "import infinity.aio._native\n")
    assert [line for line, _ in private_imports(src)] == [1, 2, 3, 8, 9, 10]


@pytest.mark.parametrize("path", list(_files()), ids=lambda p: os.path.relpath(p, REPO))
def test_no_private_imports(path):
    with open(path) as f:
        found = private_imports(f.read())
    assert not found, (f"{os.path.relpath(path, REPO)} imports private parts of infinity: "
                       + ", ".join(f"line {n}: {m}" for n, m in found)
                       + "; use the public API, or add the name to infinity/testing.py with its reason")


def test_there_are_files_to_check():
    assert any(True for _ in _files())
