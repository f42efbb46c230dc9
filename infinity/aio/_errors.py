"""The exception raised for every failed or short transfer, and for files that cannot open."""
import errno as _errno
import os

from ..errors import InfinityError


class AioError(InfinityError, OSError):
    """A read or write that failed or came back short.

    Carries ``errno``, ``filename`` (the path), ``op`` ("read" / "write"), ``offset`` and
    ``length`` of the request and the message; an ``OSError``, so it can be caught as one.
    """

    def __init__(self, err: int, path: str, op: str, offset: int, length: int, detail: str = ""):
        self.op = op
        self.offset = offset
        self.length = length
        what = f"{op} of {length} bytes at offset {offset} of {path!r} failed: "
        reason = os.strerror(err) if err else "unknown error"
        if err == _errno.ENODATA and op == "read":
            reason = "end of file reached before all bytes were read"
        name = _errno.errorcode.get(err, str(err))
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
