"""What the main job (scripts/run.sh) lacks in this environment, one word a line, and nothing
when it can train: ``torch``, ``infinity`` (no installed package with its native libraries),
``build-tools`` (what building it needs: cffi, pybind11, setuptools, wheel) and
``transformers``. It only looks (no import of torch or infinity), so that run.sh re-enters
training at once when nothing is missing; it never asks for a package that is installed,
whatever its version (the developer set-up, scripts/setup_env.sh, pins the tested ones).

Run it with ``python -P``: from a clone's root, the current directory would otherwise put the
clone's source folder, which holds no built library, before the installed package."""
from __future__ import annotations

import importlib.util
import pathlib
import sys


def _found(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _built(package) -> bool:
    """The package's own folders hold the native libraries the job loads (aio and the CPU Adam)."""
    folders = [pathlib.Path(p) for p in (package.submodule_search_locations or [])]
    return all(any(any(f.glob(pattern)) for f in folders) for pattern in ("_aio_cffi*.so", "_cpu_adam*.so"))


def needs() -> list:
    out = [] if _found("torch") else ["torch"]
    package = importlib.util.find_spec("infinity")
    if package is None or not _built(package):
        out.append("infinity")
        out += [] if all(map(_found, ("cffi", "pybind11", "setuptools", "wheel"))) else ["build-tools"]
    return out + ([] if _found("transformers") else ["transformers"])


if __name__ == "__main__":
    print("\n".join(needs()))
    sys.exit(0)
