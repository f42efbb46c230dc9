"""A real memory limit for one test process: a fresh memory cgroup below its own.

``memory_limit(headroom)`` moves the calling process into a new child of its memory cgroup
(v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) whose limit is the child's usage plus
``headroom`` bytes, so that the process may allocate about ``headroom`` more before the
kernel's OOM killer ends it, and moves it back and removes the cgroup however the block
ends. It skips, with the reason, when not root or when no memory cgroup can be made here.
"""
from __future__ import annotations

import contextlib
import os
import uuid

import pytest


def _own_memory_cgroup():
    """(directory of this process's memory cgroup, v2?) or None."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for hierarchy, controllers, path in lines:
        if "memory" in controllers.split(","):
            return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), False
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and os.path.exists(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.max")):
            return os.path.join("/sys/fs/cgroup", path.lstrip("/")), True
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def memory_limit(headroom: int):
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup of the test's own needs root")
    own = _own_memory_cgroup()
    if own is None:
        pytest.skip("no memory cgroup controller here (/proc/self/cgroup names none)")
    parent, v2 = own
    child = os.path.join(parent, f"infinity-test-{uuid.uuid4().hex[:8]}")
    limit, usage = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    try:
        os.mkdir(child)
        if not os.path.exists(os.path.join(child, limit)):
            raise OSError(0, f"the new cgroup has no {limit} (memory not enabled below {parent})")
        _write(os.path.join(child, "cgroup.procs"), str(os.getpid()))
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(child)
        pytest.skip(f"cannot make a memory cgroup under {parent}: {e.strerror}")
    try:
        with open(os.path.join(child, usage)) as f:
            used = int(f.read())
        _write(os.path.join(child, limit), str(used + headroom))
        yield child
    finally:
        _write(os.path.join(parent, "cgroup.procs"), str(os.getpid()))
        os.rmdir(child)


def skip_unless_memory_limits() -> None:
    """Skip the calling test, with the reason, where ``memory_limit`` cannot make a cgroup. For
    a test whose rank uses ``memory_limit``: a skip raised inside a rank would come back to the
    test as the rank's failure, so the test probes here, in its own process, first."""
    with memory_limit(1 << 30):
        pass
