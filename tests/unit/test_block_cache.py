"""Note [block cache] in native/host_alloc/host_alloc.cpp: torch's CPU blocks of 1 MiB or more
from mappings of their own, freed blocks reused whole by size and bounded, installed while an
engine runs. Counts and addresses only: what reuse and release save is timed in
benchmarks/host_memory.py."""
import ctypes
import threading

import pytest
import torch

import infinity
from infinity._offload import _memory_plan
from infinity._offload._memory_plan import BLOCK_MIN, stop_block_cache, use_block_cache
from infinity.aio._memory import HUGE_PAGE

MiB = 1 << 20
lib = _memory_plan._block_cache()  # built by scripts/setup_env.sh (setup.py, torch importable at build time)
assert lib is not None, "infinity._host_alloc is not built: pip install --no-build-isolation -e ."


@pytest.fixture(autouse=True)
def alone(glibc_serves_torch):
    """Each test starts with no engine holding the block cache and no freed blocks kept."""
    yield


@pytest.fixture
def cache():
    """The block cache installed for one test (every freed block kept unless the test sets a cap)."""
    use_block_cache(None)
    try:
        yield lib
    finally:
        stop_block_cache()


def test_a_freed_block_serves_the_next_request_of_its_size(cache):
    live = cache.stats()["live_bytes"]  # blocks of earlier tests' tensors still alive
    t = torch.empty(3 * MiB, dtype=torch.uint8)
    addr, before = t.data_ptr(), cache.stats()
    assert addr % HUGE_PAGE == 0  # 2 MiB-aligned: advised for huge pages
    assert before["live_bytes"] == live + 3 * MiB
    del t
    assert cache.stats()["cached_bytes"] == 3 * MiB
    u = torch.empty(3 * MiB - 100 * 1024, dtype=torch.uint8)  # within an eighth: the same block
    after = cache.stats()
    assert u.data_ptr() == addr and after["hits"] == before["hits"] + 1 and after["maps"] == before["maps"]
    assert after["cached_bytes"] == 0
    small = torch.empty(BLOCK_MIN // 2, dtype=torch.uint8)  # below the threshold: torch's previous allocator
    assert cache.stats()["live_blocks"] == after["live_blocks"] and small.numel() == BLOCK_MIN // 2


def test_a_block_much_larger_than_the_request_is_not_taken(cache):
    live = cache.stats()["live_bytes"]
    t = torch.empty(4 * MiB, dtype=torch.uint8)
    del t
    before = cache.stats()
    u = torch.empty(2 * MiB, dtype=torch.uint8)  # 4 MiB is more than an eighth over: a new mapping
    after = cache.stats()
    assert after["maps"] == before["maps"] + 1 and after["live_bytes"] == live + 2 * MiB
    # before mapping, as many freed bytes went back to the system: the 4 MiB block
    assert after["unmaps"] == before["unmaps"] + 1 and after["cached_bytes"] == 0
    del u


def test_raw_frees_of_small_buffers_reach_the_previous_allocator(cache):
    """c10's raw_allocate / raw_deallocate (oneDNN's scratch buffers in bf16 matmuls): a small
    buffer comes from torch's previous allocator, and its free arrives through our raw
    deleter, which must hand it back there. Before it did, every bf16 linear layer on an
    AVX512-bf16 CPU leaked its scratch (RSS +0.5 MiB a step, test_offload's flatness test); the
    large ones are our blocks and go to the cache."""
    before = cache.stats()
    glibc = ctypes.CDLL(None)
    glibc.mallinfo2.restype = _MallInfo2
    in_use = glibc.mallinfo2().uordblks
    cache.raw_round_trip(2000, 64 * 1024)  # 125 MiB freed through our deleter
    assert glibc.mallinfo2().uordblks - in_use < 8 * MiB
    after = cache.stats()
    assert after["forwarded"] == before["forwarded"] + 2000
    cache.raw_round_trip(3, 2 * MiB)  # a block of ours each time: mapped once, then reused
    done = cache.stats()
    assert done["forwarded"] == after["forwarded"] and done["maps"] <= after["maps"] + 1
    assert done["hits"] >= after["hits"] + 2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def test_the_cap_bounds_the_freed_bytes_kept(cache):
    use_block_cache(5 * MiB)  # a second user narrows the cap (and counts as one more engine)
    try:
        ts = [torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(4)]
        before = cache.stats()
        del ts
        after = cache.stats()
        assert after["cached_bytes"] == 4 * MiB and after["unmaps"] == before["unmaps"] + 2
    finally:
        stop_block_cache()
    assert cache.stats()["installed"]  # the fixture's user still holds it


def test_stopping_restores_torchs_allocator_and_live_blocks_stay_valid():
    live = lib.stats()["live_bytes"]
    use_block_cache(None)
    t = torch.arange(MiB, dtype=torch.float32)  # 4 MiB: a block of the cache
    assert lib.stats()["live_bytes"] == live + 4 * MiB
    stop_block_cache()
    st = lib.stats()
    assert not st["installed"] and st["cached_bytes"] == 0
    u = torch.empty(4 * MiB, dtype=torch.uint8)  # glibc's again
    assert lib.stats()["live_bytes"] == live + 4 * MiB
    assert float(t.sum()) == float(MiB * (MiB - 1) / 2)
    unmaps = lib.stats()["unmaps"]
    del t  # freed after the uninstall: unmapped, not kept
    st = lib.stats()
    assert st["live_bytes"] == live and st["cached_bytes"] == 0 and st["unmaps"] == unmaps + 1
    del u


def test_threads_allocating_and_freeing_at_once_leave_the_books_balanced(cache):
    torch.manual_seed(0)

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for i in range(200):
            n = int(torch.randint(1, 6, (1,), generator=g)) * MiB
            t = torch.full((n,), i % 251, dtype=torch.uint8)
            assert int(t[-1]) == i % 251
            del t

    before = cache.stats()
    live = before["live_bytes"]
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    st = cache.stats()
    assert st["live_bytes"] == live and st["live_blocks"] == before["live_blocks"]
    assert st["hits"] + st["misses"] - before["hits"] - before["misses"] == 800


@pytest.mark.parametrize("policy,installed", [("release", True), ("cache", True), ("keep", False)])
def test_initialize_installs_it_for_the_engine_and_close_removes_it(infinity_logs, policy, installed):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    cfg = {"zero": {"stage": 3, "host_allocator": policy}, "precision": {"dtype": "fp32"}}
    model, opt = infinity.initialize(model, cfg)
    try:
        assert opt.engine.block_cache is installed and lib.stats()["installed"] is installed
        assert any("host allocator" in r.getMessage() for r in infinity_logs.records) is installed
        x = torch.randn(512, 256)  # 512 x 1024 activations: 2 MiB blocks
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        acct = opt.engine.telemetry()["host_memory"]
        assert ("blocks_in_use" in acct) is installed
        if installed:
            assert lib.stats()["hits"] + lib.stats()["misses"] > 0
            if policy == "release":
                assert acct["blocks_cached"] <= _memory_plan.RELEASE_CACHE_CAP
    finally:
        opt.engine.close()
    assert not lib.stats()["installed"] and lib.stats()["cached_bytes"] == 0


def test_without_the_module_release_falls_back_to_glibc_and_says_so(monkeypatch, infinity_logs):
    from infinity._zero import _initialize

    calls = []
    monkeypatch.setattr(_memory_plan, "_block_cache", lambda: None)
    monkeypatch.setattr(_initialize, "release_freed_blocks", lambda: calls.append(1) or True)
    assert _initialize._start_host_allocator("release") is False
    assert _initialize._start_host_allocator("cache") is False
    assert calls == [1]
    assert sum("the block cache is not built" in r.getMessage() for r in infinity_logs.records) == 2
