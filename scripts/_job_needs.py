"""What the main job (scripts/run.sh) lacks in this environment, one word a line, and nothing
when it can train: ``torch``, ``infinity`` (no installed package with its native libraries),
``build-tools`` (what building it needs: cffi, pybind11, setuptools, wheel) and
``transformers``, and ``unsupported-torch`` where the installed torch is outside the range
infinity is built for (``TORCH_RANGE``, setup.py's), which installing infinity would make pip
replace: run.sh refuses then instead. It only looks (no import of torch or infinity), so that
run.sh re-enters training at once when nothing is missing; it never asks for a package that is
installed (the developer set-up, scripts/setup_env.sh, pins the tested versions).

Run it with ``python -P``: from a clone's root, the current directory would otherwise put the
clone's source folder, which holds no built library, before the installed package."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import sys

TORCH_RANGE = ((2, 4), (2, 15))  # setup.py's torch>=2.4,<2.15: at least the first, below the second


def _found(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _built(package) -> bool:
    """The package's own folders hold the native libraries the job loads (aio and the CPU Adam)."""
    folders = [pathlib.Path(p) for p in (package.submodule_search_locations or [])]
    return all(any(any(f.glob(pattern)) for f in folders) for pattern in ("_aio_cffi*.so", "_cpu_adam*.so"))


def _torch_supported() -> bool:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return True  # a torch without metadata (built from source): let the build say
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    return TORCH_RANGE[0] <= parts < TORCH_RANGE[1]


def needs() -> list:
    out = [] if _found("torch") else ["torch"]
    if not out and not _torch_supported():
        out.append("unsupported-torch")
    package = importlib.util.find_spec("infinity")
    if package is None or not _built(package):
        out.append("infinity")
        out += [] if all(map(_found, ("cffi", "pybind11", "setuptools", "wheel"))) else ["build-tools"]
    return out + ([] if _found("transformers") else ["transformers"])


if __name__ == "__main__":
    print("\n".join(needs()))
    sys.exit(0)
