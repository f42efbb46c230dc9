"""Swap files on the NVMe tier: one directory per run and rank, removed on clean exit.

Note [swap directories]: every engine writes under ``<drive>/infinity-<run id>/rank<r>`` on
each drive of ``nvme_path`` it uses (Note [many drives] in _drives.py), with a fresh random run
id, the same on every drive, so a second run on the same ``nvme_path`` never reads the files
of a first (crashed or concurrent) one. The directory is removed when the engine is garbage
collected or the interpreter exits normally. A crashed run (``kill -9``, a power loss) leaves
it behind: each rank directory therefore holds an ``owner`` file (host, pid, process start
time) on which its process holds an exclusive flock for as long as it lives (the kernel drops
it when the process dies, however it dies), and the next run that uses the ``nvme_path``
removes the run directories whose every owner on this host is gone (``reclaim_stale``, on
every listed drive, also those this rank does not write to), before its preflight counts the
free space, and says what it removed and how much. Gone
means: the owner file's lock can be taken (a pid reused by another process does not fool
it), or, for a directory of an older layout without the lock, the pid is gone. The owner
file is written and locked under a temporary name and renamed into place, so a reclaimer
never sees an owner file that is not yet locked. Directories of live processes, or of other
hosts sharing the disk (whose locks this host cannot see), are left alone. The train job's
disk probe writes inside its run directory, so it goes with it. A missing ``nvme_path`` is
made only inside an existing directory that is not the filesystem root, and said: an NVMe
drive is a mount point that exists already, so a path whose parent is missing (a typo) or
that would sit at ``/`` (a placeholder such as ``/local_nvme``) is refused with what to set;
one that infinity made goes again with this process's last swap directory in it, so a run
refused or ended leaves the disk as it found it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import uuid
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .._runtime import _comm as comm
from .._runtime._log import logger
from ..aio import AsyncIO
from ..aio._checksum import SwapPath
from ..aio._stripe import DriveTally, StripedPath, member_bytes
from ..errors import StorageError, UsageError
from ._drives import NvmePath, local_rank, rank_drives


class SwapDir:
    """This run's directory for one rank on one drive; its files count their bytes in ``tally``."""

    def __init__(self, nvme_path: str, rank: int, run_id: Optional[str] = None):
        if not nvme_path:
            raise UsageError("NVMe offload needs nvme_path: set zero.offload_param.nvme_path / "
                             "zero.offload_optimizer.nvme_path to a directory on a fast local disk")
        self.rank = rank
        self.drive = nvme_path
        self.tally = DriveTally(nvme_path)  # Note [striped swap files] in aio/_stripe.py
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.path = os.path.join(os.path.abspath(nvme_path), f"infinity-{self.run_id}", f"rank{rank}")
        _make_nvme_path(nvme_path)
        try:
            reclaim_stale(nvme_path)
            os.makedirs(self.path, exist_ok=False)
            lock_fd = _write_owner(self.path)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create the swap directory {self.path}: {e.strerror} "
                                        f"({e.filename}); give a writable directory as nvme_path") from None
        _OURS.add(os.path.dirname(self.path))
        self._finalizer = weakref.finalize(self, _remove, os.path.dirname(self.path), self.path, lock_fd)

    def file(self, name: str, nbytes: int) -> str:
        """Create (preallocated to ``nbytes``) and return the path of a swap file, which counts
        its bytes in this drive's tally."""
        path = SwapPath(os.path.join(self.path, name), None, self.tally)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    raise StorageError(e.errno, f"cannot reserve {nbytes} bytes for swap file {path}: {e.strerror}; "
                                           f"free space under the nvme_path or point it at a larger disk") from e
        finally:
            os.close(fd)
        return path

    def remove(self) -> None:
        self._finalizer()


def _make_nvme_path(nvme_path: str, *, create: bool = True) -> str:
    """Note [swap directories]: ``nvme_path`` made when missing, one level only and never at /,
    and removed again by the last of this process's swap directories in it (``_MADE``).
    Without ``create`` only checked: the directory whose disk it will be on is returned (itself,
    or the parent it would be made in), so that a refusal for its room leaves nothing behind."""
    path = os.path.abspath(nvme_path)
    if os.path.isdir(path):
        return path
    parent = os.path.dirname(path)
    at_root = os.path.dirname(parent) == parent
    if at_root or not os.path.isdir(parent):
        where = "at the filesystem root" if at_root else f"in {parent}, which does not exist"
        raise UsageError(f"nvme_path {nvme_path!r} does not exist, and infinity does not create it {where}: set "
                         f"zero.offload_param.nvme_path / zero.offload_optimizer.nvme_path (--nvme-path) to a "
                         f"directory on a fast local drive, or create it first")
    if not create:
        return parent
    try:
        os.mkdir(path)
    except FileExistsError:
        return path  # another rank made it first (or it is a file: the swap directory's creation says so)
    except OSError as e:
        raise StorageError(e.errno, f"cannot create nvme_path {path}: {e.strerror}; give a writable directory "
                                    f"as nvme_path") from None
    logger.info("created nvme_path %s", path)
    _MADE.add(path)
    return path


