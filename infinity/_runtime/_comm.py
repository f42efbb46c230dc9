"""Thin functions over torch.distributed, with a byte counter per collective.

The data-parallel group is the default group when torch.distributed is initialized; with
torchrun's environment variables it is initialized here (gloo on CPU, NCCL on GPU);
otherwise the job is one rank without a process group and collectives are local copies.

Note [communication volume]: the counters record, per collective kind, the number of
elements of the *full* (unsharded) tensor each call moves: the output of an all-gather and
the input of a reduce-scatter. Summed over a step this is the paper's volume (ZeRO §7):
2Ψ for stages 1 and 2 (reduce-scatter + all-gather) and 3Ψ for stage 3 (two all-gathers
plus a reduce-scatter), independent of the world size.

Note [one rank]: a job of one rank runs the same code as many, collectives included (local
copies here), and differs only where one rank saves memory or time, each place marked with this
Note: the reduce-scatter writes into its own bucket (``GradReducer._launch``) and the late
gradients need no agreement (``_reduce_late``, _reduce.py); with no accelerator, shards are read
straight into the gathered buffers (``Placement.direct_reads``, _placement.py) and gathered
parameters are views of the shard (``Staging.gathers_in_place``, _staging.py); the ranks' gather
sequences are not recorded or compared (``GatherLedger.gathered``, _ledger.py;
``check_same_gathers``, _same_gathers.py); a failed pass needs no agreement
(``after_failed_pass``, below); a failed step that began no chunk is undone, since no peer can
have gone on (``ZeroOptimizer``, _zero_optimizer.py); ``generate`` does not sync its ranks
(integrations/transformers.py).
"""
from __future__ import annotations

import atexit
import collections
import datetime
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CommTimeout, JobStopped, UsageError
from . import _accelerator as acc
from ._log import logger


def _env_timeout() -> float:
    text = os.environ.get("INFINITY_COMM_TIMEOUT", "600")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"INFINITY_COMM_TIMEOUT={text!r} is not a number of seconds > 0; unset it or set e.g. 600 "
                         f"(or the config key comm.timeout, which wins over the variable)")
    return value


# Note [comm timeout]: every collective, every wait on the overlapped step and on NVMe I/O
# fails after this many seconds, naming what it waited for. The config key ``comm.timeout``
# wins over the INFINITY_COMM_TIMEOUT variable (a config is the run's record; the variable is
# the fallback for code without one); ``configure`` sets it per process when a config is
# used (initialize, Init, the train job). It also bounds the process group that infinity
# creates itself, so a sync collective on it cannot outwait it either.
@dataclass
class _Timeout:
    """This process's timeout (Note [comm timeout]): read through ``timeout_s``, set by
    ``configure``."""

    seconds: float
    source: str  # what set it, for the messages


_TIMEOUT = _Timeout(_env_timeout(), "INFINITY_COMM_TIMEOUT")


def configure(cfg) -> None:
    """Take ``comm.timeout`` from ``cfg`` when it sets one: Note [comm timeout]."""
    value = getattr(getattr(cfg, "comm", None), "timeout", None)
    if value is not None:
        _TIMEOUT.seconds, _TIMEOUT.source = float(value), "comm.timeout"


def timeout_s() -> float:
    return _TIMEOUT.seconds


