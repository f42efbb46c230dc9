"""Activation checkpoints in host memory (paper 002 §5.1.2): ``activation_checkpointing.offload: cpu``.

Note [which tensors are offloaded]: during the model's forward (from its root pre-forward hook
to its post-forward hook) a ``saved_tensors_hooks`` pair is active. Hooks nest, and torch's
checkpoint installs its own innermost pair inside a checkpointed region (non-reentrant) or
runs the region under ``no_grad`` (reentrant), so the only tensors this pair sees are those
autograd keeps across the whole forward->backward gap: the inputs of every checkpointed block
(``CheckpointFunction.save_for_backward`` and non-reentrant's ``save_inputs`` both pack through
it; tested for both flavours and for Hugging Face's ``gradient_checkpointing_enable``), and the
saved tensors of modules that run outside any checkpoint (embedding, final norm, head).
Parameters, and views of them (``F.linear`` saves ``weight.t()``), are kept as they are: they
are the engine's, fetched again for backward (Note [hook protocol] in _engine.py). A tensor
packed twice (the same block input saved by two nodes) has one host copy.

Note [checkpoint prefetch window]: packing copies the tensor to host memory (pinned, on the
accelerator layer's device->host stream on CUDA) and drops the device reference, so the device
copy is freed as soon as the forward no longer needs it. Backward unpacks in the reverse order
of packing; each unpack also starts the host->device copies of the next ``depth`` tensors
backward will need, so the checkpoint is on the device before its block's recomputation. The
device bytes held for checkpoints are those fetched and not yet handed to autograd: at most
``depth + 1`` checkpoints (the one in use and the window). They are counted here
(``device_bytes``, ``peak_device_bytes``) and charged to the device budget, so a prefetch that
would overrun ``device_memory_limit`` waits until backward asks for that tensor.
"""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch
from torch import nn

from .._runtime import _accelerator as acc

DEFAULT_DEPTH = 2  # checkpoints fetched ahead of backward


class _Saved:
    """One offloaded tensor: its host copy and, while fetched, its device copy."""

    __slots__ = ("owner", "host", "event", "device", "nbytes", "order", "index", "__weakref__")

    def __init__(self, owner: "ActivationOffloader", host, event, nbytes: int, order: list):
        self.owner, self.host, self.event, self.nbytes = owner, host, event, nbytes
        self.order, self.index = order, len(order)  # its forward's packing order (weak), and its place in it
        order.append(weakref.ref(self))
        self.device = None  # (tensor, event) of the host->device copy while fetched

    def __del__(self):
        if self.device is not None:  # prefetched, but autograd freed the graph without asking for it
            self.owner._uncharge(self.nbytes)


def _is_parameter_like(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class ActivationOffloader:
    """The saved-tensor hooks of one model and their byte counters."""

    def __init__(self, budget: acc.DeviceBudget, depth: int = DEFAULT_DEPTH):
        self.budget = budget  # the engine's device budget (Note [hold ledger] in _ledger.py)
        self.depth = depth
        self._order: List[weakref.ref] = []  # this forward's offloaded tensors, in packing order
        self._copies: dict = {}  # id(tensor) -> (weak reference to it, its _Saved): one host copy per tensor
        self._ctx: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self.device_bytes = 0  # fetched checkpoints not yet handed to autograd
        self.peak_device_bytes = 0
        self.offloaded_bytes = 0  # totals since construction
        self.fetched_bytes = 0
        self.packs = 0

    def install(self, model: nn.Module) -> list:
        """Hooks on the model's root module; returns their handles."""
        return [model.register_forward_pre_hook(self._begin),
                model.register_forward_hook(self._end, always_call=True)]

    # ------------------------------------------------------------ forward

    def _begin(self, module, args) -> None:
        self._close()
        self._order = []
        self._copies = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def _end(self, module, args, output) -> None:
        self._close()

    def _close(self) -> None:
        self._copies = {}  # the forward is over: nothing is packed twice across forwards
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        if _is_parameter_like(t):
            return t
        ref, saved = self._copies.get(id(t), (None, None))
        if ref is None or ref() is not t:  # (an id is reused once its tensor is freed)
            host, event = acc.start_copy_to_host(t)
            saved = _Saved(self, host, event, t.numel() * t.element_size(), self._order)
            self._copies[id(t)] = (weakref.ref(t), saved)
            self.offloaded_bytes += saved.nbytes
            self.packs += 1
        return saved

    # ------------------------------------------------------------ backward

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.device is None:
            self._fetch(saved, block=True)
        for k in range(saved.index - 1, max(-1, saved.index - 1 - self.depth), -1):
            ahead = saved.order[k]()  # the same forward's, even if another forward ran since
            if ahead is not None and ahead.device is None:
                self._fetch(ahead, block=False)
        t, saved.device = acc.finish_copy_to_device(*saved.device), None
        self._uncharge(saved.nbytes)  # autograd owns it now; freed after its node's backward
        return t

    def _fetch(self, saved: _Saved, block: bool) -> None:
        """Start the host->device copy of one checkpoint; without ``block`` only within the budget."""
        if not block and not self.budget.fits(saved.nbytes):
            return
        self.budget.charge(saved.nbytes, "an activation checkpoint brought back for backward")
        self.device_bytes += saved.nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.fetched_bytes += saved.nbytes
        saved.device = acc.start_copy_to_device(saved.host, after=saved.event)  # no CPU wait

    def _uncharge(self, nbytes: int) -> None:
        self.device_bytes -= nbytes
        self.budget.release(nbytes)

    def stats(self) -> dict:
        return {"offloaded_bytes": self.offloaded_bytes, "fetched_bytes": self.fetched_bytes, "packs": self.packs,
                "device_bytes": self.device_bytes, "peak_device_bytes": self.peak_device_bytes}

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes
