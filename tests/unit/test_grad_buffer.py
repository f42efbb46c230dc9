"""The gradient buffer of an optimizer store in memory: Note [stale gradient ranges] and Note
[gradients landed in place] in _grad_buffer.py, at the seam the sink and the update use."""
import pytest
import torch

from infinity._offload._grad_buffer import GradBuffer
from infinity._runtime import _accelerator as acc
from infinity.aio import aligned_empty

RANGES = [(0, 8), (8, 4), (16, 6)]  # three units, padding at 12..16 and 22..24
TOTAL = 24


def _buffer() -> GradBuffer:
    return GradBuffer(lambda: aligned_empty(TOTAL, torch.float32), RANGES, lazy=False, host=True)


def _norm_sq(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


def test_a_consumed_range_is_overwritten_by_the_next_gradient_not_added_to():
    buf = _buffer()
    g1, g2 = torch.full((8,), 3.0), torch.full((8,), 5.0)
    buf.add(0, g1, 0.5)
    buf.add(0, g1, 0.5)  # a second micro-batch adds
    assert torch.equal(buf.get()[:8], g1)
    buf.consumed(0, 12)  # the step read it: no pass over the buffer...
    assert torch.equal(buf.get()[:8], g1)
    buf.add(0, g2, 0.25)  # ...the next gradient overwrites it
    assert torch.equal(buf.get()[:8], g2 * 0.25)
    sq, finite = buf.stats()
    assert finite and sq == pytest.approx(_norm_sq(g2 * 0.25))


def test_ranges_left_stale_read_as_zero_when_the_step_reads_them():
    buf = _buffer()
    buf.add(8, torch.ones(4), 1.0)
    buf.add(16, torch.ones(6), 1.0)
    buf.drop_below(TOTAL)  # zero_grad()
    buf.add(16, torch.full((6,), 2.0), 1.0)  # unit 1 gets no gradient this time
    sq, finite = buf.stats()
    assert finite and sq == pytest.approx(6 * 4.0)
    assert torch.equal(buf.get()[8:12], torch.zeros(4))


def test_dropping_below_an_offset_leaves_the_ranges_above_it():
    buf = _buffer()
    for off, n in RANGES:
        buf.add(off, torch.ones(n), 1.0)
    buf.drop_below(8)  # an update in flight has read only the first unit
    buf.add(0, torch.full((8,), 7.0), 1.0)
    buf.add(8, torch.ones(4), 1.0)  # still held: added to
    assert torch.equal(buf.get()[:8], torch.full((8,), 7.0))
    assert torch.equal(buf.get()[8:12], torch.full((4,), 2.0))


def test_a_write_outside_the_units_falls_back_to_zeroing_and_a_whole_norm():
    buf = _buffer()
    buf.add(0, torch.ones(8), 1.0)
    buf.consumed(0, TOTAL)
    buf.add(2, torch.ones(3), 1.0)  # not a unit's range: the stale unit is zeroed first
    assert torch.equal(buf.get()[:8], torch.tensor([0, 0, 1, 1, 1, 0, 0, 0.0]))
    assert buf.stats() == (pytest.approx(3.0), True)


def test_no_range_lands_in_place_without_pinned_memory():
    assert acc.kind() == "cpu"
    assert _buffer().landing_slot(0, 8) is None  # nothing pins host memory without an accelerator


def test_landed_ranges_are_normed_on_the_device_and_added_ones_on_the_host():
    with acc.using("emulated"):
        dev = acc.device()
        buf = _buffer()
        assert acc.is_pinned(buf.get())
        slot = buf.landing_slot(0, 8)
        assert slot is not None and buf.landing_slot(0, 8) is None  # once per use
        g = torch.arange(8.0, device=dev)
        buf.note_norm(0, torch.linalg.vector_norm(g))
        slot.copy_(g.cpu())
        assert buf.landing_slot(8, 5) is None  # not a unit's range
        buf.add(16, torch.full((6,), 2.0), 1.0)  # added on the host
        sq, finite = buf.stats()
        assert finite and sq == pytest.approx(_norm_sq(torch.arange(8.0)) + 24.0)
        buf.add(0, torch.ones(8), 1.0)  # a second gradient into a landed range: its norm is the host's now
        sq, _ = buf.stats()
        assert sq == pytest.approx(_norm_sq(torch.arange(8.0) + 1) + 24.0)
        buf.consumed(0, TOTAL)
        assert buf.landing_slot(0, 8) is not None  # consumed: the next gradient may land in place again