# Note [one rank failing]: ranks pair their collectives by order alone. A rank whose backward
# ended by an exception (Note [aborted backward] in _backward.py) never issues the rest of that
# backward's collectives, while the other ranks, which know nothing of it, wait in them; if the
# failed rank then went on to its next batch, its collectives would pair with theirs of the
# failed one: gloo aborts the process on a size mismatch, and where the sizes agree (the next
# backward's reduce-scatters) the ranks train on each other's wrong gradients, silently. A
# forward that raised (Note [aborted forward] in _zero/_engine.py) is the same case: at stage 3
# its remaining all-gathers are missing, and the next forward's would pair with the others'
# gathers of the failed one (same-shaped blocks: the wrong block's weights, silently); at
# stages 1-2 its backward's reduce-scatters would pair with the others' of another batch. So
# everything below holds for a failed forward as for a failed backward:
# - every rank recovers, each as one rank does (Note [aborted backward] in _backward.py),
#   exactly when every rank's backward raised after the same collectives (out of memory at the
#   same point of batches of one size): then no rank waits for another. A failed rank, at its
#   next call into the engine (forward, zero_grad, step; close too), ends its backward as on
#   one rank, then ``agree_on_abort``: it writes in the process group's store how many collectives it has
#   issued and waits, at most ``_AGREE_S`` (and half of comm.timeout), for every rank's count
#   of the same abort; the same count from all: the ranks are in step, and train on.
# - otherwise (a rank whose backward went on waits in a collective, or the counts differ) the
#   job stops, on every rank, and the run resumes from its last checkpoint: the failed rank
#   calls ``stop_job``, which publishes why in the store and refuses every collective from then
#   on (``JobStopped``, also raised by that call, so the script cannot go on to train out of
#   step). Recovering when one rank alone failed would need it to issue, with zeros, exactly the
#   collectives the others issue for the rest of that backward; at stage 3 that sequence
#   interleaves all-gathers whose order follows the other ranks' hooks, which it cannot replay,
#   so it is not attempted at any stage.
# - a rank waiting in a collective (``CommHandle.wait``, every host collective) waits in slices
#   of ``_POLL_S`` and reads the store between them: once a rank published, it raises
#   ``JobStopped`` naming that rank and its reason, and refuses every later collective too;
#   a rank that died instead is named by the closed connection, and a hung one by the timeout
#   (Note [comm timeout]), so no rank waits longer than ``comm.timeout`` either way. The slices
#   also let a signal's handler run in a long wait (Note [interrupted step] in _step_gate.py).
# - a rank whose forward or backward a signal interrupted (KeyboardInterrupt, SystemExit) ends
#   with it: its ``close`` while that unwinds stops the job at once, naming the signal's exception
#   (no peer's word awaited: nothing recovers in a process that is ending).
# What a process knows of this (a stop, the first failure, the counts) is its job's: a new default
# group, another job in the same process, starts without it (``_this_job``).
# Stage 1 runs no backward hook, so it cannot see a backward that raised: there the script must
# let the exception end the process (its peers then see it die). NCCL collectives are waited for
# by the device, not here: NCCL's own timeout ends them.
_POLL_S = 0.5
_AGREE_S = 5.0  # how long a failed rank waits for the others' word on their backward
_stopped: Optional[str] = None  # why this process's collectives are refused: Note [one rank failing]
_failure: Optional[str] = None  # the first collective that failed here: the cause stop_job publishes
_issued = 0  # collectives this process has launched in a process group
_aborts = 0  # backwards that raised here (ranks in step count the same)
# the default group the four above belong to, held weakly: a reference here kept a destroyed
# group's gloo threads alive into the interpreter's finalization (Note [process group at exit])
_job_group: Optional["weakref.ref"] = None


def _this_job() -> None:
    """The state above is one job's: a process that makes a new default group after the last
    one was destroyed (another job in the same process) starts with none of it."""
    global _stopped, _failure, _issued, _aborts, _job_group
    group = dist.group.WORLD if is_distributed() else None
    if group is not None and (_job_group is None or group is not _job_group()):
        _stopped, _failure, _issued, _aborts, _job_group = None, None, 0, 0, weakref.ref(group)


def _stop_key() -> str:
    # a torchrun restart runs a new job beside the old one's keys
    return f"infinity/stopped/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def stop_job(reason: str) -> None:
    """Note [one rank failing]: this rank stops the job: every rank learns ``reason`` (the
    first published wins) and refuses every collective from now on."""
    global _stopped
    if not is_distributed():
        return
    _this_job()
    reason = _failure or reason  # a backward that ended because a collective failed: that failure is the cause
    store = _store()
    try:
        if store is not None and not store.check([_stop_key()]):
            store.set(_stop_key(), reason)
    except (RuntimeError, ValueError):  # the store's server went with its rank: the peers see it die
        pass
    _stopped = _stopped or reason


def published_stop() -> Optional[str]:
    """Why a rank stopped the job, if one did (Note [one rank failing])."""
    global _stopped
    _this_job()
    if _stopped is None and is_distributed():
        store = _store()
        try:
            if store is not None and store.check([_stop_key()]):
                _stopped = store.get(_stop_key()).decode()
        except (RuntimeError, ValueError):
            pass
    return _stopped


def check_job(what: str) -> None:
    """Before a collective: raise ``JobStopped`` once a rank stopped the job, else count it
    (Note [one rank failing])."""
    global _issued
    _this_job()
    if _stopped is not None:
        raise JobStopped(f"rank {rank()}: {what} refused: the job was stopped ({_stopped}); every rank stops. "
                         f"Fix the cause in that rank's log, then resume from the last checkpoint")
    if is_distributed():
        _issued += 1


