"""The step gate after a failed step (Note [failed step] in infinity/_zero/_step_gate.py): a
failure that changed nothing is raised once and the gate is settled again; one that changed
a state is raised once, then refused at every wait and join until ``clear``."""
import contextlib

import pytest

from infinity._zero._step_gate import GateState, StepGate
from infinity.errors import EngineError


def gate() -> StepGate:
    return StepGate(0, lambda stage: contextlib.nullcontext())


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
