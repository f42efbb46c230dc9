"""``AsyncIO``: one native handle, its cache of open files, and the tensors it keeps alive.

Note: lifetime of submitted memory.
    ``pread``/``pwrite`` hand the tensor's raw pointer to native workers and return at once.
    The handle keeps a reference to the tensor, keyed by request id, until a ``wait`` has
    seen that request complete; the native side reports the first id not covered by the
    wait (its horizon) and only references below it are dropped. Memory is therefore never
    freed under the kernel, whichever thread submits and whichever thread waits.
"""
import errno as _errno
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .._runtime._log import logger
from ..errors import EngineError, UsageError, UsageTypeError, WaitTimeout
from ._checksum import BlockSums, sums_of
from ._errors import AioError, CorruptionError
from ._native import READ, THREADS, URING, WRITE, ffi, lib
from ._stripe import StripedPath, members_of, tally_of

_BACKENDS = {"auto": 0, "io_uring": URING, "threads": THREADS}
_ENV_BACKEND = "INFINITY_AIO_BACKEND"
_MAX_ERRORS = 64
_WARNED: List[str] = []  # fallback reasons already logged (once per process each)
_WAIT_SLICE_MS = 200  # a wait returns to Python this often, so a signal's handler can run: AsyncIO._wait_in_slices
_ABANDONED: List["AsyncIO"] = []  # handles closed with requests stuck past their timeout: never freed


@dataclass
class _File:
    """Both descriptors of one file: O_DIRECT (or -1 where refused) and buffered."""

    path: str
    fd_direct: int
    fd_buffered: int
    writable: bool


@dataclass
class _Pending:
    tensor: torch.Tensor
    op: str
    path: str
    offset: int
    length: int
    sums: Optional[BlockSums] = None  # kept alive while the request may use it


def _pieces(path, offset: int, nbytes: int) -> Iterator[Tuple[str, int, int, int]]:
    """``(file, offset in it, offset in the request, bytes)`` of a request: one piece, or one
    per extent of a striped file (Note [striped swap files] in _stripe.py)."""
    if isinstance(path, StripedPath):
        for member, at, start, n in path.pieces(offset, nbytes):
            yield path.members[member], at, start, n
    else:
        yield path, offset, 0, nbytes


def _table(path) -> Optional[BlockSums]:
    sums = sums_of(path)
    return sums if isinstance(sums, BlockSums) else None


def _resolve_backend(backend: Optional[str]) -> str:
    name = backend if backend is not None else os.environ.get(_ENV_BACKEND, "auto") or "auto"
    if name not in _BACKENDS:
        src = "backend" if backend is not None else _ENV_BACKEND
        raise UsageError(f"AsyncIO: {src}={name!r} is not one of {sorted(_BACKENDS)}")
    return name


