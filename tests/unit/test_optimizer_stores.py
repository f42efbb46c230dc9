"""Note [optimizer store protocol] in _optimizer_store.py: both optimizer stores, built directly from small parts and
driven through the sequence ``ZeroOptimizer.step`` uses (accumulate, finalize, statistics,
scale, seal, update, zero), hold the same values as a plain torch computation; the NVMe store
streamed (no host cache) and cached, with its bytes per array counted. In process, no engine."""
import faulthandler

import pytest
import torch

import infinity
from infinity._offload._nvme_optimizer_store import NvmeOptimizerStore
from infinity._offload._optimizer_store import MemoryOptimizerStore
from infinity._offload._swap import SwapDir
from infinity._runtime._tiers import Tier

TOTAL, CHUNK = 3 * 4096 + 1024, 4096  # several chunks, the last one short
RANGES = [(0, 5000), (5000, 4000), (9000, TOTAL - 9000)]  # three "units"' shards


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _store(kind, tmp_path):
    if kind == "memory":
        return MemoryOptimizerStore(Tier.CPU, TOTAL, ranges=RANGES, chunk=CHUNK)
    cache = {"nvme-streamed": 0, "nvme-cached": None}[kind]
    return NvmeOptimizerStore(TOTAL, RANGES, SwapDir(str(tmp_path), 0), infinity.Config.from_dict({}).aio, CHUNK,
                              accumulation_steps=2, host_cache=cache)


def _sgd_with_momentum(chunk, coef: float = 1.0):
    """An update touching every array: moments from the gradient (times ``coef``, clipping's
    coefficient, which the optimizer's Adam applies as it reads the gradient), the master from
    the moments."""
    grad = chunk.grad * coef
    chunk.exp_avg.mul_(0.9).add_(grad)
    chunk.exp_avg_sq.mul_(0.99).addcmul_(grad, grad, value=0.01)
    chunk.master.sub_(0.1 * chunk.exp_avg)
    if chunk.grad_read is not None:
        chunk.grad_read()


@pytest.mark.parametrize("kind", ["memory", "nvme-streamed", "nvme-cached"])
def test_a_step_sequence_matches_torch(kind, tmp_path):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(TOTAL, generator=g)
    m, v = torch.zeros(TOTAL), torch.zeros(TOTAL)
    store = _store(kind, tmp_path)
    for off, n in RANGES:
        store.load_master(off, master[off:off + n].clone())
    for step in range(3):
        before = {k: list(v) for k, v in getattr(store, "array_io", {}).items()}
        grads = [torch.randn(TOTAL, generator=g) for _ in range(2)]  # two micro-batches
        for k, grad in enumerate(grads):
            for off, n in RANGES:
                store.accumulate(off, grad[off:off + n], 0.5)
        store.wait_grad_writes()
        store.finalize_grads()
        want = 0.5 * grads[0] + 0.5 * grads[1]
        sq, finite = store.grad_stats()
        assert finite and sq == pytest.approx(float(want.double().square().sum()), rel=1e-6)
        want = want * 0.5  # clipping's coefficient, applied by the update as it reads the gradients
        store.seal_grads()
        store.update(lambda chunk: _sgd_with_momentum(chunk, 0.5))
        store.zero_grads()
        if kind != "memory":  # each state read and written once a step; the cached head is read once, at step 1
            cached = store.head if step > 0 else 0
            assert (kind == "nvme-cached") == (store.head > 0)
            for name in ("master", "exp_avg", "exp_avg_sq"):
                read, written = (a - b for a, b in zip(store.array_io[name], before[name]))
                assert (read, written) == (4 * (TOTAL - cached), 4 * TOTAL), (step, name)
        m.mul_(0.9).add_(want)
        v.mul_(0.99).addcmul_(want, want, value=0.01)
        master.sub_(0.1 * m)
        got = torch.cat([store.read_master(off, n).clone() for off, n in RANGES])
        torch.testing.assert_close(got, master, rtol=1e-6, atol=1e-6)
    store.close()


def test_the_parameter_store_reads_what_was_last_written_over_it(tmp_path):
    """Note [write ordering] in _ordered_writes.py (ParamStore on NVMe, no engine): writes rotate over several handles
    and land in any order, yet a read of a range waits for every write overlapping it, so it
    always returns the newest values; each byte written and read is counted once."""
    from infinity._offload._nvme_param_store import NvmeParamStore

    total, unit = 8 * 1024, 1024
    swap = SwapDir(str(tmp_path), 0)  # the directory lives as long as this object
    store = NvmeParamStore(torch.float32, total, swap=swap,
                           aio_cfg=infinity.Config.from_dict({}).aio, max_unit=2 * unit, buffer_count=3)
    g = torch.Generator().manual_seed(0)
    truth = torch.zeros(total)
    for rnd in range(40):
        off = int(torch.randint(0, total - unit, (1,), generator=g))
        values = torch.randn(unit, generator=g)
        store.write(off, values)
        truth[off:off + unit] = values
        look = max(0, off - unit // 2)
        torch.testing.assert_close(store.read(look, 2 * unit if look + 2 * unit <= total else total - look),
                                   truth[look:look + 2 * unit], rtol=0, atol=0)
    store.flush()
    assert store.bytes_written == 40 * unit * 4
    assert store.bytes_read >= 40 * unit * 4  # reads are whole aligned requests: at least what was asked
    for off in range(0, total, 2 * unit):  # reads are at most a buffer: the largest unit's shard
        torch.testing.assert_close(store.read(off, 2 * unit), truth[off:off + 2 * unit], rtol=0, atol=0)
    store.close()
