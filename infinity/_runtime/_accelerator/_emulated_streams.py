"""Streams and events of the emulated device (Note [emulated accelerator] in _emulated.py):
each stream a queue run in order by its own thread (``emu-stream-*``), an event a point in a
stream, and the random delay after which each queued copy lands (``set_delay``)."""
from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
import weakref
from typing import Optional

import torch

from ...errors import EngineError

_delay = (0.0005, 0.004)  # seconds: each queued copy lands after a random delay in this range
_rng = random.Random(int(os.environ.get("INFINITY_EMULATED_SEED", "0")))


def set_delay(low: float, high: Optional[float] = None) -> None:
    """Each queued copy lands after a random delay in [low, high] seconds (high defaults to low)."""
    global _delay
    _delay = (float(low), float(low if high is None else high))


@contextlib.contextmanager
def copy_delay(low: float, high: Optional[float] = None):
    """``set_delay`` inside the block; the delay before it afterwards (tests that slow copies)."""
    before = _delay
    set_delay(low, high)
    try:
        yield
    finally:
        set_delay(*before)


_op_time = {"delay": 0.0, "busy": 0, "run": 0}  # seconds each operator takes; running now; run so far
_op_time_lock = threading.Lock()


@contextlib.contextmanager
def compute_delay(seconds: float):
    """Inside the block every operator on the device takes ``seconds`` more, sleeping (the
    GIL released) as a GPU's kernel runs while its host is free: tests of what the host does
    meanwhile (the overlapped step). ``computing()`` says whether one is running now,
    ``operators_run()`` how many have run in the process."""
    before = _op_time["delay"]
    _op_time["delay"] = float(seconds)
    try:
        yield
    finally:
        _op_time["delay"] = before


def computing() -> bool:
    """Whether an operator is running on the device now (``compute_delay``)."""
    return _op_time["busy"] > 0


def operators_run() -> int:
    """Operators run on the device so far (every one, with or without ``compute_delay``)."""
    return int(_op_time["run"])


def run_compute() -> None:
    """An operator's time on the device (nothing unless ``compute_delay`` set one)."""
    delay = _op_time["delay"]
    with _op_time_lock:
        _op_time["run"] += 1
        if delay <= 0:
            return
        _op_time["busy"] += 1
    try:
        time.sleep(delay)
    finally:
        with _op_time_lock:
            _op_time["busy"] -= 1


def sleep_copy_delay() -> None:
    """A queued copy's wait between poisoning its destination and writing it."""
    low, high = _delay
    if high > 0:
        time.sleep(_rng.uniform(low, high))


class Stream:
    """A queue of copies and waits, run in order by its own thread."""

    def __init__(self, name: str = "side"):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"emu-stream-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                item()
            except BaseException as e:  # surfaced at the next synchronize on this stream
                self._error = e
            del item  # a copy's tensors are free once it landed, not when the next one comes (memory statistics)
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def enqueue(self, item) -> None:
        with self._cv:
            self._pending += 1
        self._queue.put(item)

    def query(self) -> bool:
        return self._pending == 0

    def synchronize(self) -> None:
        if self._pending:
            with self._cv:
                while self._pending:
                    self._cv.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise EngineError(f"emulated stream {self.name}: a queued operation failed") from error

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, other: "Stream") -> None:
        if other is not self:
            self.wait_event(other.record_event())

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<emulated stream {self.name}>"


class Event:
    """Marks a point in a stream: done once everything queued before it has run."""

    def __init__(self, *args, **kwargs):
        self._done: Optional[threading.Event] = None  # None: never recorded, which counts as done (as on CUDA)

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = current_stream() if stream is None else stream
        done = threading.Event()
        self._done = done
        stream.enqueue(done.set)

    def query(self) -> bool:
        return self._done is None or self._done.is_set()

    def synchronize(self) -> None:
        if self._done is not None:
            self._done.wait()

    def wait(self, stream: Optional[Stream] = None) -> None:
        stream = current_stream() if stream is None else stream
        done = self._done
        if done is not None and not done.is_set():
            stream.enqueue(done.wait)


_compute: Optional[Stream] = None
_compute_lock = threading.Lock()
_local = threading.local()


def default_stream() -> Stream:
    global _compute
    if _compute is None:
        with _compute_lock:
            if _compute is None:
                _compute = Stream("compute")
    return _compute


def current_stream() -> Stream:
    return getattr(_local, "stream", None) or default_stream()


@contextlib.contextmanager
def stream(s: Optional[Stream]):
    before = getattr(_local, "stream", None)
    if s is not None:
        _local.stream = s
    try:
        yield
    finally:
        _local.stream = before


_streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()


def new_stream() -> Stream:
    s = Stream("side")
    _streams.add(s)
    return s


def synchronize() -> None:
    default_stream().synchronize()
    for s in list(_streams):
        s.synchronize()


def record_stream(t: torch.Tensor, s) -> None:
    pass  # a queued copy holds its tensors until it lands: memory is never reused under it
