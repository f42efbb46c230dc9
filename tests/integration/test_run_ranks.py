"""The multi-rank harness itself: results, failures, hangs and early exits."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from infinity.errors import UsageError
from infinity.testing import RankFailure, RankTimeout, preload_in_ranks, run_ranks


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "sum": t.item(), "threads": torch.get_num_threads()}


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return 0


def _rank0_hangs():
    if dist.get_rank() == 0:
        time.sleep(600)
    return 0


def _rank1_exits():
    if dist.get_rank() == 1:
        os._exit(3)
    return 0


def _rank0_returns_tensor():
    return torch.arange(4) * (dist.get_rank() + 1)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_in_rank_order(world_size):
    out = run_ranks(_sum_of_ranks, world_size, threads=1)
    expect = world_size * (world_size + 1) / 2
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["sum"] == expect for o in out)
    assert all(o["threads"] == 1 for o in out)


def test_tensor_results():
    out = run_ranks(_rank0_returns_tensor, 2)
    assert torch.equal(out[1], torch.arange(4) * 2)


def _what_the_rank_read():
    import sys

    from infinity._runtime import _accelerator

    return {"var": os.environ.get("INFINITY_TEST_HARNESS_VAR"), "accelerator": _accelerator.kind(),
            "preloaded": "transformers.models.gpt2.modeling_gpt2" in sys.modules}


def test_each_rank_reads_the_environment_of_its_call_even_at_import(monkeypatch):
    """Ranks fork from a server that imported torch and the model libraries once (Note [ranks
    from a forkserver] in testing.py); what infinity reads at import still comes from the caller's environment
    at each call, not from the one the server started with."""
    monkeypatch.setenv("INFINITY_TEST_HARNESS_VAR", "first")
    first = run_ranks(_what_the_rank_read, 2)
    monkeypatch.setenv("INFINITY_TEST_HARNESS_VAR", "second")
    monkeypatch.setenv("INFINITY_ACCELERATOR", "emulated")
    second = run_ranks(_what_the_rank_read, 1)
    assert [r["var"] for r in first] == ["first", "first"]
    assert second[0]["var"] == "second" and second[0]["accelerator"] == "emulated"
    if not torch.cuda.is_available():  # with CUDA ranks are spawned and import what they use
        assert first[0]["preloaded"]  # conftest's preload_in_ranks reached the ranks


def test_infinity_itself_is_never_preloaded():
    with pytest.raises(UsageError, match="reads its environment at import"):
        preload_in_ranks("infinity._zero")


def test_failing_rank_traceback():
    with pytest.raises(RankFailure, match="(?s)rank 1 .*boom from rank one"):
        run_ranks(_rank1_raises, 2, timeout=60)


def test_hanging_rank_times_out():
    run_ranks(_rank0_returns_tensor, 2)  # ranks fork from a started server below (Note [ranks from a forkserver] in testing.py)
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\]"):
        # room for rank 1 to start on a loaded machine: forked, or spawned with CUDA (Note [ranks from a forkserver]
        # in testing.py)
        run_ranks(_rank0_hangs, 2, timeout=40 if torch.cuda.is_available() else 15)
    assert time.monotonic() - start < 90


def test_exiting_rank_fails():
    with pytest.raises(RankFailure, match="rank 1 .*exited with code 3"):
        run_ranks(_rank1_exits, 2, timeout=60)



GLOO_RESET = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6582: Connection reset "
              "by peer. This is typically caused by a remote worker hanging or bugs in the application.")


def test_a_dead_peer_is_reported_as_such_not_as_a_timeout():
    """What gloo raises 0.3 s after a peer is killed names a dead peer, not a 600 s timeout."""
    from infinity._runtime._comm import failure_message

    message = failure_message("all-gather of head", RuntimeError(GLOO_RESET), 0.3, 600)
    assert "failed after 0.3s" in message and "peer closed its connection" in message
    assert "timed out" not in message
    late = failure_message("all-gather of head", RuntimeError("Timed out waiting 600000ms"), 600.0, 600)
    assert "timed out after 600s" in late and "INFINITY_COMM_TIMEOUT" in late