def after_failed_pass(what: str, raised_by: str, *, closing: bool = False) -> None:
    """Note [one rank failing]: this rank's ``what`` (forward, backward) ended by an exception
    and was ended as on one rank: go on when every rank's did after the same collectives, else
    stop the job (``JobStopped`` here too, unless ``closing``)."""
    unwinding = sys.exc_info()[1]  # close() while a signal's exception unwinds: the process ends, no peer recovers
    if isinstance(unwinding, (KeyboardInterrupt, SystemExit)) and world_size() > 1:  # Note [one rank]
        code = f"({unwinding.code})" if isinstance(unwinding, SystemExit) else ""
        stop_job(f"rank {rank()} was interrupted in its {what} by {type(unwinding).__name__}{code}: a signal stopped it")
    elif world_size() > 1 and not agree_on_abort():
        stop_job(f"rank {rank()}'s {what} ended by an exception, raised by {raised_by}")
        if not closing:
            check_job(f"the call after a {what} that raised")


def agree_on_abort() -> bool:
    """This rank's forward or backward raised: whether every rank's did, each after the same
    collectives, so that each may recover as one rank does (Note [one rank failing])."""
    global _aborts
    _this_job()
    _aborts += 1
    store = _store() if is_distributed() and _stopped is None else None
    if store is None:
        return False
    prefix = f"{_stop_key().replace('stopped', 'aborted')}/{_aborts}/"
    keys = [f"{prefix}{r}" for r in range(world_size())]
    deadline = time.monotonic() + min(_AGREE_S, _TIMEOUT.seconds / 2)
    try:
        store.set(keys[rank()], str(_issued))
        while not store.check(keys):
            if time.monotonic() > deadline or published_stop() is not None:
                return False
            time.sleep(0.02)
        return len({store.get(k) for k in keys}) == 1
    except (RuntimeError, ValueError):  # the store's server went with its rank
        return False


# ---------------------------------------------------------------- group


# Note [process group at exit]: a rank of a two-rank gloo job could die by SIGABRT after its
# training was done ("terminate called without an active exception"): a gloo worker thread,
# releasing the last reference to a finished collective's tensors, took the GIL while the
# main thread was finalizing the interpreter, and CPython's forced exit of that thread unwound
# through a noexcept frame. The worker threads were alive at all because the process group
# outlived ``destroy_process_group()``: ``torch.distributed.nn.functional`` writes
# ``group=group.WORLD`` as the default argument of ten functions, so importing it after the
# group exists (transformers does, while it builds a model) keeps the default group in those
# defaults for the life of the process. So: that module is imported before infinity creates
# a group (its defaults are then None, which means the same default group when called), any
# group object already captured there is replaced by None when infinity sees a group and again
# at exit, and a group infinity created itself is destroyed at exit, before finalization, so
# its threads drain their queues and are joined while the interpreter is whole. Every wait
# drops its work at once (CommHandle.wait), so no finished work waits for a worker either.
def release_captured_groups() -> int:
    """Replace process groups held as default arguments of ``torch.distributed.nn.functional``
    by None (the default group, as before); returns how many functions held one."""
    # late: torch.distributed.nn brings RPC's remote module (~20 ms), needed only around a group's creation
    import torch.distributed.nn.functional as dist_nn

    held = 0
    for fn in list(vars(dist_nn).values()):
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(v, dist.ProcessGroup) for v in defaults):
            fn.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in defaults)
            held += 1
    return held


_created_group = False
_exit_hook = False


def _at_exit() -> None:
    """Note [process group at exit]: before the interpreter finalizes."""
    release_captured_groups()
    if _created_group and dist.is_initialized():
        dist.destroy_process_group()


def ensure_initialized() -> None:
    """Initialize the default group from torchrun's env vars if needed; else stay one rank.
    Either way a group is released before the interpreter exits: Note [process group at exit]."""
    global _created_group, _exit_hook
    if not dist.is_available():
        return
    if not _exit_hook:
        atexit.register(_at_exit)
        _exit_hook = True
    release_captured_groups()  # before a group exists: the defaults stay None
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        backend = acc.comm_backend()
        acc.set_device()  # before the group: NCCL and the side streams on this rank's GPU, not GPU 0
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=_TIMEOUT.seconds),
                                device_id=acc.comm_device_id())
        _created_group = True
        logger.info("initialized torch.distributed (%s), world size %d", backend, dist.get_world_size())


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


# ---------------------------------------------------------------- counters


