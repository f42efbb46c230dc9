"""How the accelerator layer orders copies (Note [copy ordering] in _accelerator/__init__.py), on the emulated device in CI
and on CUDA in ``scripts/gpu_check.sh``: a copy is ordered before its use even while the
compute stream is busy; a host->device copy does not queue behind compute; a buffer under a
copy is not reused until the copy's event; a gather's wait does not block the CPU (CUDA only);
pinned memory is the package's own mappings, counted in the host ledger; and the emulator
bites (a use without the wait reads poison)."""
from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from infinity._runtime import _accelerator as acc
from infinity.aio import aligned_empty
from infinity.aio._memory import ledger

KIND = "cuda" if os.environ.get("INFINITY_ACCELERATOR") == "cuda" else "emulated"


@pytest.fixture(autouse=True)
def device():
    with acc.using(KIND):
        yield acc.device()


def _stall_compute(seconds: float) -> None:
    """Keep the compute stream busy for about ``seconds`` without the CPU waiting."""
    if KIND == "cuda":
        torch.cuda._sleep(int(seconds * 1.5e9))  # about 1.5 GHz: cycles, not an exact time
    else:
        acc.current_stream().enqueue(lambda: time.sleep(seconds))


def _host(n: int, value: float) -> torch.Tensor:
    t = aligned_empty(n, torch.float32, what="test")
    t.fill_(value)
    return t


def test_copy_is_ordered_before_its_use_while_compute_is_busy(device):
    src = _host(1 << 20, 3.0)
    _stall_compute(0.2)
    dst, event = acc.start_copy_to_device(src)
    acc.finish_copy_to_device(dst, event)  # the compute stream waits on the copy's event
    total = dst.sum()  # queued after the stall and after the copy
    assert total.item() == 3.0 * (1 << 20)


def test_host_to_device_copy_does_not_wait_for_compute(device):
    src = _host(1 << 20, 1.0)
    _stall_compute(0.5)
    dst, event = acc.start_copy_to_device(src)
    acc.wait_copy(event)
    assert not acc.current_stream().query(), "the copy waited for the compute stream's work"
    acc.synchronize()
    assert dst.cpu().eq(1.0).all()


def test_device_to_host_copy_waits_for_the_compute_that_made_its_source(device):
    x = torch.zeros(1 << 20, device=device)
    _stall_compute(0.2)
    x.add_(5.0)  # queued behind the stall on the compute stream
    out = _host(1 << 20, -1.0)
    host, event = acc.start_copy_to_host(x, out)
    acc.wait_copy_to_host(event)
    assert host.eq(5.0).all()


def test_pinned_memory_is_the_packages_own_mapping_counted_in_the_ledger(device):
    before = ledger.snapshot()["live"].get("pinned test", 0)
    t = aligned_empty(3 << 20, torch.uint8, what="pinned test")
    assert acc.is_pinned(t)
    assert t.data_ptr() % (2 << 20) == 0
    assert ledger.snapshot()["live"].get("pinned test", 0) - before == 3 << 20  # not rounded up to 4 MiB
    del t
    assert ledger.snapshot()["live"].get("pinned test", 0) == before


def test_a_use_without_the_wait_reads_what_has_not_landed():
    """The emulator bites: the same copy used without ``finish_copy_to_device`` reads the
    destination before the copy lands (poison, or the memory's old contents), never the value."""
    if KIND != "emulated":
        pytest.skip("on CUDA an unordered read is a race, not a certainty")
    from infinity._runtime._accelerator import _emulated

    with _emulated.copy_delay(1.0):  # far longer than the read below takes, however loaded the machine
        src = _host(4096, 2.0)  # alive until the copy lands (unmapping waits for its copies)
        dst, event = acc.start_copy_to_device(src)
        early = dst.sum().item()  # no wait on the event
        acc.wait_copy(event)
    assert early != 2.0 * 4096
    assert dst.sum().item() == 2.0 * 4096


@contextlib.contextmanager
def _slow_copies(direction: str, seconds: float):
    """Keep copies in ``direction`` ("h2d" or "d2h") in flight for about ``seconds``: on the
    emulated device each copy lands after that delay; on CUDA the side stream the copies run on
    is held by a sleep queued before them, so the next copies wait behind it."""
    if KIND == "cuda":
        with torch.cuda.stream(acc._side_stream(direction)):
            torch.cuda._sleep(int(seconds * 1.5e9))
        yield
        return
    from infinity._runtime._accelerator import _emulated

    with _emulated.copy_delay(seconds):
        yield


def test_a_staging_buffer_under_a_copy_is_not_handed_out_again(device):
    """Finding 6: a staging buffer given back while its copy to the device may still read it is
    reused only after the copy's event (Note [buffers under a copy] in _host_pool.py); the CPU waits only when
    no other buffer is free, and the copy delivers the values it was given."""
    from infinity._offload._host_pool import HostPool

    with _slow_copies("h2d", 0.3):
        pool = HostPool(4096, 2, torch.float32, "test pool")
        first = pool.get(4096)
        first.fill_(7.0)
        dst, event = acc.start_copy_to_device(first)
        pool.put(first, after=event)
        second = pool.get(4096, block=False)  # the never-made second buffer, not the one under the copy
        assert second is not None and second is not first
        assert pool.get(4096, block=False) is None  # the only other buffer is still being read
        again = pool.get(4096)  # waits for the copy
        assert again is first and event.query()
        again.fill_(-1.0)  # reusing it now cannot change what the copy delivered
        acc.finish_copy_to_device(dst, event)
        assert dst.cpu().eq(7.0).all()


