"""Note [rank placement] in _runtime/_topology.py: the node's topology read from recorded sysfs
trees (tests/data/topology), each rank's share of its cores, and the memory policy call."""
import os
import threading

import pytest

from infinity._runtime import _topology as topo
from infinity.errors import UsageError

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "topology")
ONE = topo.Topology.read(os.path.join(DATA, "one_socket"))
TWO = topo.Topology.read(os.path.join(DATA, "two_socket"))
ALL_TWO = set(range(32))


def test_cpulists_round_trip():
    assert topo.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert topo.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"


def test_one_socket_is_one_node_of_four_cores():
    assert ONE.nodes == {0: tuple(range(8))}
    assert ONE.cores == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_two_sockets_and_the_gpus_nodes():
    assert TWO.nodes == {0: (*range(0, 8), *range(16, 24)), 1: (*range(8, 16), *range(24, 32))}
    assert len(TWO.cores) == 16 and TWO.cores[9] == (9, 25)
    assert [TWO.device_node(a) for a in ("0000:18:00.0", "0000:3B:00.0", "0000:86:00.0", "0000:af:00.0")] == [0, 0, 1, 1]
    assert TWO.device_node("0000:00:1f.0") is None  # numa_node -1: the firmware does not say
    assert TWO.device_node("0000:99:00.0") is None and TWO.device_node(None) is None


def test_four_gpu_ranks_split_their_gpus_nodes():
    shares = [topo.share_of(TWO, ALL_TWO, r, 4, device_nodes=[0, 0, 1, 1]) for r in range(4)]
    assert [s.node for s in shares] == [0, 0, 1, 1]
    assert [s.cpus for s in shares] == [(0, 1, 2, 3, 16, 17, 18, 19), (4, 5, 6, 7, 20, 21, 22, 23),
                                        (8, 9, 10, 11, 24, 25, 26, 27), (12, 13, 14, 15, 28, 29, 30, 31)]
    assert [s.threads for s in shares] == [4, 4, 4, 4] and all(s.pinned and s.memory_node == s.node for s in shares)
    assert shares[2].describe().endswith("NUMA node 1 (its GPU's), host memory preferred on node 1")


def test_one_gpu_on_node_1_takes_node_1s_cores():
    share = topo.share_of(TWO, ALL_TWO, 0, 1, device_nodes=[1])
    assert share.node == 1 and share.cpus == TWO.nodes[1] and share.threads == 8


def test_eight_ranks_without_gpus_spread_over_the_nodes_and_never_overlap():
    shares = [topo.share_of(TWO, ALL_TWO, r, 8) for r in range(8)]
    assert [s.node for s in shares] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(s.threads == 2 and s.cores == 2 for s in shares)
    cpus = [c for s in shares for c in s.cpus]
    assert sorted(cpus) == sorted(ALL_TWO)  # every CPU once: hyperthreads stay with their core
    assert shares[0].cpus == (0, 1, 16, 17)


def test_a_lone_rank_without_a_gpu_keeps_both_sockets():
    share = topo.share_of(TWO, ALL_TWO, 0, 1)
    assert share.node is None and share.cpus == tuple(range(32)) and share.threads == 16
    assert "across the NUMA nodes" in share.describe()


def test_the_launchers_mask_is_respected():
    allowed = set(range(8, 12)) | set(range(24, 28))  # e.g. a cpuset of four cores on node 1
    shares = [topo.share_of(TWO, allowed, r, 2) for r in range(2)]
    assert [s.node for s in shares] == [1, 1]
    assert [s.cpus for s in shares] == [(8, 9, 24, 25), (10, 11, 26, 27)]


def test_ranks_a_launcher_gave_cores_of_their_own_keep_them_whole():
    masks = [set(range(4 * r, 4 * r + 4)) | set(range(16 + 4 * r, 20 + 4 * r)) for r in range(4)]  # srun --cpu-bind
    shares = [topo.share_of(TWO, masks[r], r, 4, sharing=[r]) for r in range(4)]
    assert [set(s.cpus) for s in shares] == masks and all(s.threads == 4 for s in shares)
    assert [s.node for s in shares] == [0, 0, 1, 1]
    # torchrun: one mask for all, every local rank shares it
    assert topo.share_of(TWO, ALL_TWO, 1, 4, sharing=range(4)) == topo.share_of(TWO, ALL_TWO, 1, 4)


def test_more_ranks_than_cores_share_the_fewest():
    shares = [topo.share_of(ONE, range(8), r, 8) for r in range(8)]
    assert [s.cpus for s in shares] == [(0, 4)] * 2 + [(1, 5)] * 2 + [(2, 6)] * 2 + [(3, 7)] * 2
    assert all(s.threads == 1 and s.node == 0 and s.memory_node is None for s in shares)
    assert "the only node" in shares[0].describe()


def test_cpu_threads_overrides_the_count_alone():
    share = topo.share_of(ONE, range(8), 1, 2, cpu_threads=6)
    assert share.threads == 6 and share.cpus == (2, 3, 6, 7)


