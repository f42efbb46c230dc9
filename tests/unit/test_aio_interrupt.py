"""An aio wait is interruptible (Note [interrupted step] in infinity/_zero/_step_gate.py): a real
SIGINT lands in ``AsyncIO.wait`` while a read is stalled (the I/O layer's fault seam) and raises
KeyboardInterrupt there, the read still in flight; a later wait collects it, its bytes right."""
import os
import signal
import threading

import pytest
import torch

from infinity.aio import AsyncIO, aligned_empty
from infinity.testing import io_fault

STALL_MS = 2000  # the read's delay; the signal comes 0.3 s into the wait


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
def test_sigint_lands_in_a_wait_for_a_stalled_read(tmp_path, backend):
    path = tmp_path / "data.bin"
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    out = aligned_empty(data.numel(), hugepage=False)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with AsyncIO(backend=backend) as h, io_fault(str(path), "read", "stall", arg=STALL_MS) as rule:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        try:
            h.pread(out, str(path))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                h.wait(timeout=60, what="a stalled read")
            assert h.in_flight() == 1  # the interrupt came before the read landed
        finally:
            timer.join()
            signal.signal(signal.SIGINT, previous)
        h.wait(timeout=60, what="the same read")
        assert rule.hits == 1 and torch.equal(out, data)
