"""What the engine reports of itself: the telemetry's counters and byte totals since the last
call, its device budget, and the bytes it keeps per tier and per model state. ``Engine`` takes
them as ``EngineReport``.
"""
from __future__ import annotations

from .._offload._drives import configured_drives
from .._offload._memory_plan import host_account
from .._offload._optimizer_store import state_bytes
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._telemetry import TIER_SECONDS
from .._runtime._topology import current as placed_share
from ._param import raw_data


class EngineReport:
    """Part of ``Engine``: its telemetry and its byte counts."""

    def telemetry(self, reset: bool = True) -> dict:
        """Counters since the last call: stall seconds and bytes per stage, prefetch hit
        rate, trace divergences, NVMe traffic of the stores, their seconds per tier
        (``tier_seconds``) and collective bytes (deltas, like everything else here), and the
        peak of gathered elements."""
        out = self.counters.snapshot()
        totals = {}
        for name, store in (("optimizer", self.opt_store), ("params", self.param_store)):
            if store is not None and hasattr(store, "bytes_read"):
                totals[f"nvme_{name}_read_bytes"] = store.bytes_read
                totals[f"nvme_{name}_write_bytes"] = store.bytes_written
            for tier, seconds in (store.tier_seconds.items() if store is not None else ()):
                totals[f"{TIER_SECONDS}.{name}.{tier}"] = seconds  # Note [engine telemetry keys] in _telemetry.py
        totals.update(self.swap_dirs.drive_totals(configured_drives(self.cfg)))  # Note [many drives] in _drives.py
        for kind, n in comm.counters.snapshot()["bytes"].items():
            totals[f"comm_{kind}_bytes"] = n
        last = self._telemetry_totals
        for k, v in totals.items():
            if k.startswith(TIER_SECONDS + "."):  # nested: tier_seconds.<state>.<tier>
                _, state, tier = k.split(".")
                out.setdefault(TIER_SECONDS, {}).setdefault(state, {})[tier] = v - last.get(k, 0)
            else:
                out[k] = v - last.get(k, 0)
        out["peak_live_parameters"] = self.peak_live_elems
        out["host_memory"] = host_account(self.memory_plan.get("categories"))  # Note [one memory model] in _memory_plan.py
        share = placed_share()
        if share is not None:  # where this rank runs (Note [rank placement] in _topology.py)
            out["placement"] = share.record()
        if reset:
            self.counters.reset()
            self._telemetry_totals = totals
        return out

    @property
    def device_budget(self) -> "acc.DeviceBudget":
        """This engine's device budget (``device_memory_limit``): what its gathered parameters
        and fetched activation checkpoints hold on the device now, and their peak."""
        return self.ledger.budget

    def tier_bytes(self) -> dict:
        """Bytes this rank keeps on each tier (device, host, nvme), pools included."""
        out = {"device": 0, "host": 0, "nvme": 0}
        stores = [self.opt_store] + ([self.param_store] if self.param_store else [])
        for store in stores:  # a MASTER parameter store's are its frozen shards' (the master's are the optimizer's)
            for tier, n in store.nbytes().items():
                out[tier] += n
        if self.gathered_buffers is not None:
            out["device"] += self.gathered_buffers.capacity  # returned gathered buffers, kept for reuse
        return out

    def model_state_bytes(self) -> dict:
        """Bytes of model states this rank holds now: parameters, gradients, optimizer."""
        params = 0
        grads = 0
        for unit in self.units:
            if self.policy.partition_params:
                params += unit.shard_numel * self.itemsize
            else:
                params += sum(raw_data(p).numel() * raw_data(p).element_size() for p in unit.params)
            grads += sum(p.grad.numel() * p.grad.element_size() for p in unit.params if p.grad is not None)
        opt = state_bytes(self.opt_store, self.placement.param_source)
        return {"params": params, "grads": grads + opt.get("grads", 0), "optimizer": opt.get("optimizer", 0)}
