"""Fast in-process tests of the engine's parts, built the way initialize builds them (Note
[build order] in _initialize.py) from real small stores: fetch unit transitions, the step
gate, prefetch windows and divergence, kept units, and reducer bucketing. One rank, no
process group, no engine."""
import faulthandler
import functools

import pytest
import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

import infinity
from infinity._offload._layout import ALIGN_ELEMS, Layout, ParamSource
from infinity._offload._nvme_param_store import NvmeParamStore
from infinity._offload._param_store import MemoryParamStore
from infinity._offload._swap import SwapDir
from infinity._runtime._telemetry_counters import Counters
from infinity._runtime._tiers import StagePolicy, Tier
from infinity._zero._backward import BackwardHooks
from infinity._zero._ledger import GatherLedger, Hold
from infinity._zero._module_state import BackwardProgress, ModuleState
from infinity._zero._param import ParamState, make_partitioned, raw_data
from infinity._zero._phase import Calls, Frame, Phase
from infinity._zero._prefetch import Prefetcher
from infinity._zero._reduce import GradReducer, plan_buckets
from infinity._zero._same_gathers import check_same_gathers
from infinity._zero._step_gate import StepGate
from infinity._zero._unit import FetchUnit, UnitContext
from infinity._zero._unit_plan import plan_units
from infinity.errors import InvariantError, WaitTimeout


@pytest.fixture(autouse=True)
def hang_guard():
    """In-process parts block on conditions: a hang ends the run with every thread's stack."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class Chain(nn.Module):
    def __init__(self, n=6, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))


class Parts:
    """Units of ``model`` over a real parameter store on ``tier``, with their services."""

    def __init__(self, model, tier=Tier.CPU, tmp_path=None, persistence=0, prefetch=None, max_live=10**9):
        self.counters, self.ledger, self.calls = Counters(), GatherLedger(1), Calls()
        self.gate = StepGate(0, self.counters.blocked)
        specs, uses = plan_units(model, 1, persistence_threshold=persistence)
        self.layout = Layout.assign(specs, ALIGN_ELEMS if tier is Tier.NVME else 1)
        self.swap = swap = SwapDir(str(tmp_path), 0) if tier is Tier.NVME else None  # removed when collected
        if tier is Tier.NVME:
            self.store = NvmeParamStore(torch.float32, self.layout.param_total, swap=swap,
                                        aio_cfg=infinity.Config.from_dict({}).aio, max_unit=self.layout.max_shard,
                                        buffer_count=5, slots=self.layout.param_slots())
        else:
            self.store = MemoryParamStore(tier, torch.float32, self.layout.param_total)
        pcfg = infinity.Config.from_dict({"zero": {"prefetch": {"max_live_parameters": max_live, **(prefetch or {})}}})
        self.prefetcher = Prefetcher(pcfg.zero.prefetch, policy=StagePolicy.of(3), calls=self.calls, ledger=self.ledger,
                                     counters=self.counters)
        ctx = UnitContext(world_size=1, rank=0, dtype=torch.float32, itemsize=4, policy=StagePolicy.of(3),
                          counters=self.counters, ledger=self.ledger, gathered_buffers=None,
                          param_store=self.store, param_source=ParamSource.OWN, step_gate=self.gate,
                          make_room=self.prefetcher.make_room,
                          on_unavailable=self.calls.on_unavailable)
        self.units = [FetchUnit(ctx, s, self.layout.param_ranges[s.index][0], self.layout.opt_offsets[s.index])
                      for s in specs]
        self.states = []
        for name, module, indices in uses:
            if indices:
                state = ModuleState(module, name)
                for i in indices:
                    state.add_unit(self.units[i])
                self.states.append(state)
        self.values = {id(p): p.detach().clone() for u in self.units for p in u.params}
        for unit in self.units:
            unit.partition()
            for p in unit.params:
                make_partitioned(p)
        self.store.flush()

    def run(self, order, direction=Phase.FORWARD, check=None):
        """What the engine's hooks do for modules run in ``order`` (indices into states)."""
        forward = direction is Phase.FORWARD
        (self.calls.begin_forward if forward else self.calls.begin_backward)()
        self.prefetcher.begin()
        for pos, i in enumerate(order):
            state = self.states[i]
            for u in state.units:
                u.acquire(Hold.CALL)
            self.prefetcher.on_module(state)
            if check:
                check(pos, i)
            for u in state.units:
                u.release(Hold.CALL)
        self.prefetcher.end()
        (self.calls.end_forward if forward else self.calls.end_backward)()


