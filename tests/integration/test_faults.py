"""Fault injection at the I/O layer during real training (no device-mapper needed).

A tiny GPT-2 trains with every state on NVMe (parameters, master weights, both moments and
the gradients each in a swap file, streamed: ``host_cache: 0``); after one clean step a rule
of ``infinity.testing.inject_io_fault`` makes the next transfer on one swap file fail (EIO,
ENOSPC), come back short, stall past ``aio.timeout``, or deliver flipped or zeroed bytes.
Every case ends in a named error (the file, the operation, errno or the checksum mismatch)
within a bounded time, no loss before it is NaN, and ``close`` removes the swap directory.

``python tests/integration/test_faults.py`` prints the table of fault x where x outcome x time to error.
"""
import errno
import faulthandler
import gc
import math
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers
from _configs import streamed_nvme_config  # noqa: E402
from _models import gpt2, train_into  # noqa: E402

import infinity  # noqa: E402
from infinity.aio import AioError, CorruptionError  # noqa: E402
from infinity.aio._handle import _ABANDONED  # noqa: E402
from infinity.errors import WaitTimeout  # noqa: E402
from infinity.testing import inject_io_fault  # noqa: E402

IO_TIMEOUT = 1.0  # aio.timeout of these runs: a stalled request must end in WaitTimeout after it
STALL_MS = 30000  # longer than the hang guard allows for close to wait: close must abandon the handle
HANG_GUARD = 300  # seconds: a case that hangs kills the test process with every thread's stack

EIO, ENOSPC = errno.EIO, errno.ENOSPC
# (swap file, op, fault, arg, exception, message pattern)
CASES = [
    ("params", "read", "errno", EIO, AioError, r"read of \d+ bytes at offset \d+ of '.*params\.swp' failed: .*\(EIO\)"),
    ("params", "write", "errno", EIO, AioError, r"write of \d+ bytes at offset \d+ of '.*params\.swp' failed: .*\(EIO\)"),
    ("master", "read", "errno", EIO, AioError, r"read of \d+ bytes at offset \d+ of '.*master\.swp' failed: .*\(EIO\)"),
    ("exp_avg", "write", "errno", EIO, AioError, r"write of .*exp_avg\.swp' failed: .*\(EIO\)"),
    ("grad", "write", "errno", ENOSPC, AioError, r"write of .*grad\.swp' failed: No space left on device \(ENOSPC\)"),
    ("master", "write", "errno", ENOSPC, AioError, r"write of .*master\.swp' failed: No space left on device"),
    ("params", "read", "short", 1000, AioError, r"read of .*params\.swp' failed: end of file reached .*\(ENODATA\)"),
    ("exp_avg_sq", "read", "short", 4096, AioError, r"read of .*exp_avg_sq\.swp' failed: end of file reached"),
    ("params", "read", "stall", STALL_MS, WaitTimeout, r"still in flight after waiting .* on '.*params\.swp'"),
] + [(kind, "read", fault, 4100, CorruptionError, rf"checksum mismatch in '.*{kind}\.swp' at byte offset \d+ ")
     for fault in ("flip", "zero") for kind in ("params", "master", "exp_avg", "exp_avg_sq", "grad")] + [
    ("master", "write", "zero", 0, CorruptionError, r"checksum mismatch in '.*master\.swp' at byte offset \d+ "),
    ("exp_avg", "write", "flip", 4100, CorruptionError, r"checksum mismatch in '.*exp_avg\.swp' at byte offset \d+ "),
]


def _config(nvme, kind):
    # the parameters' own file exists in bf16 only (fp32: Note [parameters from the master] in _placement.py)
    return streamed_nvme_config(nvme, "bf16" if kind == "params" else "fp32", timeout=IO_TIMEOUT)


def run_case(nvme, kind, op, fault, arg):
    """Train a step, arm the fault on ``kind``'s swap file, train on: (the error, seconds from
    arming to the error, the losses, whether the swap directory is gone after close)."""
    model, opt = infinity.initialize(gpt2(), _config(nvme, kind))
    losses = []
    train_into(model, opt, 1, losses)
    path = opt.param_store.path if kind == "params" else opt.store.paths[kind]
    inject_io_fault(path, op, fault, nth=1, count=1 if fault != "stall" else 0, arg=arg)
    start = time.monotonic()
    error = None
    try:
        train_into(model, opt, 3, losses)
    except Exception as e:  # noqa: BLE001 - the case's outcome, checked by the caller
        error = e
    elapsed = time.monotonic() - start
    infinity.aio._inject.clear()
    swap = [d.path for d in opt.engine.swap_dirs.values()]
    try:
        opt.engine.close()
    except Exception:  # noqa: BLE001 - the step's error, raised again by close
        pass
    if error is not None:
        error.__traceback__ = error.__context__ = error.__cause__ = None  # frames would keep the stores alive
    del model, opt
    gc.collect()  # the stores' handles close (a stalled one is abandoned after aio.timeout)
    return error, elapsed, losses, not any(os.path.exists(p) for p in swap)


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("kind,op,fault,arg,exc,pattern", CASES,
                         ids=[f"{c[2]}-{c[1]}-{c[0]}" for c in CASES])
def test_fault_ends_in_a_named_error(tmp_path, kind, op, fault, arg, exc, pattern):
    abandoned = len(_ABANDONED)
    error, elapsed, losses, removed = run_case(str(tmp_path), kind, op, fault, arg)
    assert isinstance(error, exc), f"expected {exc.__name__}, got {error!r} after {elapsed:.1f}s"
    assert __import__("re").search(pattern, str(error)), str(error)
    assert all(math.isfinite(x) for x in losses), losses
    assert removed, "the swap directory was left behind"
    if fault == "stall":  # close did not wait out the stalled read: its handle was abandoned
        assert len(_ABANDONED) == abandoned + 1
    assert os.listdir(tmp_path) == []


if __name__ == "__main__":  # the table for the report
    import tempfile

    print("| fault | where | outcome | time to error |\n|---|---|---|---|")
    for kind, op, fault, arg, _, _ in CASES:
        with tempfile.TemporaryDirectory() as d:
            error, elapsed, losses, removed = run_case(d, kind, op, fault, arg)
        what = f"{type(error).__name__}: {str(error)[:110]}" if error else "no error"
        print(f"| {fault}({arg}) on {op} | {kind}.swp | {what} | {elapsed:.2f} s |", flush=True)