def _check_int(name: str, value, low: int, high: int, multiple: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageTypeError(f"AsyncIO: {name} must be an int, got {type(value).__name__}")
    if not low <= value <= high or value % multiple:
        extra = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise UsageError(f"AsyncIO: {name} must be in [{low}, {high}]{extra}, got {value}")
    return value


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.append(message)
        logger.warning(message)


class AsyncIO:
    """Queues reads and writes of CPU tensors at byte offsets of files.

    ``block_size``: bytes per device request (a multiple of 4096); ``queue_depth``: requests
    in flight per thread; ``threads``: io_uring rings, each with its own thread; ``direct``:
    O_DIRECT where the file system allows it; ``fsync``: ``wait`` also flushes the files
    written since the previous wait; ``backend``: "io_uring", "threads" or "auto"/None
    (then ``INFINITY_AIO_BACKEND``, default auto: io_uring when it works).
    ``timeout``: the limit the engine's waits on this handle use (``aio.timeout``); ``wait``
    itself takes its own.

    Files are opened on first use and stay open until ``close``: a file deleted and
    re-created under the same path meanwhile is not seen by this handle. Failing to open a
    file raises ``AioError`` from ``pread``/``pwrite`` at once; failed transfers raise from
    ``wait``. A ``SwapPath`` (a swap file's path with its block sums) makes every transfer
    on it record or check checksums (Note [swap checksums] in _checksum.py).
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, threads: int = 1,
                 direct: bool = True, *, fsync: bool = False, backend: Optional[str] = None,
                 timeout: Optional[float] = None):
        self.block_size = _check_int("block_size", block_size, 4096, 1 << 30, 4096)
        self.queue_depth = _check_int("queue_depth", queue_depth, 1, 32768)
        self.threads = _check_int("threads", threads, 1, 256)
        self.direct = bool(direct)
        self.fsync_on_wait = bool(fsync)
        self.timeout = timeout  # the engine's waits (wait_io in _swap.py): seconds, None = its default
        requested = _resolve_backend(backend)
        out = ffi.new("infinity_aio **")
        why = ffi.new("char[512]")
        rc = lib.infinity_aio_create(_BACKENDS[requested], block_size, queue_depth, threads, out, why, 512)
        reason = ffi.string(why).decode(errors="replace")
        if rc < 0:
            raise EngineError(f"AsyncIO: backend {requested!r} is unavailable: "
                               f"{reason or os.strerror(-rc)}; use backend='threads' or 'auto'")
        self._h = out[0]
        self.backend = "io_uring" if lib.infinity_aio_backend(self._h) == URING else "threads"
        if reason:
            _warn_once(f"aio: io_uring unavailable ({reason}); using the thread-pool backend")
        self._lock = threading.Lock()
        self._files: Dict[Tuple[str, bool], _File] = {}
        self._pending: Dict[int, _Pending] = {}
        self._dirty: Dict[str, _File] = {}
        self._fallbacks_seen = 0
        self._closed = False

    # ---- files -------------------------------------------------------------------------
    def _open(self, path, writable: bool, op: str, offset: int, length: int) -> _File:
        """The cached descriptors of ``path``; the caller holds ``self._lock``."""
        path = os.path.abspath(os.fspath(path))
        f = self._files.get((path, writable)) or (self._files.get((path, True)) if not writable else None)
        if f is not None:
            return f
        flags = (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY
        flags |= os.O_CLOEXEC
        try:
            fd_buffered = os.open(path, flags, 0o644)
        except OSError as e:
            raise AioError(e.errno, path, op, offset, length, " (while opening the file)") from e
        fd_direct = -1
        if self.direct:
            try:
                fd_direct = os.open(path, (flags & ~os.O_CREAT) | os.O_DIRECT)
            except OSError as e:
                if e.errno != _errno.EINVAL:
                    os.close(fd_buffered)
                    raise AioError(e.errno, path, op, offset, length, " (while opening the file)") from e
                _warn_once(f"aio: the file system of {os.path.dirname(path)!r} refuses O_DIRECT "
                           f"(EINVAL); using buffered I/O for files there")
        f = _File(path, fd_direct, fd_buffered, writable)
        self._files[(path, writable)] = f
        return f

    def _close_files(self) -> None:
        for f in self._files.values():
            for fd in (f.fd_direct, f.fd_buffered):
                if fd >= 0:
                    os.close(fd)
        self._files.clear()
        self._dirty.clear()

    # ---- submission --------------------------------------------------------------------
    @staticmethod
    def _view(tensor, offset, name: str) -> Tuple[int, int]:
        if not isinstance(tensor, torch.Tensor):
            raise UsageTypeError(f"AsyncIO.{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise UsageError(f"AsyncIO.{name}: the tensor is on {tensor.device}; pass a CPU tensor "
                             "(e.g. from infinity.aio.aligned_empty)")
        if not tensor.is_contiguous():
            raise UsageError(f"AsyncIO.{name}: the tensor is not contiguous; pass tensor.contiguous() "
                             "(for reads, read into a contiguous buffer and copy)")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise UsageError(f"AsyncIO.{name}: offset must be an int >= 0, got {offset!r}")
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def _submit(self, op: int, tensor, path, offset: int, name: str) -> None:
        ptr, nbytes = self._view(tensor, offset, name)
        with self._lock:
            self._check_open()
            for file, at, start, n in _pieces(path, offset, nbytes):  # Note [striped swap files] in _stripe.py
                self._submit_piece(op, tensor, ptr + start, n, file, at)

    def _submit_piece(self, op: int, tensor, ptr: int, nbytes: int, path, offset: int) -> None:
        """One request on one file; the caller holds ``self._lock``."""
        what = "read" if op == READ else "write"
        sums = _table(path)
        f = self._open(path, op == WRITE, what, offset, nbytes)
        rid = lib.infinity_aio_submit(self._h, op, f.fd_direct, f.fd_buffered, ffi.cast("void *", ptr),
                                      nbytes, offset, sums.native if sums else ffi.NULL)
        if rid < 0:
            raise AioError(-rid, f.path, what, offset, nbytes, " (submission refused)")
        self._pending[rid] = _Pending(tensor, what, f.path, offset, nbytes, sums)
        tally = tally_of(path)
        if tally is not None:
            tally.add(op == WRITE, nbytes)
        if op == WRITE:
            self._dirty[f.path] = f

    def pread(self, tensor: torch.Tensor, path, offset: int = 0) -> None:
        """Queues a read of ``tensor.nbytes`` bytes of ``path`` at ``offset`` into ``tensor``."""
        self._submit(READ, tensor, path, offset, "pread")

    def pwrite(self, tensor: torch.Tensor, path, offset: int = 0) -> None:
        """Queues a write of ``tensor``'s bytes to ``path`` at ``offset`` (creating the file)."""
        self._submit(WRITE, tensor, path, offset, "pwrite")

    def _sync(self, op: int, tensor, path, offset: int, name: str) -> int:
        ptr, nbytes = self._view(tensor, offset, name)
        for file, at, start, n in _pieces(path, offset, nbytes):  # Note [striped swap files] in _stripe.py
            self._sync_piece(op, tensor, ptr + start, n, file, at)
        return nbytes

    def _sync_piece(self, op: int, tensor, ptr: int, nbytes: int, path, offset: int) -> None:
        what = "read" if op == READ else "write"
        sums = _table(path)
        with self._lock:
            self._check_open()
            f = self._open(path, op == WRITE, what, offset, nbytes)
        err = ffi.new("infinity_aio_error *")
        rc = lib.infinity_aio_rw(self._h, op, f.fd_direct, f.fd_buffered, ffi.cast("void *", ptr),
                                 nbytes, offset, sums.native if sums else ffi.NULL, err)
        self._note_fallbacks()
        if rc < 0:
            raise self._failure(err, _Pending(tensor, what, f.path, offset, nbytes, sums), "")
        tally = tally_of(path)
        if tally is not None:
            tally.add(op == WRITE, nbytes)
        if op == WRITE and self.fsync_on_wait:
            os.fsync(f.fd_buffered)

    def sync_pread(self, tensor: torch.Tensor, path, offset: int = 0) -> int:
        """Reads into ``tensor`` and returns the bytes read once they are there."""
        return self._sync(READ, tensor, path, offset, "sync_pread")

    def sync_pwrite(self, tensor: torch.Tensor, path, offset: int = 0) -> int:
        """Writes ``tensor`` and returns the bytes written once the write completed."""
        return self._sync(WRITE, tensor, path, offset, "sync_pwrite")

    # ---- completion --------------------------------------------------------------------
    @staticmethod
    def _piece_detail(err, offset: int, length: int) -> str:
        if err.offset == offset and err.length == length and err.transferred == 0:
            return ""
        return (f" (the piece at offset {err.offset}, {err.length} bytes, "
                f"failed after {err.transferred} bytes)")

    def wait(self, timeout: Optional[float] = None, what: str = "") -> int:
        """Blocks until every request submitted so far has finished; returns how many finished.

        Raises ``AioError`` for the first failed request (after all of them drained); the
        handle stays usable. Safe to call from a thread other than the submitter's.

        ``timeout``: seconds to wait at most (None: no limit). When it passes first,
        ``TimeoutError`` names the requests still in flight, their files and ``what`` (the
        caller's words for what was being waited for); nothing is collected or dropped, so a
        later ``wait`` completes normally.
        """
        self._check_open()
        if timeout is not None:
            self._wait_for(timeout, what)
        errs = ffi.new("infinity_aio_error[]", _MAX_ERRORS)
        n_errs = ffi.new("int32_t *")
        horizon = ffi.new("int64_t *")
        done = lib.infinity_aio_wait(self._h, errs, _MAX_ERRORS, n_errs, horizon)
        with self._lock:
            failed = [(errs[i], self._pending.get(errs[i].id)) for i in range(min(n_errs[0], _MAX_ERRORS))]
            for rid in [r for r in self._pending if r < horizon[0]]:
                del self._pending[rid]
            dirty, self._dirty = (dict(self._dirty), {}) if self.fsync_on_wait else ({}, self._dirty)
        self._note_fallbacks()
        for f in dirty.values():
            os.fsync(f.fd_buffered)
        if n_errs[0]:
            raise self._error(failed, n_errs[0])
        return int(done)

    def _wait_for(self, timeout, what: str) -> None:
        """Waits up to ``timeout`` seconds without collecting anything; raises TimeoutError."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise UsageTypeError(f"AsyncIO.wait: timeout must be a number of seconds or None, "
                            f"got {type(timeout).__name__}")
        if math.isnan(timeout) or timeout < 0:
            raise UsageError(f"AsyncIO.wait: timeout must be >= 0 seconds (or None for no limit), got {timeout}")
        if not isinstance(what, str):
            raise UsageTypeError(f"AsyncIO.wait: what must be a str describing what is waited for, "
                            f"got {type(what).__name__}")
        # Rounded up: a positive timeout never degenerates into a mere look.
        ms = -1 if math.isinf(timeout) else min(math.ceil(timeout * 1000), 1 << 62)
        with self._lock:
            covered = set(self._pending)
        start = time.monotonic()
        if self._wait_in_slices(ms, start):
            return
        waited = time.monotonic() - start
        stuck = self._stuck(covered)
        if stuck:  # none left means they finished just after the deadline: not a timeout
            raise WaitTimeout(self._timeout_message(stuck, timeout, waited, what,
                                                    int(lib.infinity_aio_ring_error(self._h))))

    def _wait_in_slices(self, ms: int, start: float) -> bool:
        """Whether every request landed within ``ms`` (-1: no limit). The native wait holds the
        calling thread until it returns, and a signal's handler runs on the main thread only
        between two Python instructions, so one long wait on a hung disk would hold off Ctrl-C
        for the whole timeout: the wait is cut in slices of ``_WAIT_SLICE_MS`` (Note [interrupted
        step] in infinity/_zero/_step_gate.py). A slice ends as soon as the requests land."""
        while True:
            left = ms if ms < 0 else max(ms - int((time.monotonic() - start) * 1000), 0)
            if lib.infinity_aio_wait_for(self._h, _WAIT_SLICE_MS if left < 0 else min(left, _WAIT_SLICE_MS)):
                return True
            if 0 <= left <= _WAIT_SLICE_MS:
                return False

    def _stuck(self, covered) -> List[_Pending]:
        """The requests among ``covered`` (ids) that are still in flight, oldest first."""
        n = int(lib.infinity_aio_in_flight(self._h))
        while True:
            ids = ffi.new("int64_t[]", max(n, 1))
            total = int(lib.infinity_aio_in_flight_ids(self._h, ids, n))
            if total <= n:
                break
            n = total  # more were submitted meanwhile: ask again with room for all
        with self._lock:
            return [self._pending[i] for i in ids[0:total] if i in covered and i in self._pending]

    @staticmethod
    def _timeout_message(stuck: List[_Pending], timeout: float, waited: float, what: str,
                         ring_error: int = 0) -> str:
        per_file: Dict[str, List[_Pending]] = {}
        for req in stuck:
            per_file.setdefault(req.path, []).append(req)
        files = []
        for path, reqs in list(per_file.items())[:8]:
            ops = "/".join(sorted({r.op for r in reqs}))
            files.append(f"{path!r} ({len(reqs)} {ops}(s), {sum(r.length for r in reqs)} bytes)")
        if len(per_file) > 8:
            files.append(f"and {len(per_file) - 8} more file(s)")
        target = f" for {what}" if what else ""
        if ring_error:
            target += (f"; entering io_uring has been failing with {_errno.errorcode.get(-ring_error, ring_error)} "
                       f"({os.strerror(-ring_error)}), retried with pauses")
        return (f"AsyncIO.wait: {len(stuck)} request(s) still in flight after waiting {waited:.3g} s "
                f"(timeout={timeout:g} s){target}, on {', '.join(files)}. Check for a hung or very slow "
                f"disk (dmesg for I/O errors, `iostat -x 1` for a device stuck at 100% util), or raise "
                f"the timeout. The requests stay queued: a later wait() collects them.")

    def _error(self, failed, count: int) -> AioError:
        err, req = failed[0]
        detail = ""
        if count > 1:
            path = req.path if req else None
            others = sorted({p.path for _, p in failed[1:] if p is not None and p.path != path})
            detail = f"; {count - 1} more request(s) failed" + (f" (also on {others})" if others else "")
        return self._failure(err, req, detail)

    def _failure(self, err, req: Optional[_Pending], detail: str) -> AioError:
        """The exception for one failed request: CorruptionError for a checksum mismatch."""
        path, op = (req.path, req.op) if req else ("<unknown file>", "read" if err.op == READ else "write")
        offset, length = (req.offset, req.length) if req else (err.offset, err.length)
        if err.err == _errno.EBADMSG and req is not None and req.sums is not None:
            sums = req.sums
            e = CorruptionError(path, op, offset, length, int(err.offset), int(err.length),
                                sums.describe(int(err.offset)), sums.when())
            e.strerror += detail
            return e
        return AioError(err.err, path, op, offset, length, self._piece_detail(err, offset, length) + detail)

    def _note_fallbacks(self) -> None:
        n = lib.infinity_aio_direct_fallbacks(self._h)
        if n > self._fallbacks_seen:
            self._fallbacks_seen = n
            _warn_once("aio: O_DIRECT refused a request (EINVAL); retried it through buffered I/O")

    def fsync(self, path=None) -> None:
        """Waits for everything in flight, then flushes ``path`` (or every file written) to disk."""
        self.wait()
        with self._lock:
            if path is None:
                files = list(self._dirty.values()) or [f for f in self._files.values() if f.writable]
                self._dirty.clear()
            else:
                files = []
                for member in members_of(path):  # a striped file: every member
                    key = os.path.abspath(os.fspath(member))
                    f = self._files.get((key, True)) or self._files.get((key, False))
                    if f is None:
                        raise UsageError(f"AsyncIO.fsync: {key!r} was never opened by this handle")
                    files.append(f)
                    self._dirty.pop(key, None)
        for f in files:
            os.fsync(f.fd_buffered)

    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        self._check_open()
        return int(lib.infinity_aio_in_flight(self._h))

    # ---- lifetime ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("AsyncIO: the handle is closed; create a new one")

    def close(self) -> None:
        """Finishes everything in flight, closes the files and frees the native handle.

        Raises ``AioError`` if requests that nobody waited for failed. With a ``timeout``, a
        request still in flight after it (a hung disk) does not hang the caller: the handle is
        abandoned instead, with its memory and the tensors of those requests kept alive for
        good (the kernel may still write into them), and an error is logged.
        """
        if self._closed:
            return
        if self.timeout is not None and not lib.infinity_aio_wait_for(self._h, math.ceil(self.timeout * 1000)):
            with self._lock:
                self._closed = True
                stuck = sorted({p.path for p in self._pending.values()})
            _ABANDONED.append(self)
            logger.error("aio: %d request(s) on %s still in flight %.3g s after close began; the handle is "
                         "abandoned (its buffers stay allocated) so that the process can go on",
                         int(lib.infinity_aio_in_flight(self._h)), stuck, self.timeout)
            return
        try:
            self.wait()
        finally:
            with self._lock:
                self._closed = True
                lib.infinity_aio_destroy(self._h)
                self._h = ffi.NULL
                self._pending.clear()
                self._close_files()

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            self.close()
        except Exception as e:  # no raising from a finalizer: say it instead
            logger.error("aio: a handle collected with unreported failures: %s", e)

    def __repr__(self) -> str:
        return (f"AsyncIO(block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"threads={self.threads}, direct={self.direct}, backend={self.backend!r})")


def close_handles(handles) -> None:
    """Note [closing handles]: the engine closes its stores' handles when it closes, instead of
    leaving them to the garbage collector (which a pending exception's frames can delay for
    good). Each close waits for what is in flight at most its ``timeout`` (``aio.timeout``);
    past it the handle is abandoned, as a hung disk must not hang the caller. Failures nobody
    waited for are logged: the run is being torn down, usually by an error already raised."""
    for h in handles:
        try:
            h.close()
        except Exception as e:  # noqa: BLE001 - teardown goes on
            logger.error("closing an I/O handle: %s", e)
