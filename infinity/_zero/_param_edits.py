"""The engine's answers to edits of gathered values and to a checkpoint load: a unit's edited
values written back to its shard and master weights (``repartition``), an edit undone
(``restore``), and every write in flight waited for before the stores are rewritten
(``settle_writes``). ``Engine`` takes them as ``ParameterEdits``; Note [edits without
modifier_rank] in _gathered.py says when each runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from .._offload._layout import ParamSource
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._log import logger
from ..aio import AioError
from ._param import raw_data
from ._step_gate import GateState

if TYPE_CHECKING:
    from ._unit import FetchUnit

_DRAIN_TRIES = 64  # flushes of a failed step's parameter writes before a load gives up draining them


class ParameterEdits:
    """Part of ``Engine``: what it does when a unit's gathered values are edited or its stores rewritten."""

    def repartition(self, unit: "FetchUnit") -> None:
        """The gathered values of ``unit`` were edited: refresh its shard and master weights."""
        full = [acc.to_host(raw_data(p)) for p in unit.params]  # shards built on the host, as at initialize:
        self.gate.join()  # every store takes host values (the NVMe ones write them with aio)
        self.save_fence.wait_writes(comm.timeout_s())  # an asynchronous save may still copy the stores
        if unit.trainable:
            self.opt_store.load_master(unit.opt_offset, unit.shard_of(full, torch.float32))
        # MASTER_FILE too: the parameter store's cache and hand-off take the new values (Note [parameter cache] in
        # _nvme_param_store.py); only a trainable unit's shard in the master tensor itself has nothing to write
        master = self.placement.param_source is ParamSource.MASTER
        if self.policy.partition_params and not (unit.trainable and master):
            self.param_store.write(unit.param_offset, unit.shard_of(full, self.dtype))
            self.param_store.flush()

    def restore(self, unit: "FetchUnit", saved: Optional[List[torch.Tensor]] = None) -> None:
        """Undo edits of ``unit``'s gathered values: copy back ``saved``, or else rebuild them
        from the stored shards (collective): stage 3's parameter store, stages 1-2's master
        weights. Note [edits without modifier_rank] in _gathered.py."""
        if saved is not None:
            with torch.no_grad():
                for p, t in zip(unit.params, saved):
                    raw_data(p).copy_(t)
            return
        self.gate.join()
        if self.policy.partition_params:
            shard = self.param_store.read(unit.param_offset, unit.shard_numel)
        else:
            shard = self.opt_store.read_master(unit.opt_offset, unit.shard_numel)
        shard = shard.to(device=acc.device(), dtype=self.dtype)
        full = torch.empty(self.world_size * unit.shard_numel, dtype=self.dtype, device=acc.device())
        comm.all_gather_into_tensor(full, shard, async_op=False, what=f"restoring {unit.module_name or '<root>'}")
        unit.load_full_into_params(full.view(self.world_size, unit.shard_numel))

    def settle_writes(self, *, rewriting: bool = False) -> None:
        """Wait for the overlapped step and every parameter-shard write in flight. ``rewriting``:
        the caller rewrites every state (a checkpoint load), so a failed step is not refused
        (Note [failed step] in _step_gate.py): its error is logged and its I/O drained."""
        if not rewriting:
            self.gate.join()
            if self.param_store is not None:
                self.param_store.flush()
            return
        error = self.gate.settle()
        if error is not None:
            logger.warning("rank %d: the optimizer step failed (%s: %s); the checkpoint being loaded replaces its "
                           "states", self.rank, type(error).__name__, error)
        if self.gate.state is GateState.FAILED:
            self.opt_store.abandon_update()
            if self.param_store is not None:
                self._drain_parameter_writes()
        elif self.param_store is not None:
            self.param_store.flush()

    def _drain_parameter_writes(self) -> None:
        """Every parameter-shard write waited for, a failed one's error dropped: each failed
        flush collects one handle's writes (Note [write ordering] in _ordered_writes.py)."""
        for _ in range(_DRAIN_TRIES):
            try:
                self.param_store.flush()
                return
            except AioError:
                continue

    def needs_copy_to_restore(self, unit: "FetchUnit") -> bool:
        """An edit of ``unit``'s gathered values would also edit the only stored copy: stage
        3 parameters that are views of a resident store (one rank), stage 1-2 frozen
        parameters (whole, and without master weights)."""
        if not self.policy.partition_params:
            return not unit.trainable
        stores = [getattr(self.opt_store, "master", None), *self.param_store.resident_tensors()]
        bases = {t.untyped_storage().data_ptr() for t in stores if t is not None and t.numel()}
        return any(raw_data(p).untyped_storage().data_ptr() in bases for p in unit.params)
