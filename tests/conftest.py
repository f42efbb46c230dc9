import logging
import os
import pathlib

import pytest

# Tests run several ranks on two cores: keep each process to its share of threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The emulated accelerator (Note [emulated accelerator] in _emulated.py) is registered with torch before any
# test runs a backward: autograd sizes its per-device queues at the first one. It computes
# only inside ``infinity._runtime._accelerator.using("emulated")``.
from infinity._runtime import _accelerator  # noqa: E402
from infinity._runtime._accelerator import _emulated  # noqa: E402
from infinity.testing import preload_in_ranks  # noqa: E402

# Ranks of run_ranks start with the model libraries the tests build already imported (Note
# [ranks from a forkserver] in infinity/testing.py): importing them is most of a rank's start.
preload_in_ranks("transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama")

if _accelerator.kind() != "cuda":  # beside CUDA a second accelerator confuses autograd's streams and is_pinned
    _emulated.setup()


UNIT = pathlib.Path(__file__).parent / "unit"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items):
    """The layer is the folder: every test under tests/unit is marked ``unit`` (in-process,
    seconds); tests/integration holds the rest (ranks, subprocesses, multi-second runs)."""
    for item in items:
        if UNIT in item.path.parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture
def infinity_logs(caplog):
    """The infinity logger does not propagate; hang pytest's capture handler on it directly."""
    logger = logging.getLogger("infinity")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="infinity")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def emulated():
    """The emulated device for one test, its capacity (``_emulated.set_capacity``) put back after
    it; what earlier tests left unreferenced is collected first, so it is not counted in the
    levels the test measures."""
    import gc

    gc.collect()
    with _accelerator.using("emulated"):
        capacity = _emulated.total_memory()
        try:
            yield _accelerator.device()
        finally:
            _emulated.set_capacity(capacity)


@pytest.fixture
def glibc_serves_torch():
    """Torch's CPU blocks from glibc for one test: engines of earlier tests that are still alive
    (Note [block cache] in host_alloc.cpp) give up their hold on the block cache and take it back after; no freed
    blocks are kept. Yields the native module, or None where it was not built."""
    import gc

    from infinity._offload import _memory_plan

    gc.collect()
    lib = _memory_plan._block_cache()
    if lib is None:
        yield None
        return
    users, st = _memory_plan._BLOCK_USERS[0], lib.stats()
    if st["installed"]:
        lib.uninstall()
    lib.release_cached()
    _memory_plan._BLOCK_USERS[0] = 0
    try:
        yield lib
    finally:
        assert not lib.stats()["installed"]
        if st["installed"]:
            lib.install(st["min_bytes"], True, st["cache_cap"])
        _memory_plan._BLOCK_USERS[0] = users
