"""Loads the cffi module built from native/aio, with a message that says how to build it."""
from ..errors import NativeLibraryMissing

try:
    from .._aio_cffi import ffi, lib  # noqa: F401
except ImportError as e:  # pragma: no cover - only on a broken install
    raise NativeLibraryMissing(
        "infinity.aio: the native module infinity._aio_cffi is not built; run "
        "`bash scripts/setup_env.sh` (or `pip install --no-build-isolation -e .`). In a clone's root after a plain "
        "`pip install .`, Python imports the clone's source folder instead of the installed package: run from "
        "another directory, or with `python -P`"
    ) from e

READ = 0
WRITE = 1
URING = 1
THREADS = 2