class CommCounters:
    """Elements and bytes moved per collective kind (see Note [communication volume])."""

    def __init__(self):
        self._lock = threading.Lock()
        self.elements = collections.Counter()
        self.bytes = collections.Counter()
        self.calls = collections.Counter()

    def add(self, kind: str, full: torch.Tensor) -> None:
        with self._lock:
            self.elements[kind] += full.numel()
            self.bytes[kind] += full.numel() * full.element_size()
            self.calls[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.elements.clear()
            self.bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict:
        with self._lock:
            return {"elements": dict(self.elements), "bytes": dict(self.bytes), "calls": dict(self.calls)}


counters = CommCounters()


# ---------------------------------------------------------------- handles


def ranks_here() -> int:
    """Ranks on this node: they share its host memory and local disks."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


@dataclass
class CommHandle:
    """An in-flight collective. ``wait`` raises CommTimeout naming ``what`` on timeout."""

    work: Optional[dist.Work]
    what: str
    on_device: bool = False  # a collective of device tensors (NCCL): Note [stream waits]

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Note [stream waits]: for a collective of device tensors, the current stream waits
        for it and the CPU goes on (NCCL's ``wait`` with a timeout would poll on the CPU until
        the collective ends, a host sync at every gather); the process group's own timeout
        (comm.timeout) bounds it. Host collectives (gloo) wait on the CPU, bounded here."""
        if self.work is None:
            return
        if self.on_device:
            self.work.wait()
            self.work = None
            return
        timeout_s = _TIMEOUT.seconds if timeout_s is None else timeout_s
        start = time.monotonic()
        while True:  # in slices: Note [one rank failing]
            left = timeout_s - (time.monotonic() - start)
            last = left <= _POLL_S
            try:
                ok = self.work.wait(datetime.timedelta(seconds=max(min(left, _POLL_S), 0.001)))
            except RuntimeError as e:
                if not last and _slice_ended(e, self.work):
                    self._check_published()
                    continue
                self._check_published()
                raise CommTimeout(failure_message(self.what, e, time.monotonic() - start, timeout_s)) from None
            if ok is False:
                if not last:
                    self._check_published()
                    continue
                raise CommTimeout(_timed_out(self.what, timeout_s, "check the other ranks' logs"))
            break
        self.work = None

    def _check_published(self) -> None:
        if published_stop() is not None:
            check_job(self.what)

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()


_PEER_GONE = ("Connection reset", "Connection closed", "Broken pipe", "connection closed by peer", "EOF")


def _slice_ended(error: RuntimeError, work) -> bool:
    """A wait of one slice ended with the collective still running (torch's Work.wait with a
    timeout raises then; a failed collective is complete)."""
    return "timed out" in str(error).lower() and not work.is_completed()


def _peer() -> str:
    """The peer a failed collective lost: named when there is only one other rank (gloo's
    error gives the peer's address, not its rank)."""
    if world_size() == 2:
        return f"rank {1 - rank()}"
    return "a peer"


def _timed_out(what: str, timeout_s: float, tail: str) -> str:
    return _seen(f"rank {rank()}: {what} timed out after {timeout_s:g}s ({_TIMEOUT.source}); a peer is hung or far "
                 f"behind: {tail}")


def _seen(message: str) -> str:
    """A collective's failure, remembered as the cause ``stop_job`` publishes when it ended a
    backward here (Note [one rank failing]): the peer's death, not this rank's backward."""
    global _failure
    _this_job()
    _failure = _failure or message
    return message


def failure_message(what: str, error: BaseException, waited_s: float, timeout_s: float) -> str:
    """What a failed collective tells the user: a peer that died is not a timeout."""
    return _seen(_failure_text(what, error, waited_s, timeout_s))


def _failure_text(what: str, error: BaseException, waited_s: float, timeout_s: float) -> str:
    text = str(error).strip()
    if any(marker.lower() in text.lower() for marker in _PEER_GONE):
        return (f"rank {rank()}: {what} failed after {waited_s:.1f}s: {_peer()} died (the peer closed its connection: "
                f"its process exited or was killed); the error that stopped it is in that rank's log. ({text})")
    if waited_s < timeout_s * 0.9:
        return f"rank {rank()}: {what} failed after {waited_s:.1f}s: {text}"
    return _timed_out(what, timeout_s, text)


def _run(what: str, launch) -> None:
    """Run a collective issued with ``async_op=True`` and wait for it at most the timeout,
    so a dead peer and a hung one both end in an error naming ``what``."""
    check_job(what)
    try:
        work = launch()
    except RuntimeError as e:  # gloo may fail at launch when the peer is already gone
        raise CommTimeout(failure_message(what, e, 0.0, _TIMEOUT.seconds)) from None
    CommHandle(work, what).wait()


# ---------------------------------------------------------------- collectives


def _staged(what: str, outs, ins, collective) -> bool:
    """The emulated device has no collective backend: a collective of its tensors runs on host
    copies through gloo (synchronously) and the results are copied back. False (nothing done)
    for host tensors and on real devices."""
    if not (acc.stage_collectives() and any(t.device.type != "cpu" for t in outs + ins)):
        return False
    host_outs = [t.cpu() for t in outs]
    host_ins = [t.cpu() for t in ins]
    _run(what, lambda: collective(*host_outs, *host_ins))
    for t, h in zip(outs, host_outs):
        t.copy_(h)
    return True


# torch 2.13 names the single-tensor collectives all_gather_single and reduce_scatter_single and
# warns (FutureWarning, on every rank) at each call by the older names; torch before it has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nccl(t: torch.Tensor) -> bool:
    """Whether a collective of ``t`` runs on NCCL (a CUDA tensor): Note [stream waits]."""
    return acc.kind() == "cuda" and t.device.type == "cuda"


def all_gather_into_tensor(out: torch.Tensor, shard: torch.Tensor, group=None, *, async_op: bool = True,
                           what: str = "all-gather") -> CommHandle:
    """Gather equal shards from every rank into ``out`` (rank order)."""
    if out.numel() != shard.numel() * world_size(group):
        raise UsageError(f"{what}: output has {out.numel()} elements, expected {shard.numel()} x {world_size(group)}")
    counters.add("all_gather", out)
    check_job(what)
    if not is_distributed():
        if out.data_ptr() != shard.data_ptr():  # one rank may gather in place
            out.copy_(shard)
        return CommHandle(None, what)
    if _staged(what, [out], [shard], lambda o, i: _all_gather_single(o, i, group=group, async_op=True)):
        return CommHandle(None, what)
    if not async_op:
        _run(what, lambda: _all_gather_single(out, shard, group=group, async_op=True))
        return CommHandle(None, what)
    try:
        work = _all_gather_single(out, shard, group=group, async_op=True)
    except RuntimeError as e:
        raise CommTimeout(failure_message(what, e, 0.0, _TIMEOUT.seconds)) from None
    return CommHandle(work, what, _nccl(out))


def reduce_scatter_tensor(out: torch.Tensor, full: torch.Tensor, group=None, *, async_op: bool = True,
                          what: str = "reduce-scatter") -> CommHandle:
    """Sum ``full`` across ranks and leave this rank's shard in ``out``."""
    if full.numel() != out.numel() * world_size(group):
        raise UsageError(f"{what}: input has {full.numel()} elements, expected {out.numel()} x {world_size(group)}")
    counters.add("reduce_scatter", full)
    check_job(what)
    if not is_distributed():
        if out.data_ptr() != full.data_ptr():  # one rank may reduce in place
            out.copy_(full)
        return CommHandle(None, what)
    if _staged(what, [out], [full], lambda o, i: _reduce_scatter_single(o, i, op=dist.ReduceOp.SUM, group=group,
                                                                        async_op=True)):
        return CommHandle(None, what)
    if not async_op:
        _run(what, lambda: _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return CommHandle(None, what)
    try:
        work = _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    except RuntimeError as e:
        raise CommTimeout(failure_message(what, e, 0.0, _TIMEOUT.seconds)) from None
    return CommHandle(work, what, _nccl(out))


def all_reduce(t: torch.Tensor, op: str = "sum", group=None, *, what: str = "all-reduce") -> torch.Tensor:
    """In-place all-reduce (sum or max); synchronous. Small tensors only (norms, flags)."""
    if is_distributed():
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        if not _staged(what, [t], [], lambda h: dist.all_reduce(h, op=red, group=group, async_op=True)):
            _run(what, lambda: dist.all_reduce(t, op=red, group=group, async_op=True))
    return t


def broadcast(t: torch.Tensor, src: int, group=None, *, what: str = "broadcast") -> torch.Tensor:
    if is_distributed() and not _staged(what, [t], [], lambda h: dist.broadcast(h, src=src, group=group,
                                                                                 async_op=True)):
        _run(what, lambda: dist.broadcast(t, src=src, group=group, async_op=True))
    return t


def barrier(group=None, *, what: str = "barrier") -> None:
    if is_distributed():
        _run(what, lambda: dist.barrier(group=group, async_op=True))


def all_gather_object(obj, group=None, *, what: str = "all-gather of objects") -> list:
    """torch's all_gather_object has no async form: its waits are bounded by the process
    group's timeout (infinity's own group: comm.timeout); failures are named here."""
    if not is_distributed():
        return [obj]
    check_job(what)
    out = [None] * world_size(group)
    start = time.monotonic()
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise CommTimeout(failure_message(what, e, time.monotonic() - start, _TIMEOUT.seconds)) from None
    return out
