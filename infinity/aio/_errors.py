"""The exception raised for every failed or short transfer, and for files that cannot open."""
import errno as _errno
import os
from typing import Optional

from ..errors import InfinityError, StorageError


class AioError(InfinityError, OSError):
    """A read or write that failed or came back short.

    Carries ``errno``, ``filename`` (the path), ``op`` ("read" / "write"), ``offset`` and
    ``length`` of the request and the message; an ``OSError``, so it can be caught as one.
    """

    strerror: str  # always set, by __init__ (OSError's may be None)

    def __init__(self, err: Optional[int], path: str, op: str, offset: int, length: int, detail: str = ""):
        self.op = op
        self.offset = offset
        self.length = length
        what = f"{op} of {length} bytes at offset {offset} of {path!r} failed: "
        reason = os.strerror(err) if err else "unknown error"
        if err == _errno.ENODATA and op == "read":
            reason = "end of file reached before all bytes were read"
        name = _errno.errorcode.get(err, str(err)) if err else str(err)
        super().__init__(err, f"{what}{reason} ({name}){detail}")
        self.filename = path

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return (_rebuild, (self.errno, self.filename, self.op, self.offset, self.length, self.strerror))


def _rebuild(err, path, op, offset, length, message):
    e = AioError(err, path, op, offset, length)
    e.strerror = message
    return e


class CorruptionError(AioError, StorageError):
    """Data read back from a swap file is not what was written there: a block's CRC32C
    differs (Note [swap checksums] in _checksum.py). ``offset`` / ``length`` are the request's,
    ``bad_offset`` / ``bad_length`` the first bad block's; the message says what the range
    holds and when it was read. Nothing was computed with the data."""

    def __init__(self, path: str, op: str, offset: int, length: int, bad_offset: int, bad_length: int,
                 holds: str = "", when: str = ""):
        AioError.__init__(self, _errno.EBADMSG, path, op, offset, length)
        self.bad_offset, self.bad_length = bad_offset, bad_length
        what = f" ({holds})" if holds else ""
        at = f" {when}" if when else ""
        self.strerror = (
            f"checksum mismatch in {path!r} at byte offset {bad_offset} ({bad_length} bytes){what}, read{at}: "
            f"the bytes read back differ from those written (a failing disk or controller, bad memory, or "
            f"something else writing into the swap file); they were not used. Check the disk (dmesg, smartctl) "
            f"and rerun; aio.checksums: false turns the check off")

    def __reduce__(self):
        return (_rebuild_corruption, (self.filename, self.op, self.offset, self.length, self.bad_offset,
                                      self.bad_length, self.strerror))


def _rebuild_corruption(path, op, offset, length, bad_offset, bad_length, message):
    e = CorruptionError(path, op, offset, length, bad_offset, bad_length)
    e.strerror = message
    return e
