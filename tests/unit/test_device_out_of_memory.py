"""Out of device memory raised as CUDA raises it: the emulated device past its capacity, in
forward and inside a backward (Note [errors inside backward] in _emulated.py), and the engine's
own budget (Note [device budget] in infinity/_runtime/_accelerator/__init__.py). Each is a
``torch.OutOfMemoryError`` that accelerate's ``should_reduce_batch_size`` (what the Trainer's
``auto_find_batch_size`` and ``find_executable_batch_size`` retry on) recognises, and the
memory the failed computation held is free once the exception is dropped."""
import gc

import pytest
import torch
from accelerate.utils.memory import should_reduce_batch_size

from infinity._runtime._accelerator import DeviceBudget, DeviceOutOfMemory, _emulated
from infinity.errors import InfinityError
from infinity.testing import wait_device_memory


def graph(dev):
    torch.manual_seed(0)
    w = torch.randn(64, 64, device=dev, requires_grad=True)
    x = torch.randn(32, 64, device=dev)
    return w, torch.tanh(x @ w) @ w


def test_emulated_device_out_of_memory_in_forward(emulated):
    before = _emulated.memory_allocated()
    _emulated.set_capacity(before + 40_000)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        graph(emulated)
    recognised, message = should_reduce_batch_size(caught.value), str(caught.value)
    del caught
    gc.collect()
    assert _emulated.memory_allocated() == before
    assert recognised and " out of memory. Tried to allocate" in message


def test_emulated_device_out_of_memory_inside_backward_reaches_the_caller(emulated):
    """An operator of backward past the capacity: the caller of ``backward()`` gets the
    ``torch.OutOfMemoryError`` itself (the process is not aborted), and the device memory is
    back to its level before the forward once the graph and the exception are dropped."""
    before = _emulated.memory_allocated()
    w, out = graph(emulated)
    loss = out.sum()
    _emulated.set_capacity(_emulated.memory_allocated() + 100)  # forward done; backward needs more
    with pytest.raises(torch.OutOfMemoryError, match=r"emulated device out of memory\. Tried to allocate") as caught:
        loss.backward()
    recognised, no_grad = should_reduce_batch_size(caught.value), w.grad is None
    del caught, loss, out, w  # (an assert on caught.value would keep it, and its traceback's tensors, alive)
    assert wait_device_memory(before) == before
    assert recognised and no_grad
    _emulated.set_capacity(before + (1 << 20))
    w, out = graph(emulated)
    out.sum().backward()  # with room, the same backward runs
    assert w.grad is not None and bool(torch.isfinite(w.grad.cpu()).all())


def test_an_operator_error_inside_backward_keeps_its_type_and_message(emulated):
    """Not only out of memory: a device mismatch inside backward reaches the caller as itself."""
    from infinity._runtime._accelerator._emulated import DeviceMismatchError

    w = torch.randn(4, 4, device=emulated, requires_grad=True)
    host = torch.randn(4, 4)

    class Mixed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * host  # a host tensor with the device's gradient: refused, as CUDA refuses it

    with pytest.raises(DeviceMismatchError, match="at least two devices"):
        Mixed.apply(w).sum().backward()


def test_the_engines_budget_raises_an_out_of_memory_error_retry_loops_recognise():
    budget = DeviceBudget(1000)
    budget.charge(600, "gathered parameters of h.0")
    with pytest.raises(DeviceOutOfMemory) as caught:
        budget.charge(600, "an activation checkpoint brought back for backward")
    error = caught.value
    assert isinstance(error, torch.OutOfMemoryError) and isinstance(error, InfinityError)
    assert isinstance(error, MemoryError)  # infinity's OutOfMemory, as before
    assert should_reduce_batch_size(error)
    assert "device_memory_limit=1000" in str(error) and "smaller batch" in str(error)
    assert budget.stats().allocated == 600  # the failed charge charged nothing
