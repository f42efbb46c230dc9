"""infinity's log records kept for a test where pytest's ``caplog`` cannot reach them: inside
a rank's process, or around one block (the infinity logger does not propagate)."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List

import infinity


class Kept(logging.Handler):
    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> List[str]:
        return [r.getMessage() for r in self.records]


@contextlib.contextmanager
def kept_logs(level: int = logging.WARNING) -> Iterator[Kept]:
    """The infinity logger's records at ``level`` and above while the block runs."""
    handler = Kept(level)
    infinity.logger.addHandler(handler)
    try:
        yield handler
    finally:
        infinity.logger.removeHandler(handler)