class StripedSwap:
    """This run's swap directories on several drives, each swap file striped over them (Note
    [striped swap files] in aio/_stripe.py); each file's members start one drive further on."""

    def __init__(self, dirs: List[SwapDir], extent: int):
        self.dirs, self.extent, self.rank = list(dirs), extent, dirs[0].rank
        self._made = 0

    def file(self, name: str, nbytes: int) -> StripedPath:
        n = len(self.dirs)
        first, self._made = self._made % n, self._made + 1
        order = self.dirs[first:] + self.dirs[:first]
        return StripedPath([d.file(name, member_bytes(nbytes, self.extent, n, i)) for i, d in enumerate(order)],
                           self.extent)

    def remove(self) -> None:
        for d in self.dirs:
            d.remove()


Swap = Union[SwapDir, StripedSwap]  # where one store's swap files go: one drive, or striped over several


class SwapDirs:
    """This run's swap directory on each drive it uses, made on first use; removed together.
    ``under(nvme_path)`` is where a store's files go: the one drive the rank uses of that
    ``nvme_path``, or all of them striped (Note [many drives] in _drives.py)."""

    def __init__(self, rank: int, layout: str = "per_rank", stripe_size: int = 8 << 20,
                 rank_on_node: Optional[int] = None):
        self._rank = rank
        self._layout, self._extent = layout, stripe_size
        self._rank_on_node = local_rank() if rank_on_node is None else rank_on_node
        self._run_id = uuid.uuid4().hex[:12]  # the same run directory name on every drive
        self._dirs: Dict[str, SwapDir] = {}
        self._striped: Dict[Tuple[str, ...], StripedSwap] = {}

    @classmethod
    def of(cls, cfg, rank: int) -> "SwapDirs":
        return cls(rank, cfg.zero.nvme_layout, cfg.zero.nvme_stripe_size)

    def under(self, nvme_path: NvmePath) -> Swap:
        drives = rank_drives(nvme_path, self._layout, self._rank_on_node)
        for d in drives:
            if d not in self._dirs:
                self._dirs[d] = SwapDir(d, self._rank, self._run_id)
        if len(drives) == 1:
            return self._dirs[drives[0]]
        if drives not in self._striped:
            self._striped[drives] = StripedSwap([self._dirs[d] for d in drives], self._extent)
        return self._striped[drives]

    def values(self):
        """The swap directory on each drive this rank uses."""
        return self._dirs.values()

    def drive_bytes(self) -> Dict[str, Tuple[int, int]]:
        """(read, written) bytes of this rank's swap files on each drive so far."""
        return {d: (s.tally.read, s.tally.written) for d, s in self._dirs.items()}

    def drive_totals(self, drives: Sequence[str]) -> Dict[str, int]:
        """The engine's telemetry of each drive ``drives[k]`` this rank uses: ``drive<k>_read_bytes``
        and ``drive<k>_write_bytes`` (no tier's name in them: the stores' ``nvme_*`` bytes count the
        tier's traffic; Note [engine telemetry keys] in _telemetry.py)."""
        out = {}
        for k, drive in enumerate(drives):
            if drive in self._dirs:
                tally = self._dirs[drive].tally
                out[f"drive{k}_read_bytes"], out[f"drive{k}_write_bytes"] = tally.read, tally.written
        return out

    def remove(self) -> None:
        for d in self._dirs.values():
            d.remove()


