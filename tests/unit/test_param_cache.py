"""The parameter cache (Note [parameter cache] in infinity/_offload/_nvme_param_store.py): shards fetched from
NVMe stay in host memory up to ``zero.offload_param.max_in_cpu`` elements and serve backward's
re-reads (and, updated in place by the step, the next forward's reads). Training is exact
against plain ``torch.optim.AdamW``; the NVMe bytes read per step are counted; the cache's
memory stays under its cap in the host-memory ledger.
"""
import gc

import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, train_losses

import infinity
from infinity._offload._memory_plan import PARAM_CACHE

STEPS, LR, WD = 4, 2e-3, 0.01


def _cfg(nvme, cap, dtype="fp32"):
    cfg = zero_config(3, param="nvme", optim="nvme", nvme=nvme, chunk=4096, lr=LR, weight_decay=WD, adam="adamw",
                      dtype=dtype, prefetch={"persistence_threshold": 0}, optim_extra={"gradients": "cpu"})
    cfg["zero"]["offload_param"]["max_in_cpu"] = cap
    return cfg


def _plain():
    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = train_losses(model, opt, "gpt2", STEPS)
    return losses, [p.detach().clone() for p in model.parameters()]


def _run(nvme, cap, dtype="fp32"):
    """Losses, final weights, NVMe parameter bytes read per step, the cache's ledger peak."""
    from infinity.aio._memory import ledger

    gc.collect()  # an earlier test's engine and its cache are gone
    model, opt = infinity.initialize(build("gpt2"), _cfg(nvme, cap, dtype))
    ledger.reset_peak()
    before = ledger.snapshot()["live"].get(PARAM_CACHE, 0)
    losses, reads = [], []
    opt.engine.telemetry()
    for ids in batches(STEPS):
        loss = loss_of(model, "gpt2", ids.to(opt.engine.dtype) if ids.is_floating_point() else ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.wait_step()
        losses.append(loss.item())
        reads.append(opt.engine.telemetry()["nvme_params_read_bytes"])
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    out = dict(losses=losses, params=params, reads=reads, total=opt.layout.param_total,
               max_shard=opt.layout.max_shard, itemsize=opt.engine.itemsize,
               shards=sum(n for _, n in opt.layout.param_ranges),  # the units' shards, without the slots' padding
               cache_peak=ledger.snapshot()["peak"].get(PARAM_CACHE, 0) - before,
               planned=opt.engine.memory_plan["categories"]["host"].get(PARAM_CACHE, 0))
    opt.engine.close()
    return out


@pytest.fixture(scope="module")
def plain():
    return _plain()


def _exact(got, plain):
    ref_losses, ref_params = plain
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    for a, b in zip(got["params"], ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cache_covering_the_model_reads_nothing_after_the_first_forward(tmp_path, plain):
    off = _run(str(tmp_path), 0)
    full = _run(str(tmp_path), 1 << 30)
    _exact(off, plain)
    _exact(full, plain)
    nbytes = full["total"] * full["itemsize"]
    assert all(r >= nbytes for r in off["reads"][1:]), off["reads"]  # backward re-reads every unit, at least
    assert full["reads"][0] <= nbytes  # the first forward reads each shard once; backward reads none
    assert full["reads"][1:] == [0] * (STEPS - 1)  # the step updated the cache: nothing is read again
    assert full["cache_peak"] == full["shards"] * full["itemsize"] <= full["planned"] == nbytes  # every shard, once
    assert off["cache_peak"] == off["planned"] == 0


def test_a_partial_cache_stays_under_its_cap_and_bounds_the_reads(tmp_path, plain):
    off = _run(str(tmp_path), 0)
    cap = off["total"] // 2
    half = _run(str(tmp_path), cap)
    _exact(half, plain)
    isz = half["itemsize"]
    assert 0 < half["cache_peak"] <= cap * isz == half["planned"]  # the ledger's peak: never over the cap
    kept = half["cache_peak"] // isz  # whole units, first come first kept
    assert kept > cap - half["max_shard"]
    for r_half, r_off in zip(half["reads"][1:], off["reads"][1:]):
        # what is not cached is read at most twice (forward, backward); what is, never
        assert r_half <= 2 * (half["total"] - kept) * isz and r_half < r_off


def test_bf16_is_exact_with_the_cache(tmp_path):
    """bf16 parameters have their own file (no master alias): the cache serves them too."""
    off = _run(str(tmp_path), 0, "bf16")
    full = _run(str(tmp_path), 1 << 30, "bf16")
    assert full["losses"] == off["losses"]
    for a, b in zip(full["params"], off["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert full["reads"][1:] == [0] * (STEPS - 1)
