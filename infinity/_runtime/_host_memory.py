"""Host memory this process may still take, and where the figure comes from.

Note [host memory available]: the kernel's ``MemAvailable`` (psutil's ``available``) is the
machine's figure. A process in a memory cgroup (a container, a Slurm or Kubernetes job, a
systemd slice) is killed by the kernel's OOM killer once the cgroup's usage passes its limit,
however much the machine has, so what it may still take is the smallest of ``MemAvailable``
and, for its cgroup and every cgroup above it, the limit less the usage that cannot be
reclaimed (the usage less its inactive file pages, as the kubelet counts a working set).
cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``) are both read; where no cgroup file can be read the figure is
``MemAvailable`` alone. ``available`` says which one bound it, for the messages that name it.
Every check of host room reads it: the preflight, ``Init``'s room, the train job's checks, the
automatic gradient and parameter caches, and an async save's host copy.
"""
from __future__ import annotations

import os
from typing import Iterator, List, Optional, Tuple

import psutil

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def available() -> Tuple[int, str]:
    """(bytes this process may still allocate in host memory, what bounds it)."""
    best, where = psutil.virtual_memory().available, "MemAvailable"
    for directory, limit, used in _cgroup_levels():
        if limit < UNLIMITED and limit - used < best:
            best, where = max(0, limit - used), f"the memory cgroup {directory}"
    return best, where


def peak_above_now() -> int:
    """Bytes this process held at its peak (VmHWM) beyond what it holds now (VmRSS): what the
    training steps so far took and gave back, and will take again."""
    try:
        with open("/proc/self/status") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                      if line.startswith(("VmHWM:", "VmRSS:"))}
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, fields.get("VmHWM", 0) - fields.get("VmRSS", 0))


def _cgroup_levels() -> Iterator[Tuple[str, int, int]]:
    """(directory, limit, usage less inactive file pages) of this process's memory cgroup and
    each one above it, up to the root of the hierarchy as mounted here."""
    for mount, path, v2 in _memory_cgroups():
        while True:
            directory = os.path.join(mount, path.lstrip("/"))
            level = _level(directory, v2)
            if level is not None:
                yield (directory, *level)
            if path in ("", "/"):
                break
            path = os.path.dirname(path)


def _level(directory: str, v2: bool) -> Optional[Tuple[int, int]]:
    limit_file, usage_file, inactive = (("memory.max", "memory.current", "inactive_file") if v2 else
                                        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    limit = _read(os.path.join(directory, limit_file))
    usage = _read(os.path.join(directory, usage_file))
    if limit is None or usage is None:
        return None
    return limit, max(0, usage - _stat(os.path.join(directory, "memory.stat"), inactive))


def _memory_cgroups() -> List[Tuple[str, str, bool]]:
    """(mount point, this process's cgroup path below it, v2?) of each memory hierarchy."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    out = []
    for fields in mounts:
        dash = fields.index("-") if "-" in fields else -1
        if dash < 0 or len(fields) < dash + 3:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
        v2 = fstype == "cgroup2"
        if not v2 and not (fstype == "cgroup" and "memory" in options.split(",")):
            continue
        for line in lines:
            if len(line) == 3 and ((v2 and line[0] == "0" and line[1] == "") or
                                   (not v2 and "memory" in line[1].split(","))):
                root = fields[3]  # the part of the hierarchy this mount shows
                path = line[2][len(root):] if root != "/" and line[2].startswith(root) else line[2]
                out.append((fields[4], path, v2))
    return out


def _read(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
