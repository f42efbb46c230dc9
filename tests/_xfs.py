"""A loop-mounted XFS with reflink, made by the test itself, for the cloned-checkpoint tests.

``xfs_mount(base)`` yields a mount point on a fresh 1.5 GiB XFS image under ``base`` (a sparse
file: only what is written takes disk), and unmounts it however the test ends (``mount -o
loop`` attaches the loop device with autoclear, so unmounting detaches it; a device still
attached is detached by name). It skips, with the reason, when not root or when xfsprogs or
loop devices are missing (``scripts/setup_env.sh`` installs xfsprogs when root).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

IMAGE_BYTES = 1536 << 20


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)


def skip_reason() -> str:
    """'' when this machine can make and mount an XFS image, else why not."""
    if os.geteuid() != 0:
        return "mounting a loop XFS needs root"
    if shutil.which("mkfs.xfs") is None:
        return "mkfs.xfs is missing: install xfsprogs (scripts/setup_env.sh does as root)"
    if shutil.which("mount") is None or not os.path.exists("/dev/loop-control"):
        return "no loop devices here (/dev/loop-control missing)"
    return ""


@contextlib.contextmanager
def xfs_mount(base: str):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    image, point = os.path.join(base, "xfs.img"), os.path.join(base, "xfs")
    os.makedirs(point, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(IMAGE_BYTES)
    made = _run("mkfs.xfs", "-q", "-f", "-m", "reflink=1", image)
    if made.returncode != 0:
        pytest.skip(f"mkfs.xfs -m reflink=1 failed: {made.stderr.strip()}")
    mounted = _run("mount", "-o", "loop", image, point)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount the XFS image: {mounted.stderr.strip()}")
    try:
        yield point
    finally:
        if _run("umount", point).returncode != 0:
            _run("umount", "-l", point)
        for line in _run("losetup", "-j", image).stdout.splitlines():
            _run("losetup", "-d", line.split(":", 1)[0])
        os.unlink(image)
