"""Cloning a file range instead of copying it, where the filesystem shares extents.

Note [cloned ranges]: on XFS with reflink and on btrfs, ``FICLONERANGE`` makes a range of one
file refer to the same disk blocks as a range of another: no data moves, only metadata, and a
later write to either file goes to fresh blocks (copy-on-write), so the other keeps its bytes.
The kernel takes block-aligned offsets and a block-aligned length, except a range that ends at
the source's end of file; ``clone_range`` clones the aligned body and copies the unaligned tail
(under one block). The data of the source must be on the file before the clone: O_DIRECT
writes that have completed are (callers wait for their writes first); the clone's metadata is
durable once the destination is fsynced, and that fsync also flushes the disk's write cache
under the shared blocks. Where the two paths are on different filesystems (EXDEV) or the
filesystem cannot share extents (EOPNOTSUPP, EINVAL: ext4, tmpfs, XFS without reflink),
``clone_support`` says so in words and callers copy instead.
"""
from __future__ import annotations

import errno
import fcntl
import os
import struct
import uuid
from dataclasses import dataclass

from ..errors import StorageError

FICLONE = 0x40049409
FICLONERANGE = 0x4020940D  # struct file_clone_range {s64 src_fd; u64 src_offset, src_length, dest_offset}


@dataclass(frozen=True)
class CloneSupport:
    """Whether files under ``src_dir`` can be cloned into ``dst_dir``; ``reason`` in words."""

    ok: bool
    reason: str


def _why(e: OSError, src_dir: str, dst_dir: str) -> str:
    if e.errno == errno.EXDEV:
        return f"{src_dir} and {dst_dir} are on different filesystems"
    if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS):
        return f"the filesystem of {dst_dir} ({fs_type(dst_dir)}) cannot share extents (no reflink)"
    return f"cloning failed there: {e.strerror}"


def fs_type(path: str) -> str:
    """The type of the filesystem that holds ``path`` (from /proc/self/mounts), or 'unknown'."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return "unknown"
    path = os.path.realpath(path)
    best = ("", "unknown")
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
            best = (point, kind)
    return best[1]


def clone_support(src_dir: str, dst_dir: str) -> CloneSupport:
    """Try cloning one block from a scratch file in ``src_dir`` to one in ``dst_dir``."""
    tag = uuid.uuid4().hex[:8]
    src, dst = os.path.join(src_dir, f".clone-probe-{tag}"), os.path.join(dst_dir, f".clone-probe-{tag}.dst")
    try:
        with open(src, "wb") as f:
            f.write(b"\0" * 4096)
        clone_range(src, 0, dst, 0, 4096)
        return CloneSupport(True, f"{fs_type(dst_dir)} shares extents between {src_dir} and {dst_dir}")
    except OSError as e:
        return CloneSupport(False, _why(e, src_dir, dst_dir))
    finally:
        for p in (src, dst):
            try:
                os.unlink(p)
            except OSError:
                pass


def clone_range(src: str, src_offset: int, dst: str, dst_offset: int, nbytes: int, *, create: bool = True) -> None:
    """Make bytes [dst_offset, dst_offset + nbytes) of ``dst`` share the blocks of
    [src_offset, src_offset + nbytes) of ``src`` (Note [cloned ranges]); ``create``: ``dst`` is
    created or truncated first. The offsets must be aligned to the filesystem's block; a tail
    under one block is copied. Raises OSError (EXDEV, EOPNOTSUPP, ...) if it cannot, and
    StorageError (an OSError too) for misaligned offsets or a short source."""
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, flags, 0o644)
        try:
            block = os.fstatvfs(dfd).f_bsize
            if src_offset % block or dst_offset % block:
                raise StorageError(errno.EINVAL, f"clone offsets {src_offset}, {dst_offset} are not multiples of the "
                                            f"filesystem block ({block} bytes)")
            body = nbytes - nbytes % block
            if body:
                fcntl.ioctl(dfd, FICLONERANGE, struct.pack("qQQQ", sfd, src_offset, body, dst_offset))
            _copy(sfd, src_offset + body, dfd, dst_offset + body, nbytes - body)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _copy(sfd: int, src_offset: int, dfd: int, dst_offset: int, nbytes: int) -> None:
    while nbytes > 0:
        data = os.pread(sfd, nbytes, src_offset)
        if not data:
            raise StorageError(errno.ENODATA, "the source file ends before the range to clone")
        os.pwrite(dfd, data, dst_offset)
        src_offset, dst_offset, nbytes = src_offset + len(data), dst_offset + len(data), nbytes - len(data)
