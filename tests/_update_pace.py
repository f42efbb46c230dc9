"""An optimizer update slowed to a large model's pace on the emulated device: each chunk sleeps its
share of ``update_s`` a step (the host's Adam, while the device is free to compute) and records
what ``tag`` says of the call beside whether the device ran operators meanwhile. Timings are
printed by the tests that use it, never asserted."""
from __future__ import annotations

import time
from typing import Callable


def pace_chunks(opt, method: str, chunks: list, update_s: float, tag: Callable[[tuple, dict], object]) -> None:
    """Replace ``opt.<method>`` (called with a chunk first) by the slowed, recording one."""
    from infinity._runtime._accelerator import _emulated

    update = getattr(opt, method)

    def paced(chunk, *args, **kwargs):
        before = _emulated.operators_run()
        time.sleep(update_s * chunk.master.numel() / opt.total)  # the pace of a large model's Adam, not a wait
        update(chunk, *args, **kwargs)
        chunks.append((tag(args, kwargs), _emulated.operators_run() > before))

    setattr(opt, method, paced)