def _write_owner(rank_dir: str) -> int:
    """Note [swap directories]: the owner file, locked before it appears under its name;
    returns the descriptor that holds the lock (closed when the directory is removed)."""
    tmp = os.path.join(rank_dir, OWNER + ".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, _owner_line(os.getpid()).encode())
    os.rename(tmp, os.path.join(rank_dir, OWNER))
    return fd


def _remove(run_dir: str, rank_dir: str, lock_fd: int = -1) -> None:
    shutil.rmtree(rank_dir, ignore_errors=True)
    _OURS.discard(run_dir)
    if lock_fd >= 0:
        os.close(lock_fd)  # after the removal: no reclaimer takes a directory still being removed
    made = os.path.dirname(run_dir)
    for path in (run_dir, made) if made in _MADE else (run_dir,):  # the last rank out removes the run directory,
        try:  # and the nvme_path this process made once nothing is left in it
            os.rmdir(path)
        except OSError:
            pass
        else:
            _MADE.discard(path)


OWNER = "owner"  # in each rank directory: "<host> <pid> <process start time>"
PROBE_PREFIX = "infinity-probe-"  # the train job's disk probe file: infinity-probe-<pid>.bin


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_line(pid: int) -> str:
    return f"{socket.gethostname()} {pid} {_start_time(pid)}\n"


def _owner_gone(rank_dir: str) -> bool:
    """The process that owned ``rank_dir`` ran on this host and is gone (a recycled pid does
    not count as alive: its start time differs)."""
    try:
        fd = os.open(os.path.join(rank_dir, OWNER), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # not ours to judge (older layout, or being created right now)
    try:
        try:
            host, pid, started = os.read(fd, 4096).decode().split()
        except (OSError, ValueError, UnicodeDecodeError):
            return False
        if host != socket.gethostname():
            return False  # another host's: its lock is not visible from here
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner holds the lock: alive
        except OSError:
            pass  # no flock on this file system: judge by the pid
        else:
            return True  # nobody holds the lock: the owner is gone
        if not os.path.exists("/proc/self/stat"):
            return False  # no way to tell here
        now = _start_time(int(pid))
        return now is None or (started != "None" and now != started)
    finally:
        os.close(fd)


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (those that vanish meanwhile count nothing)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def reclaim_stale(nvme_path: str) -> list:
    """Note [swap directories]: remove what crashed runs on this host left under
    ``nvme_path``; return (path, bytes) of what was removed."""
    removed: list = []
    try:
        entries = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in entries:
        path = os.path.join(nvme_path, name)
        if name.startswith("infinity-") and os.path.isdir(path):
            ranks = [os.path.join(path, r) for r in os.listdir(path) if r.startswith("rank")]
            if ranks and all(_owner_gone(r) for r in ranks):
                removed.append((path, dir_bytes(path)))
                shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(PROBE_PREFIX) and name.endswith(".bin"):
            pid = name[len(PROBE_PREFIX):-len(".bin")]
            if pid.isdigit() and _start_time(int(pid)) is None:
                removed.append((path, dir_bytes(path)))
                try:
                    os.remove(path)
                except OSError:
                    pass
    if removed:
        total = sum(n for _, n in removed)
        logger.warning("reclaimed %.1f MiB (%d bytes) under %s left by crashed runs: removed %d swap director%s and "
                       "probe files (%s)", total / (1 << 20), total, nvme_path, len(removed),
                       "y" if len(removed) == 1 else "ies", ", ".join(os.path.basename(p) for p, _ in removed))
    return removed


_OURS: set = set()  # the run directories this process's swap directories are in
_MADE: set = set()  # the nvme_paths this process made (Note [swap directories])


def stale_elsewhere(nvme_path: str, *, ours: bool = False) -> list:
    """Run directories under ``nvme_path`` that are not this process's and were not
    reclaimed (live runs, other hosts): named by a refusal for lack of disk space.
    ``ours``: this process's own instead (an Init's shards, until ``initialize`` moves them)."""
    try:
        names = [n for n in os.listdir(nvme_path) if n.startswith("infinity-")]
    except OSError:
        return []
    root = os.path.abspath(nvme_path)
    return [n for n in names if (os.path.join(root, n) in _OURS) == ours]


def new_aio(cfg, *, backend: Optional[str] = None):
    """An AsyncIO handle configured from the ``aio`` config section."""
    return AsyncIO(block_size=cfg.block_size, queue_depth=cfg.queue_depth, threads=cfg.threads,
                   direct=cfg.direct, backend=backend or cfg.backend, timeout=cfg.timeout)


def wait_io(handle, what: str) -> None:
    """Wait for a handle's requests, at most its ``timeout`` (``aio.timeout``), else the
    engine's wait timeout (INFINITY_COMM_TIMEOUT seconds); a timeout raises TimeoutError
    naming ``what`` and the files still in flight."""
    handle.wait(timeout=handle.timeout if handle.timeout is not None else comm.timeout_s(), what=what)


def nbytes_of(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()
