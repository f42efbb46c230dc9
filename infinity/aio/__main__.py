"""``python -P -m infinity.aio``: the I/O backend the installed native/aio library runs on this
machine (``io_uring``, or ``threads`` where it was built without liburing's headers or the kernel
refuses io_uring), then whether the other native libraries were built.

``-P`` (Python 3.11+) keeps the current directory off ``sys.path``: run from a clone's root
without it, ``import infinity`` finds the clone's source folder, which holds no built library,
before the installed package."""
from __future__ import annotations

import importlib.util
import sys

from . import AsyncIO


def main() -> int:
    print(AsyncIO().backend)
    for module, source in (("infinity._cpu_adam", "native/cpu_adam"), ("infinity._host_alloc", "native/host_alloc")):
        print(f"{source}: {'built' if importlib.util.find_spec(module) is not None else 'not built'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