# ------------------------------------------------------------------ fetch unit transitions

@pytest.mark.parametrize("tier", [Tier.CPU, Tier.NVME])
def test_partition_then_acquire_gives_back_the_same_values(tier, tmp_path):
    parts = Parts(Chain(3), tier, tmp_path)
    for unit in parts.units:
        assert unit.state is ParamState.RELEASED
        assert all(raw_data(p).numel() == 0 for p in unit.params)  # placeholders while released
        unit.acquire(Hold.CALL)
        assert unit.state is ParamState.AVAILABLE
        for p in unit.params:
            assert torch.equal(p.data, parts.values[id(p)])
        unit.release(Hold.CALL)
        assert unit.state is ParamState.RELEASED
    assert parts.ledger.live == 0 and parts.ledger.peak == max(u.full_numel for u in parts.units)


def test_release_without_acquire_and_wrong_transitions_raise():
    unit = Parts(Chain(1)).units[0]
    with pytest.raises(InvariantError, match="released for its module's call, but it is held only for nothing"):
        unit.release(Hold.CALL)
    with pytest.raises(InvariantError, match="stage_to_device: .* is RELEASED, expected HOST"):
        unit.stage_to_device()
    unit.acquire(Hold.CALL)
    with pytest.raises(InvariantError, match="cancel_prefetch: .* is still held for its module's call"):
        unit.cancel_prefetch()
    unit.release(Hold.CALL)


def test_the_ledger_names_who_holds_a_unit_and_refuses_a_release_for_another_reason():
    """Note [hold ledger] in _ledger.py: every hold has a reason; a release must name one the unit has."""
    parts = Parts(Chain(1))
    unit = parts.units[0]
    unit.acquire(Hold.CALL)
    unit.hold(Hold.KEPT, until=3)
    unit.acquire(Hold.CALL)
    assert unit.refs == 3 and parts.ledger.kept_until() == {unit: 3}
    assert parts.ledger.held_for(Hold.KEPT) == [unit] and parts.ledger.held_for(Hold.BACKWARD) == []
    with pytest.raises(InvariantError, match=r"released for its module's backward, but it is held only for its "
                                             r"module's call \(x2\), a later use in this pass"):
        unit.release(Hold.BACKWARD)
    with pytest.raises(InvariantError, match=r"after backward, 1 unit\(s\) still held: .*a later use in this pass"):
        parts.ledger.check_none(Hold.BACKWARD, Hold.KEPT, where="backward")
    unit.release(Hold.KEPT)
    assert parts.ledger.kept_until() == {}
    unit.release(Hold.CALL)
    unit.release(Hold.CALL)
    assert unit.refs == 0 and unit.state is ParamState.RELEASED
    parts.ledger.check_none(*Hold, where="the test")


def test_references_nest_and_persistent_units_stay_gathered():
    parts = Parts(Chain(2), persistence=10**6)
    unit = parts.units[0]
    unit.acquire(Hold.CALL)
    unit.acquire(Hold.CALL)
    unit.release(Hold.CALL)
    assert unit.state is ParamState.AVAILABLE and unit.refs == 1
    unit.release(Hold.CALL)
    assert unit.persistent and unit.state is ParamState.AVAILABLE  # below persistence_threshold
    unit.reshard_stale()  # what the step does: the gathered copy is stale
    assert unit.state is ParamState.RELEASED


def test_step_gate_holds_a_fetch_until_the_step_published_its_range():
    parts = Parts(Chain(2))
    first, second = parts.units  # layer 0's and layer 1's units
    parts.gate.open()
    assert not first.stage_to_host(block=False) and first.state is ParamState.RELEASED
    parts.gate.publish(first.opt_offset + first.shard_numel)
    assert first.stage_to_host(block=False) and first.state is ParamState.HOST
    assert not second.stage_to_host(block=False)
    parts.gate.fail(RuntimeError("step failed on its thread"))
    with pytest.raises(RuntimeError, match="step failed"):
        second.stage_to_host()
    first.cancel_prefetch()


