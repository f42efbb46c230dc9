"""GradReducer in-process, with small fakes of fetch units (one rank, no process group):
the bucket plan, the launch order, units that join as zeros, late gradients."""
import torch
from torch import nn

from infinity._runtime import _comm as comm
from infinity._zero._reduce import GradReducer, plan_buckets


class FakeUnit:
    """What the reducer reads of a fetch unit: its parameters, shard size and gradients."""

    def __init__(self, index, numel, trainable=True):
        self.index = index
        self.module_name = f"u{index}"
        self.params = [nn.Parameter(torch.zeros(numel), requires_grad=trainable)]
        self.shard_numel = numel

    def give(self, value):
        g = torch.full((self.shard_numel,), float(value))
        p = self.params[0]
        p.grad = g if p.grad is None else p.grad + g

    def grads_into(self, rows):
        g = self.params[0].grad
        rows.copy_(torch.zeros_like(rows) if g is None else g.view(1, -1))

    def own_shard_grad(self):
        return None  # always through a bucket here

    def drop_grads(self):
        self.params[0].grad = None


def _reducer(units, bucket):
    got, added = [], []
    reducer = GradReducer(units, 1, bucket, lambda u, shard: got.append((u.index, shard.clone())),
                          drop_full_grads=True, on_add=added.append)
    return reducer, got, added


def test_buckets_are_planned_in_reverse_unit_order_and_skip_frozen_units():
    units = [FakeUnit(0, 4), FakeUnit(1, 4, trainable=False), FakeUnit(2, 4), FakeUnit(3, 4), FakeUnit(4, 10)]
    plan = plan_buckets(units, 1, 8)
    assert [[u.index for u, _ in b.units] for b in plan] == [[4], [3, 2], [0]]
    assert [[col for _, col in b.units] for b in plan] == [[0], [0, 4], [0]]


def test_a_bucket_waits_for_its_earlier_buckets_and_its_own_units():
    comm.counters.reset()
    units = [FakeUnit(i, 4) for i in range(4)]
    reducer, got, _ = _reducer(units, 8)  # buckets: [3, 2], [1, 0]
    for u in units:
        u.give(u.index + 1)
    reducer.add(units[0])  # its bucket [1, 0] is incomplete, and bucket [3, 2] has not launched
    reducer.add(units[1])
    assert comm.counters.snapshot()["bytes"].get("reduce_scatter", 0) == 0  # nothing launched out of order
    reducer.add(units[3])
    reducer.add(units[2])  # now both, in plan order
    reducer.finish()
    assert sorted(i for i, _ in got) == [0, 1, 2, 3]
    assert all(torch.equal(shard, torch.full((4,), float(i + 1))) for i, shard in got)


def test_units_without_gradients_join_as_zeros_at_finish():
    units = [FakeUnit(i, 4) for i in range(3)]
    reducer, got, added = _reducer(units, 100)
    units[1].give(5)
    reducer.add(units[1])
    reducer.finish()
    shards = dict(got)
    assert torch.equal(shards[1], torch.full((4,), 5.0))
    assert torch.equal(shards[0], torch.zeros(4)) and torch.equal(shards[2], torch.zeros(4))
    assert added == [units[1]]  # only a unit with gradients flags its parameters


def test_late_gradients_are_reduced_at_finish_and_added():
    units = [FakeUnit(i, 4) for i in range(2)]
    reducer, got, added = _reducer(units, 100)
    units[0].give(1)
    reducer.add(units[0])
    units[0].give(2)  # a second accumulation in the same backward (reentrant checkpoints)
    reducer.add(units[0])
    assert units[0].params[0].grad is not None  # kept until finish
    reducer.finish()
    assert [i for i, _ in got].count(0) == 2
    assert sum(shard for i, shard in got if i == 0).tolist() == [3.0] * 4
    assert units[0].params[0].grad is None
    assert added.count(units[0]) == 2