def test_numa_node_number_and_off():
    on_1 = [topo.share_of(TWO, ALL_TWO, r, 2, numa=1, device_nodes=[0, 0]) for r in range(2)]
    assert [s.node for s in on_1] == [1, 1] and on_1[0].cpus == (8, 9, 10, 11, 24, 25, 26, 27)
    off = topo.share_of(TWO, ALL_TWO, 1, 4, numa="off")
    assert off.node is None and not off.pinned and off.threads == 4
    assert "sized for" in off.describe() and "zero.numa off" in off.describe()


def test_bad_placements_are_refused_naming_what_to_change():
    with pytest.raises(UsageError, match=r"zero.numa: node 2 does not exist here \(nodes with cores: 0, 1\)"):
        topo.share_of(TWO, ALL_TWO, 0, 1, numa=2)
    with pytest.raises(UsageError, match=r"zero.numa: node 1 has none .* \(nodes with them: 0\)"):
        topo.share_of(TWO, set(range(8)), 0, 1, numa=1)
    with pytest.raises(UsageError, match="LOCAL_RANK 3 is outside LOCAL_WORLD_SIZE 2"):
        topo.share_of(ONE, range(8), 3, 2)


def test_a_kernel_without_numa_is_one_node_of_its_online_cpus(tmp_path):
    cpu = tmp_path / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("0-2\n")
    t = topo.Topology.read(str(tmp_path))
    assert t.nodes == {0: (0, 1, 2)} and t.cores == ((0,), (1,), (2,))


def test_this_machine_reads():
    t = topo.Topology.read()
    assert set(os.sched_getaffinity(0)) <= {c for cpus in t.nodes.values() for c in cpus}


@pytest.mark.skipif(topo._syscalls() is None, reason="set_mempolicy's number is known on x86_64, aarch64, ppc64le")
def test_memory_policy_prefers_the_node_in_the_calling_thread_only():
    node = min(topo.Topology.read().nodes)
    seen = {}

    def in_thread():  # a thread of its own: the policy is per thread, this one's ends with it
        seen["before"] = topo.memory_policy()
        assert topo.prefer_node(node)
        seen["after"] = topo.memory_policy()

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(10)
    assert seen["before"][0] == topo.MPOL_DEFAULT
    assert seen["after"] == (topo.MPOL_PREFERRED, (node,))
    assert topo.memory_policy()[0] == topo.MPOL_DEFAULT  # the test's own thread is untouched


def test_the_native_adams_default_before_any_placement_is_capped_at_the_share(monkeypatch):
    import torch

    monkeypatch.setattr(topo._Placed, "share", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert topo.local_ranks() == (3, 100000)
    assert topo.default_threads() == 1  # more ranks than CPUs here: one thread each, never zero
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert topo.default_threads() == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(UsageError, match="LOCAL_RANK / LOCAL_WORLD_SIZE must be integers"):
        topo.local_ranks()


def test_a_launcher_that_sets_local_rank_alone_counts_at_least_that_many_ranks(monkeypatch):
    """LOCAL_RANK without LOCAL_WORLD_SIZE (a launcher of one's own): at least LOCAL_RANK + 1 ranks
    on the node, never a refusal; ``place`` counts the host's ranks from its all-gather."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert topo.local_ranks() == (1, 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert topo.local_ranks() == (0, 1)


@pytest.fixture
def placed_and_restored(monkeypatch):
    """``place`` in this process, its affinity, torch's threads and the remembered share put back after."""
    import torch

    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    monkeypatch.setattr(topo._Placed, "share", None)
    monkeypatch.setattr(topo._Placed, "launch", None)
    yield
    topo._pin_threads(tuple(before))
    torch.set_num_threads(threads)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two CPUs to show")
def test_a_second_placement_divides_the_launchers_mask_not_its_own_share(placed_and_restored, monkeypatch):
    launch = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    first = topo.place()
    assert first.pinned and sorted(os.sched_getaffinity(0)) == list(first.cpus) != launch
    assert all(sorted(os.sched_getaffinity(int(t))) == list(first.cpus) for t in os.listdir("/proc/self/task"))
    assert topo.current() == first and topo.place() == first  # the same share again, not half of it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert sorted(topo.place().cpus) == launch == sorted(os.sched_getaffinity(0))


def test_more_cpu_threads_than_the_share_has_cpus_is_said(placed_and_restored, caplog):
    import logging

    import infinity

    infinity.logger.propagate, was = True, infinity.logger.propagate
    try:
        with caplog.at_level(logging.WARNING, logger=infinity.logger.name):
            share = topo.place(numa="off", cpu_threads=len(os.sched_getaffinity(0)) + 1)
    finally:
        infinity.logger.propagate = was
    assert share.threads == len(share.cpus) + 1  # kept: the user asked for it
    assert f"zero.cpu_threads {share.threads} is more than the {len(share.cpus)} CPU(s)" in caplog.text


def test_numa_off_pins_nothing(placed_and_restored):
    before = os.sched_getaffinity(0)
    share = topo.place(numa="off", cpu_threads=1)
    assert not share.pinned and share.memory_node is None and os.sched_getaffinity(0) == before
    import torch

    assert torch.get_num_threads() == 1 == topo.default_threads()  # zero.cpu_threads sets the count