def test_a_handed_off_shard_under_a_copy_is_not_recycled(device, tmp_path):
    """Finding 6: the view a fetch copied from (a hand-off, the cache) is kept by the parameter
    store until its copy's event, so the recycler cannot give its memory to the next step's
    outputs while the copy reads it; ``wait_copies`` holds the step until every copy landed."""
    import infinity
    from infinity._offload._nvme_param_store import NvmeParamStore
    from infinity._offload._swap import SwapDir

    with _slow_copies("h2d", 0.3):
        n = 4096
        swap = SwapDir(str(tmp_path), 0)  # the directory lives as long as this object
        store = NvmeParamStore(torch.float32, 2 * n, swap=swap,
                               aio_cfg=infinity.Config().aio, max_unit=n, buffer_count=2, slots=[(0, n), (n, n)])
        [(_, out)] = store.step_outputs(0, n)
        out.fill_(3.0)
        store.step_outputs_done(0, n)  # written, kept for hand-off, given back to the recycler
        store.flush()  # the write's own view of it is gone
        view = store.take_handoff(0, n)
        handed = view.data_ptr()
        dst, event = acc.start_copy_to_device(view)
        store.keep_until_copied(view, event)
        del view, out
        [(_, fresh)] = store.step_outputs(n, n)  # the next step's output of the same size
        assert fresh.data_ptr() != handed and not event.query()
        store.wait_copies()
        assert event.query()
        acc.finish_copy_to_device(dst, event)
        assert dst.cpu().eq(3.0).all()
        store.flush()


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "landed-in-place"])
def test_a_gradient_bucket_is_rewritten_only_after_its_copy_to_the_host(device, in_place):
    """Note [gradients to the host] in _grad_sink.py: the sink copies a device gradient to the host without a
    CPU wait; when the reducer is about to rewrite the bucket (``consumers_done``), device work
    is ordered after the copy, so the store receives the values the bucket held, not the next
    bucket's: whether the copy goes to staging memory or straight into the unit's range (Note
    [gradients landed in place] in _grad_buffer.py)."""
    from types import SimpleNamespace

    from infinity._offload._optimizer_store import MemoryOptimizerStore
    from infinity._runtime._telemetry_counters import Counters
    from infinity._runtime._tiers import Tier
    from infinity._zero._grad_sink import GradSink

    with _slow_copies("d2h", 0.2):
        n = 4096
        store = MemoryOptimizerStore(Tier.CPU, n, ranges=[(0, n)] if in_place else None)
        unit = SimpleNamespace(opt_offset=0, index=0, params=[], label="unit")
        counters = Counters()
        sink = GradSink(store, [unit], 1.0, counters)
        bucket = torch.full((n,), 2.0, device=device)
        sink.accumulate(unit, bucket)  # the copy is in flight
        sink.consumers_done()  # the reducer takes the bucket back for the next gradients
        bucket.fill_(-5.0)  # device work on the bucket: after the copy
        sink.flush()
        assert store.grad.eq(2.0).all()
        assert counters.bytes["grad_landed_in_place"] == (4 * n if in_place else 0)


def test_a_gather_wait_does_not_block_the_cpu(device):
    """Finding 10 (Note [stream waits] in _comm.py): waiting for a collective of device tensors makes the
    compute stream wait for it; the CPU goes on at once. NCCL's ``wait`` given a timeout would
    poll on the CPU until the gather ends, a host sync at every gather."""
    if KIND != "cuda":
        pytest.skip("NCCL's wait is CUDA's: the emulated device stages its collectives through gloo, "
                    "whose wait is the CPU's by nature")
    import torch.distributed as dist

    from infinity._runtime._comm import CommHandle

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        shard = torch.full((1 << 20,), 4.0, device=device)
        gathered = torch.empty_like(shard)
        _stall_compute(0.5)  # the gather is queued behind it: it cannot end before the stall does
        work = dist.all_gather_into_tensor(gathered, shard, async_op=True)
        start = time.monotonic()
        CommHandle(work, "test gather", on_device=True).wait()
        waited = time.monotonic() - start
        assert waited < 0.2, f"the CPU waited {waited:.2f}s for a gather behind a 0.5s stall"
        assert not acc.current_stream().query(), "the compute stream was not left to wait for the gather"
        assert gathered.eq(4.0).all()  # read on the compute stream: after the gather
    finally:
        if made:
            dist.destroy_process_group()


def test_infinity_device_is_where_this_rank_computes(device):
    """``infinity.device()``, public: the device the engine puts parameters on and batches go to."""
    import infinity

    assert infinity.device() == device
    assert infinity.device().type == ("cuda" if KIND == "cuda" else "emu")
    with acc.using("cpu"):
        assert infinity.device() == torch.device("cpu")
