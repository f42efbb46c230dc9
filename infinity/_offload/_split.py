"""One state over host memory and NVMe: which part of a flat space each tier holds.

Note [split tiers]: ``split: {cpu: a, nvme: b}`` in an offload section puts the first part of
this rank's flat space in host memory and the rest in the swap files; nothing is held twice
and nothing of the host part is ever written to disk (the SSD ledger, the telemetry's NVMe
bytes and the disk the preflight asks for are the NVMe part's alone). The start of the space
goes to the faster tier because that is where the step's critical path is: the next forward
fetches the first units first, before the overlapped update has got far, and the update walks
the space in the same order, so the part the forward waits for is the part read from memory
while the files' reads, submitted at the start of the update, land during the host part's
arithmetic. The cut is in whole units of the space's own granularity:

- optimizer states (fp32 master weights, both moments and the gradient shards that follow
  them): whole chunks of ``zero.offload_optimizer.chunk_size``; the host part is chunks of the
  NVMe store's host cache that own their values (_head_cache.py), the files start after them
  (``OptimizerFiles.base``), and the last, partial chunk is always on NVMe when the NVMe
  fraction is not 0;
- parameters (stage 3's compute-dtype shards): whole fetch units, the first units whose slots
  end at or below the fraction of the parameter space, kept in one host tensor; params.swp
  holds the units after them.

With either state split the parameter shards are their own (``ParamSource.OWN``): a shared
master.swp (MASTER_FILE) would have to hold the host part too. A checkpoint sees each state
as the host tensors followed by the file (``checkpoint_sources``, ``checkpoint_parts``), so
its files are the same bytes whatever the split, and one saved under one split loads under
any other. ``offload_param.max_in_cpu`` stays what it was, a write-through cache of NVMe-tier
shards for backward's re-reads; a split moves shards off the disk, the cache copies them.

Note [planned split]: ``device: auto`` in an offload section lets ``plan_auto`` choose the
tier and split from the machine with the engine's own memory model (``preflight.plan``, the
one the preflight checks and ``infinity.estimate --plan`` prints): the host budget is
``zero.host_memory_limit``, or this rank's share of the node's available host memory less
HOST_MARGIN of it (activations, the model's own buffers and torch's working memory are not in
the plan). Everything in host memory when it fits; otherwise the parameters first (read
twice per step, by the forward that waits for them), then as much of the optimizer states
as fits, whole chunks, the rest on NVMe; the whole state on the device only where it is
already there by config. It logs what it chose and the bytes per tier, and never refuses:
a plan that does not fit even with every state on NVMe is refused by the preflight, which
names the numbers.
"""
from __future__ import annotations

import bisect
from typing import Optional, Sequence, Tuple

from .._runtime._log import logger
from .._runtime._tiers import Tier
from ..config.validate import split_fractions
from ._preflight import plan as memory_plan

HOST_MARGIN = 0.25  # of the available host memory, kept out of an automatic plan


def host_fraction(section) -> float:
    """The host fraction of a section's split (0 without one)."""
    fr = split_fractions(section.split)
    return 0.0 if fr is None or not fr["nvme"] else fr["cpu"]


def opt_host_upto(fraction: float, total: int, chunk: int) -> int:
    """Elements of the optimizer's flat space in host memory for a host ``fraction``: whole
    chunks, the nearest count to the fraction, the last (partial) chunk left on NVMe."""
    if fraction <= 0 or total <= chunk:
        return 0
    whole = (total - 1) // chunk  # chunks before the last one
    return min(whole, round(fraction * total / chunk)) * chunk


def param_host_upto(fraction: float, ranges: Sequence[Tuple[int, int]], total: int) -> int:
    """Elements of the parameter store's flat space in host memory for a host ``fraction``:
    up to the last unit boundary at or below it."""
    if fraction <= 0 or not total:
        return 0
    bounds = sorted({o for o, _ in ranges if o > 0} | {total})
    i = bisect.bisect_right(bounds, fraction * total) - 1
    return bounds[i] if i >= 0 else 0


def choices(nvme: bool, steps: int):
    """(tier, host fraction) an automatic plan tries for a state, most host first: all of it in
    host memory, then (with an ``nvme`` path) NVMe with a host fraction from ``steps - 1`` /
    ``steps`` down to 0."""
    yield Tier.CPU, None
    for k in range(steps - 1, -1, -1) if nvme else ():
        yield Tier.NVME, k / steps


def budget(limit: Optional[int], available: int, ranks: int) -> int:
    """Bytes of host memory an automatic plan may fill for one rank (Note [planned split])."""
    if limit is not None:
        return limit
    return int(available // max(ranks, 1) * (1 - HOST_MARGIN))


def plan_auto(build, cfg, opt_auto: bool, param_auto: bool, opt: tuple, param: tuple, machine,
              steps: int = 8):
    """Note [planned split]: the first placement, most host memory first and the
    parameters before the optimizer states, whose host bytes (the preflight's memory model)
    fit the budget; every state on NVMe when none does."""
    limit = budget(cfg.zero.host_memory_limit, machine.host_available, machine.ranks_on_node)
    grads: dict = {}  # the gradients' tier is decided once per optimizer tier: gradients_in_host logs its choice
    z = cfg.zero
    opts = list(choices(z.offload_optimizer.nvme_path is not None, steps)) if opt_auto else [opt]
    params = list(choices(z.offload_param.nvme_path is not None, steps)) if param_auto else [param]
    for o, p in ((o, p) for p in params for o in opts):  # parameters in host memory first
        chosen = build(o, p, grads_in_memory=grads.get(o[0]))
        grads[o[0]] = chosen.grads_in_memory
        need = memory_plan(chosen, cfg)
        if need["host"] + (0 if machine.accelerator else need["device"]) <= limit:  # no accelerator: the device is host
            break  # else the last tried, every state on NVMe, stands
    logger.info("device auto: %s; host memory %.2f GiB of a budget of %.2f GiB (%s), NVMe %.2f GiB, device %.2f GiB",
                chosen.describe(), need["host"] / 2**30, limit / 2**30,
                "zero.host_memory_limit" if cfg.zero.host_memory_limit is not None else
                f"this rank's share of {machine.host_available / 2**30:.1f} GiB available less {HOST_MARGIN:.0%}",
                sum(need["nvme"].values()) / 2**30, need["device"] / 2**30)
    return chosen
