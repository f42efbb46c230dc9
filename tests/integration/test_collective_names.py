"""The collectives by torch's current names: a two-rank gloo run (the collectives alone, then a
stage-3 step) raises no deprecation warning, and gathers and reduces as before."""
import warnings

import torch

import infinity
from infinity._runtime import _comm as comm
from infinity.testing import run_ranks


def _collectives_and_a_step():
    rank, world = comm.rank(), comm.world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard = torch.full((3,), float(rank + 1))
        gathered = torch.empty(3 * world)
        comm.all_gather_into_tensor(gathered, shard, async_op=False)
        later = torch.empty(3 * world)
        comm.all_gather_into_tensor(later, shard).wait()
        full = torch.arange(4.0 * world) * (rank + 1)
        mine = torch.empty(4)
        comm.reduce_scatter_tensor(mine, full, async_op=False)
        mine_later = torch.empty(4)
        comm.reduce_scatter_tensor(mine_later, full).wait()
        torch.manual_seed(0)
        model, opt = infinity.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
                                         {"zero": {"stage": 3}, "precision": {"dtype": "fp32"}})
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return ([str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))],
            gathered, later, mine, mine_later)


def test_two_ranks_raise_no_deprecation_warning_and_compute_the_same():
    results = run_ranks(_collectives_and_a_step, 2, timeout=120)
    expected_gather = torch.tensor([1.0, 1, 1, 2, 2, 2])
    full = torch.arange(8.0) * 3  # rank 0's times 1 plus rank 1's times 2
    for rank, (deprecated, gathered, later, mine, mine_later) in enumerate(results):
        assert deprecated == [], deprecated
        assert torch.equal(gathered, expected_gather) and torch.equal(later, expected_gather)
        assert torch.equal(mine, full[4 * rank:4 * rank + 4]) and torch.equal(mine_later, mine)