def test_step_gate_times_out_with_the_unit_named(monkeypatch):
    from infinity._runtime import _comm

    monkeypatch.setattr(_comm._TIMEOUT, "seconds", 0.2)
    parts = Parts(Chain(1))
    parts.gate.open()
    with pytest.raises(WaitTimeout, match="update the shard of layers.0"):
        parts.units[0].acquire(Hold.CALL)


def test_abandon_returns_the_staging_buffer(tmp_path):
    parts = Parts(Chain(2), Tier.NVME, tmp_path)
    pool = parts.store.pool
    free = pool.free
    unit = parts.units[0]
    assert unit.stage_to_host()
    assert pool.free == free - 1
    unit.cancel_prefetch()
    assert unit.state is ParamState.RELEASED and pool.free == free


# ------------------------------------------------------------------ prefetcher

def test_prefetch_windows_follow_the_trace(tmp_path):
    parts = Parts(Chain(6), Tier.NVME, tmp_path, prefetch={"depth": 3, "device_depth": 2, "gather_depth": 1})
    parts.run(range(6))  # records the trace
    assert parts.counters.misses == 6  # one unit per layer, each fetched on demand while recording
    seen = {}

    def check(pos, i):
        if pos == 0:
            seen.update({j: parts.states[j].units[0].state for j in range(1, 6)})

    parts.run(range(6), check=check)
    assert seen[1] in (ParamState.GATHERING, ParamState.AVAILABLE)  # gather_depth 1
    assert seen[2] in (ParamState.HOST, ParamState.DEVICE)  # read submitted or landed: depth 3
    assert seen[3] in (ParamState.HOST, ParamState.DEVICE)
    assert seen[4] is ParamState.RELEASED and seen[5] is ParamState.RELEASED  # beyond the window
    assert all(u.state is ParamState.RELEASED and u.refs == 0 for u in parts.units)
    assert parts.counters.divergences == 0


