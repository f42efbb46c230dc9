"""The step gate after a failed step (Note [failed step] in infinity/_zero/_step_gate.py): a
failure that changed nothing is raised once and the gate is settled again; one that changed
a state is raised once, then refused at every wait and join until ``clear``. A step in flight
stops at its next chunk when asked or when the thread that started it has ended (Note
[interrupted step] in infinity/_zero/_step_gate.py)."""
import contextlib
import os
import signal
import threading

import pytest

from infinity._zero._step_gate import GateState, StepGate, StepStopped
from infinity.errors import EngineError


def gate() -> StepGate:
    return StepGate(0, lambda stage, unit="": contextlib.nullcontext())


def test_a_step_that_changed_nothing_is_raised_once_then_settled():
    g = gate()
    g.open()
    g.fail(OSError("read failed"), changed=False)
    assert g.state is GateState.SETTLED
    with pytest.raises(OSError, match="read failed"):
        g.wait(10)
    assert g.wait(10) and g.wait(10, block=False)
    g.join()
    g.open()  # the next step


def test_a_step_that_changed_a_state_is_refused_until_cleared():
    g = gate()
    g.open()
    g.publish(5)
    cause = OSError("write failed")
    g.fail(cause)
    with pytest.raises(OSError, match="write failed"):  # where it surfaces first: the error itself
        g.wait(3)
    for wait in (lambda: g.wait(3), lambda: g.wait(3, block=False), g.join, g.open):
        with pytest.raises(EngineError, match=r"step failed \(OSError: write failed\).*load_checkpoint") as e:
            wait()
        assert e.value.__cause__ is cause
    assert g.settle() is None  # seen already: close and a checkpoint load go on
    g.clear()
    assert g.state is GateState.SETTLED and g.wait(3)
    g.join()


def test_a_failure_raised_by_the_step_itself_is_not_raised_again():
    g = gate()
    g.fail(OSError("in step()"), raised=True)
    with pytest.raises(EngineError):
        g.join()
    g.clear()
    g.fail(OSError("in step()"), changed=False, raised=True)
    g.join()
    assert g.wait(1)


def test_the_background_step_says_whether_it_changed_a_state():
    for changed, state in ((False, GateState.SETTLED), (True, GateState.FAILED)):
        g = gate()
        g.open()
        seen = []

        def fail():
            raise OSError("on the step's thread")

        g.run_in_background(fail, changed=lambda e: seen.append(e) or changed)
        with pytest.raises(OSError, match="step's thread"):
            g.join()
        assert g.state is state and isinstance(seen[0], OSError)


def _chunks(g: StepGate, done: list, started: threading.Event, chunks: int = 10_000):
    """A step's tail: one chunk at a time, each after the gate's stop check."""
    def tail():
        for k in range(chunks):
            g.check_stop()
            done.append(k)
            started.set()
            threading.Event().wait(0.001)
    return tail


def test_a_step_asked_to_stop_ends_at_its_next_chunk_and_close_goes_on():
    g = gate()
    g.open()
    done, started, why = [], threading.Event(), []
    g.run_in_background(_chunks(g, done, started), changed=lambda e: why.append(e) or True)
    assert started.wait(60)
    g.stop("the test asked")
    assert g.settle() is None  # asked for: not a failure close reports
    assert 0 < len(done) < 10_000 and isinstance(why[0], StepStopped) and "the test asked" in str(why[0])
    assert g.state is GateState.FAILED  # the chunks after it were not updated
    with pytest.raises(EngineError, match=r"step failed \(StepStopped.*load_checkpoint"):
        g.join()


def test_a_step_whose_starting_thread_ended_stops():
    """The interpreter's shutdown marks the main thread stopped before it joins the step's
    thread: a step started by a thread that has ended stops at its next chunk."""
    g = gate()
    done, started, why = [], threading.Event(), []

    def owner():
        g.open()
        g.run_in_background(_chunks(g, done, started), changed=lambda e: why.append(e) or True)
        started.wait(60)

    t = threading.Thread(target=owner)
    t.start()
    t.join(60)
    assert g.settle() is None
    assert 0 < len(done) < 10_000 and "has ended" in str(why[0])


def test_an_interrupted_join_stops_the_step_and_raises_the_interrupt():
    """A real SIGINT while the main thread joins the step (close, wait_step)."""
    g = gate()
    g.open()
    done, started = [], threading.Event()
    g.run_in_background(_chunks(g, done, started), changed=lambda e: True)
    assert started.wait(60)
    step_thread = g._thread
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            g.join()  # 10 s of chunks: the signal lands inside
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert not step_thread.is_alive() and len(done) < 10_000  # stopped at its next chunk, joined