class Uneven(nn.Module):
    """Layers of 272, 272, 4,160 and 272 elements: a unit too big for the bucket between two that fit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(64, 64), nn.Linear(16, 16)])


@pytest.mark.parametrize("tier", [Tier.CPU, Tier.NVME])
def test_reads_stop_at_the_first_unit_that_does_not_fit_the_bucket(tier, tmp_path):
    """Reads are issued in trace order: when the next unit's shard does not fit in bucket_size, no later
    (smaller) unit's read is issued ahead of it, in this module's window or the next."""
    parts = Parts(Uneven(), tier, tmp_path, prefetch={"depth": 3, "device_depth": 1, "gather_depth": 1,
                                                       "bucket_size": 1000})
    sizes = [s.units[0].shard_numel for s in parts.states]
    assert sizes[1] < 1000 < sizes[1] + sizes[2] and sizes[1] + sizes[3] <= 1000, sizes  # the case asked for
    parts.run(range(4))  # records the trace
    seen = {}

    def check(pos, i):
        if pos == 0:
            seen.update({j: parts.states[j].units[0].state for j in range(1, 4)})

    parts.run(range(4), check=check)
    assert seen[1] in (ParamState.GATHERING, ParamState.AVAILABLE)  # the window's first: read, copied, gathered
    assert seen[2] is ParamState.RELEASED  # past the bucket
    assert seen[3] is ParamState.RELEASED, "a later unit's read was issued before the one that did not fit"
    assert all(u.state is ParamState.RELEASED and u.refs == 0 for u in parts.units)


def test_divergence_abandons_prefetches_and_records_the_new_order(tmp_path):
    parts = Parts(Chain(6), Tier.NVME, tmp_path)
    parts.run(range(6))
    parts.run(range(6))
    free = parts.store.pool.free
    parts.run([0, 1, 3, 4, 5])  # a block skipped
    assert parts.counters.divergences == 1
    assert all(u.state is ParamState.RELEASED and u.refs == 0 for u in parts.units)
    assert parts.store.pool.free == free  # every abandoned read gave its buffer back
    assert parts.prefetcher.traces[Phase.FORWARD] == [parts.states[i] for i in (0, 1, 3, 4, 5)]
    parts.run([0, 1, 3, 4, 5])
    assert parts.counters.divergences == 1  # the new order is the trace now


def test_unit_used_twice_in_a_pass_is_kept_between_uses():
    parts = Parts(Chain(4))
    order = [0, 1, 2, 3, 0]  # module 0 again at the end, like a tied output layer
    parts.run(order)
    misses = parts.counters.misses
    states = []
    parts.run(order, check=lambda pos, i: states.append(parts.states[0].units[0].state))
    assert states[1:4] == [ParamState.AVAILABLE] * 3  # kept gathered until its next use
    assert parts.counters.misses - misses < len(order)  # the second use was no fetch
    assert parts.states[0].units[0].state is ParamState.RELEASED


def test_kept_units_give_way_to_max_live_parameters():
    width = 16
    one = width * width + width
    parts = Parts(Chain(4, width), max_live=2 * one, prefetch={"gather_depth": 0, "device_depth": 0})
    order = [0, 1, 2, 3, 0]
    parts.run(order)
    parts.run(order)
    assert parts.ledger.peak <= 2 * one


# ------------------------------------------------------------------ reducer

def test_bucket_plan_is_reverse_order_bounded_and_skips_frozen():
    model = Chain(5)
    model.layers[2].requires_grad_(False)
    parts = Parts(model)
    shard = parts.units[0].shard_numel
    buckets = plan_buckets(parts.units, 1, bucket_elems=2 * shard)
    planned = [[u.module_name for u, _ in b.units] for b in buckets]
    assert planned == [["layers.4", "layers.3"], ["layers.1", "layers.0"]]
    assert all(b.cols <= 2 * shard for b in buckets)
    oversized = plan_buckets(parts.units, 1, bucket_elems=1)
    assert [len(b.units) for b in oversized] == [1, 1, 1, 1]  # a unit bigger than a bucket is one of its own


def test_reducer_hands_over_each_gradient_once_and_zeros_for_units_without():
    parts = Parts(Chain(3))
    got = {}
    reducer = GradReducer(parts.units, 1, 10**6, lambda u, g: got.setdefault(u.module_name, []).append(g.clone()),
                          drop_full_grads=True)
    for unit in parts.units:
        unit.acquire(Hold.CALL)
    x = torch.randn(4, 16)
    parts.states[0].module(x).sum().backward()  # only layer 0 gets gradients
    reducer.add(parts.units[0])
    reducer.finish()
    assert sorted(got) == ["layers.0", "layers.1", "layers.2"]
    assert all(len(v) == 1 for v in got.values())
    assert torch.count_nonzero(got["layers.1"][0]) == 0 and torch.count_nonzero(got["layers.0"][0]) > 0
    expected = torch.cat([x.new_ones(4).matmul(x).expand(16, 16).reshape(-1), torch.full((16,), 4.0)])
    torch.testing.assert_close(got["layers.0"][0], expected)
    for unit in parts.units:
        unit.release(Hold.CALL)


# ------------------------------------------------------------------ phases and backward progress

def test_phase_transitions_raise_outside_their_phase():
    """Note [phases] in _phase.py: each transition leaves one phase; called in another it raises."""
    calls = Calls()
    with pytest.raises(InvariantError, match="end_forward: the engine is in IDLE, expected FORWARD"):
        calls.end_forward()
    with pytest.raises(InvariantError, match="end_backward: the engine is in IDLE, expected BACKWARD"):
        calls.end_backward()
    calls.begin_backward()
    with pytest.raises(InvariantError, match="begin_backward: the engine is in BACKWARD already"):
        calls.begin_backward()
    with pytest.raises(InvariantError, match="begin_forward: the engine is in BACKWARD"):
        calls.begin_forward()
    with pytest.raises(InvariantError, match="end_forward: the engine is in BACKWARD"):
        calls.end_forward()
    calls.end_backward()
    calls.begin_forward()
    calls.begin_backward()  # after a forward that raised before its post-forward
    calls.end_backward()
    assert calls.phase is Phase.IDLE


def test_a_forward_that_never_reached_its_post_forward_is_released_by_the_next():
    parts = Parts(Chain(2))
    parts.calls.begin_forward()
    frame = Frame(parts.states[0], [])
    parts.calls.push(frame)
    for unit in parts.states[0].units:
        unit.acquire(Hold.CALL)
        frame.held.append(unit)
    parts.calls.begin_forward()  # a KeyboardInterrupt skipped every post-forward hook
    assert parts.calls.top() is None and parts.calls.phase is Phase.FORWARD
    assert all(u.refs == 0 and u.state is ParamState.RELEASED for u in parts.units)


def test_the_prefetcher_follows_the_phase_and_refuses_to_begin_between_passes():
    parts = Parts(Chain(3))
    with pytest.raises(InvariantError, match="the engine is IDLE"):
        parts.prefetcher.begin()
    parts.run([2, 1, 0], direction=Phase.BACKWARD)
    assert parts.prefetcher.traces[Phase.BACKWARD] == [parts.states[i] for i in (2, 1, 0)]
    assert parts.prefetcher.traces[Phase.FORWARD] is None


def test_a_unit_counts_the_gradients_it_waits_for():
    model = Chain(2)
    model.layers[0].bias.requires_grad_(False)
    unit = Parts(model).units[0]
    unit.expect_grads()
    assert unit.grads_pending == 1  # only the trainable weight
    unit.expect_grads_again()
    assert unit.grads_pending == 1  # still waiting: nothing to start again
    assert unit.grad_arrived() and unit.grads_pending == 0
    assert unit.grad_arrived() and unit.grads_pending == 0  # a late accumulation: complete again, never negative
    unit.expect_grads_again()  # Note [used again in one backward] in _backward.py
    assert unit.grads_pending == 1
    unit.grads_handed_over()
    assert unit.grads_pending == 0


def test_backward_progress_moves_only_through_its_transitions():
    """Note [backward progress] in _module_state.py: NOT_REACHED -> AWAITING -> DONE -> (AWAITING again) -> NOT_REACHED."""
    parts = Parts(Chain(1))
    state, unit = parts.states[0], parts.units[0]
    assert state.progress is BackwardProgress.NOT_REACHED
    for wrong in (lambda: state.arrived(unit), state.end_hold, lambda: state.await_calls({1})):
        with pytest.raises(InvariantError, match="is NOT_REACHED, expected AWAITING"):
            wrong()
    unit.expect_grads()
    state.hold({7})
    assert state.progress is BackwardProgress.AWAITING and unit.state is ParamState.AVAILABLE
    assert parts.ledger.holds(unit, Hold.BACKWARD) and state.awaits(unit) and state.awaits(7)
    with pytest.raises(InvariantError, match="is AWAITING already"):
        state.hold(set())
    with pytest.raises(InvariantError, match="still AWAITING at the end of backward"):
        state.reset()
    state.await_calls({8})  # the module's second call of the forward
    unit.grad_arrived(), unit.grad_arrived()
    assert not state.arrived(unit) and not state.arrived(7)
    assert state.arrived(8)  # nothing left to wait for
    state.end_hold()
    assert state.progress is BackwardProgress.DONE and unit.state is ParamState.RELEASED and unit.refs == 0
    with pytest.raises(InvariantError, match="is DONE, expected AWAITING"):
        state.end_hold()
    state.hold(set())  # reached again in one backward: its unit waits for another accumulation
    assert state.progress is BackwardProgress.AWAITING and unit.grads_pending == 2 and state.waiting
    state.end_hold()
    state.reset()
    assert state.progress is BackwardProgress.NOT_REACHED


class Hooked:
    """The engine's hook protocol over Parts (Note [hook protocol] in _engine.py): the
    forward hooks as the engine runs them, the backward ones from ``BackwardHooks``."""

    def __init__(self, model, frozen=()):
        for i in frozen:
            model.layers[i].requires_grad_(False)
        self.parts = parts = Parts(model)
        self.got = {}
        self.reducer = GradReducer(parts.units, 1, 10**6, lambda u, g: self.got.setdefault(u.module_name, []).append(1),
                                   drop_full_grads=True)
        gathers = functools.partial(check_same_gathers, parts.ledger, parts.units, world_size=1, rank=0, partitioned=True)
        self.hooks = BackwardHooks(parts.units, parts.states, calls=parts.calls, prefetcher=parts.prefetcher,
                                   reducer=self.reducer, ledger=parts.ledger, counters=parts.counters,
                                   check_same_gathers=gathers)
        for unit in parts.units:
            for p in unit.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self.hooks.grad_accumulated)

    def call(self, state, x):
        """One module call: its pre-forward (hold its units, watch a frozen unit's inputs) and
        post-forward (release them, hook its output for the pre-backward)."""
        parts = self.parts
        frame = Frame(state, [])
        parts.calls.push(frame)
        for unit in state.units:
            unit.acquire(Hold.CALL)
            frame.held.append(unit)
        parts.prefetcher.on_module(state)
        if any(not u.trainable for u in state.units):
            watched = self.hooks.watch_inputs(frame, (x,), {})
            x = watched[0][0] if watched else x
        out = torch.tanh(state.module(x))
        for unit in parts.calls.pop().held:
            unit.release(Hold.CALL)
        register_multi_grad_hook([out], lambda _g: self.hooks.pre_backward(state, frame.token), mode="any")
        return out

    def forward(self, x):
        self.parts.calls.begin_forward()
        self.parts.prefetcher.begin()
        for state in self.parts.states:
            x = self.call(state, x)
        self.parts.prefetcher.end()
        self.parts.calls.end_forward()
        return x


def test_backward_holds_each_module_until_its_gradients_are_in_then_reduces_them():
    hooked = Hooked(Chain(3))
    parts = hooked.parts
    seen = []
    for state in parts.states:  # runs after the hooks' own (hooks run in the order they were registered)
        for p in state.units[0].params:
            p.register_post_accumulate_grad_hook(
                lambda p, s=state: seen.append((s.units[0].grads_pending, s.progress, s.units[0].state)))
    x = torch.randn(4, 16, requires_grad=True)
    hooked.forward(x).sum().backward()
    assert len(seen) == 6  # a weight and a bias per layer
    for pending, progress, unit_state in seen:
        if pending:
            assert progress is BackwardProgress.AWAITING and unit_state is ParamState.AVAILABLE
        else:  # its last gradient: reduced, the hold ended, the unit released
            assert progress is BackwardProgress.DONE and unit_state is ParamState.RELEASED
    assert hooked.got == {f"layers.{i}": [1] for i in range(3)}  # each unit handed over once
    assert parts.calls.phase is Phase.IDLE
    assert all(s.progress is BackwardProgress.NOT_REACHED for s in parts.states)
    assert all(u.state is ParamState.RELEASED and u.refs == 0 for u in parts.units)
    assert parts.prefetcher.traces[Phase.BACKWARD] == parts.states[::-1]
    assert x.grad is not None


def test_a_frozen_module_is_held_until_its_input_gradients_are_in():
    """Note [hold until the input gradients] in _backward.py: layer 1 has no gradient to wait for, yet its
    weights compute the gradient of its input."""
    hooked = Hooked(Chain(3), frozen=[1])
    parts = hooked.parts
    frozen = parts.states[1]
    at_input = []
    x = torch.randn(4, 16, requires_grad=True)
    out = hooked.forward(x)
    before = parts.units[0].params[0]  # layer 0's weight: its gradient needs layer 1's input gradient
    before.register_post_accumulate_grad_hook(lambda p: at_input.append(frozen.progress))
    frozen_seen = []
    parts.units[2].params[0].register_post_accumulate_grad_hook(
        lambda p: frozen_seen.append((frozen.progress, parts.units[1].state)))
    out.sum().backward()
    assert at_input == [BackwardProgress.DONE]
    assert frozen_seen in ([(BackwardProgress.NOT_REACHED, ParamState.RELEASED)],
                           [(BackwardProgress.AWAITING, ParamState.AVAILABLE)])
    assert sorted(hooked.got) == ["layers.0", "layers.2"]
    assert all(u.state is ParamState.RELEASED and u.refs == 0 for u in parts.units)


def test_a_module_called_twice_is_held_once_until_its_gradients_are_in():
    """Backward reaches the second call's output, then the first call's while the module is
    AWAITING: that call joins the hold, which ends once, when the unit's gradients are in (they
    are accumulated once, after both uses)."""
    hooked = Hooked(Chain(2))
    state, unit = hooked.parts.states[0], hooked.parts.units[0]
    seen = []
    pre = hooked.hooks.pre_backward
    hooked.hooks.pre_backward = lambda s, token: (pre(s, token), seen.append(
        (s.progress, s.awaits(unit), hooked.parts.ledger.describe(unit))))
    hooked.parts.calls.begin_forward()
    x = torch.randn(2, 16, requires_grad=True)
    hooked.call(state, hooked.call(state, x)).sum().backward()
    held = (BackwardProgress.AWAITING, True, "its module's backward")
    assert seen == [held, held]
    assert hooked.got == {"layers.0": [1], "layers.1": [1]}  # layer 1 unused: zeros at the end of backward
    assert state.progress is BackwardProgress.NOT_REACHED and unit.refs == 0 and x.grad is not None
