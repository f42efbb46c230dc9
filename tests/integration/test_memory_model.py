"""One memory model (Note [one memory model] in infinity/_offload/_memory_plan.py): the bytes the plan states
before anything is allocated are the bytes the stores then really map, category by category,
as counted where the memory is mapped and unmapped (Note [host memory ledger] in
infinity/aio/_memory.py), over a real run with real swap files; the telemetry reports the same
account; and infinity.estimate reads the same store formulas."""
import gc
import json
import os
import sys

import pytest
import torch
from _configs import zero_config
from _jobs import Jobs
from _models import build, train_losses

import infinity
from infinity._offload._memory_plan import GATHERED, host_account
from infinity._offload._preflight import plan
from infinity.aio._memory import ledger

# Fixed once allocated: the plan is exact. Bounded caches and pools: the plan is their cap.
EXACT = {"param_shards", "optimizer_states", "optimizer_buffers", "optimizer_cache"}
CAPPED = {"param_staging", "param_handoff"}


def _measured_run(tmp_path, cfg, steps=3):
    """(plan, measured peak bytes per category of this run's own mappings, the engine). Earlier
    engines are collected first: one freed during this run would lower the peak below ``before``
    plus this run's own bytes (their master weights stay mapped until the engine is collected)."""
    gc.collect()
    before = dict(ledger.snapshot()["live"])
    ledger.reset_peak()
    model, opt = infinity.initialize(build("gpt2"), cfg)
    need = plan(opt.placement, opt.cfg)
    train_losses(model, opt, "gpt2", steps)
    opt.wait_step()
    peaks = ledger.snapshot()["peak"]
    measured = {k: v - before.get(k, 0) for k, v in peaks.items() if v - before.get(k, 0) > 0}
    return need, measured, model, opt


@pytest.mark.parametrize("param,optim,dtype,gradients", [
    ("nvme", "nvme", "fp32", "cpu"), ("nvme", "nvme", "fp32", "nvme"), ("nvme", "cpu", "bf16", None),
    ("cpu", "cpu", "bf16", None), ("cpu", "nvme", "fp32", "cpu"),
])
def test_plan_equals_the_bytes_the_stores_map(tmp_path, param, optim, dtype, gradients):
    extra = {"gradients": gradients} if gradients else None
    cfg = zero_config(3, param=param, optim=optim, nvme=str(tmp_path), dtype=dtype, chunk=2048, optim_extra=extra)
    need, measured, model, opt = _measured_run(tmp_path, cfg)
    host = need["categories"]["host"]
    for cat in EXACT | ({"gradients"} if optim == "nvme" else set()):
        assert measured.get(cat, 0) == host.get(cat, 0), (cat, measured, host)
    # An overlapped step's gradient buffers (accumulating, sealed, spare): how many exist at
    # once depends on whether the next backward starts before the update ends; the plan is the cap.
    for cat in CAPPED | ({"gradients"} if optim != "nvme" else set()):
        assert measured.get(cat, 0) <= host.get(cat, 0), (cat, measured, host)
    assert measured.get(cat, 0) or not host.get(cat, 0) or cat == "param_staging"  # a cap that is used
    # Gathered buffers: the recycler keeps at most its capacity; those in use besides are the
    # persistent units' and the prefetch window's (at most depth + 2 of the largest unit).
    units = opt.engine.units
    window = (3 + 2) * max(u.full_nbytes for u in units) + sum(u.full_nbytes for u in units if u.persistent)
    assert need["categories"]["device"][GATHERED] == opt.engine.gathered_buffers.capacity
    assert measured.get(GATHERED, 0) <= opt.engine.gathered_buffers.capacity + window
    # One rank without an accelerator reads shards straight into gathered buffers: no staging pool.
    assert measured.get("param_staging", 0) == host.get("param_staging", 0) == 0
    assert sum(opt.engine.tier_bytes().values()) == need["device"] + need["host"] + sum(need["nvme"].values())
    opt.engine.close()


def test_telemetry_reports_the_host_account(tmp_path):
    cfg = zero_config(3, param="nvme", optim="nvme", nvme=str(tmp_path), chunk=2048)
    model, opt = infinity.initialize(build("gpt2"), cfg)
    train_losses(model, opt, "gpt2", 2)
    opt.wait_step()
    acct = opt.engine.telemetry()["host_memory"]
    assert acct["planned"] == {t: c for t, c in opt.engine.memory_plan["categories"].items() if c}
    for cat in ("optimizer_buffers", "optimizer_cache"):
        assert acct["mapped"][cat] >= acct["planned"]["host"][cat]  # this engine's, and any other alive
    assert acct["rss"] > sum(acct["mapped"].values())
    assert acct["peak_rss"] >= acct["rss"]
    opt.engine.close()


def test_account_without_a_plan_counts_a_new_mapping():
    from infinity.aio import aligned_empty

    before = host_account()["mapped"].get("probe", 0)
    t = aligned_empty(1 << 20, torch.float32, what="probe")
    assert host_account()["mapped"]["probe"] - before == 4 << 20
    del t
    assert host_account()["mapped"].get("probe", 0) == before


def test_estimate_reads_the_store_plan():
    """The estimator's host bytes of an NVMe placement are the stores' plan for a layout made
    from the model's shape (same chunk, host cache and staging rules as a run)."""
    from infinity._apps._estimator import estimate

    est = estimate(layers=2, hidden=512, heads=8, gpus=1, cpu_mem="64GB", gpu_mem="64GB", nvme="1TB", dtype="fp32")
    p = next(p for p in est.placements if (p.stage, p.param_tier.value, p.optimizer_tier.value) == (3, "nvme", "nvme"))
    assert p.host_bytes == sum(p.host_plan.values())
    assert set(p.host_plan) >= {"optimizer_buffers", "param_handoff"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_run_model_counts_the_bytes_a_step_moves(tmp_path, dtype):
    """The run model's NVMe bytes per step (Note [run model] in _runmodel.py) are the stores' counters of a real
    steady-state step, within what the hand-off saves or misses (a few units). fp32 parameters
    are the master's (Note [parameters from the master] in _placement.py): none written."""
    from _models import VOCAB

    from infinity._apps import _runmodel as rm

    cfg = zero_config(3, param="nvme", optim="nvme", nvme=str(tmp_path), dtype=dtype)  # default chunk and host cache
    model, opt = infinity.initialize(build("gpt2"), cfg)
    train_losses(model, opt, "gpt2", 2)
    opt.wait_step()
    opt.engine.telemetry()
    train_losses(model, opt, "gpt2", 1)
    opt.wait_step()
    tel = opt.engine.telemetry()
    written = tel["nvme_optimizer_write_bytes"] + tel["nvme_params_write_bytes"]
    run = rm.Run(params=opt.total, layers=2, hidden=32, heads=2, vocab=VOCAB, micro_batch=1, seq_len=12, dtype=dtype)
    predicted = rm.nvme_bytes(run)
    assert tel["nvme_params_write_bytes"] == (0 if dtype == "fp32" else 2 * opt.layout.param_total)
    # The stores leave the 4 KiB blocks of padding after a unit unwritten (Note [unchanged ranges
    # are not written] in _swap_pipeline.py): the moments', and the master weights' where the optimizer store writes
    # them (fp32: the parameter store writes whole unit slots). The run model counts every element.
    blocks = {b for o, n in opt.layout.opt_ranges for b in range(o // 1024, -(-(o + n) // 1024))}
    padding = opt.total - 1024 * len(blocks)
    skipped = (8 if dtype == "fp32" else 12) * padding
    assert abs(written + skipped - predicted["write"]) <= 4 * opt.total // 4, (written, skipped, predicted)
    opt.engine.close()


MEASURED_RUN = dict(layers=2, hidden=256, batch=4, seq=128)  # check_run_model.MODELS["tiny"]


@pytest.fixture(scope="module")
def measured_runs(tmp_path_factory):
    """The tiny GPT-2 of scripts/check_run_model.py trained in a fresh process per tier (its
    VmHWM is its own), both started at once (tests/_jobs.py)."""
    root = tmp_path_factory.mktemp("measured")
    root_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root_dir, "scripts", "check_run_model.py")
    with Jobs(root) as jobs:
        for tier in ("cpu", "nvme"):
            spec = dict(MEASURED_RUN, tier=tier, nvme=str(root / tier), steps=1, warmup=1)
            jobs.start(tier, [sys.executable, script, "--child", json.dumps(spec)])
        yield jobs


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_run_model_peak_rss_agrees_with_a_measured_run(measured_runs, tier):
    """Issue 18: the run model's peak RSS (Note [run model] in _runmodel.py; what ``infinity.estimate
    --step-time`` prints) is within 20% of the peak resident set of a real run of the tiny GPT-2
    of scripts/check_run_model.py, trained in a fresh process (its VmHWM is its own)."""
    from infinity._apps import _runmodel as rm

    layers, hidden, batch, seq = (MEASURED_RUN[k] for k in ("layers", "hidden", "batch", "seq"))
    proc = measured_runs.result(tier, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    run = rm.Run(params=got["params"], layers=layers, hidden=hidden, heads=hidden // 64, vocab=50257,
                 micro_batch=batch, seq_len=seq, param_tier=tier, optimizer_tier=tier)
    predicted = sum(rm.host_memory(run).values())
    assert 0.8 <= got["peak_rss"] / predicted <= 1.2, (got["peak_rss"] / 2**20, rm.host_memory(run))


def test_released_allocator_keeps_no_freed_blocks(glibc_serves_torch):
    """Note [allocator retained pages] in _memory_plan.py: once released (``zero.host_allocator: release`` where the
    block cache was not built), blocks
    of MMAP_THRESHOLD bytes or more are mappings of their own: freeing every other of 64 blocks of
    2 MiB leaves no free pages in the C heap, where the arenas would keep the holes."""
    from infinity._offload._memory_plan import malloc_bytes, release_freed_blocks

    assert release_freed_blocks() and malloc_bytes() is not None  # this project runs on glibc
    start = malloc_bytes()
    blocks = [torch.ones(1 << 19) for _ in range(64)]  # 2 MiB each
    del blocks[::2]
    now = malloc_bytes()
    assert now["retained"] - start["retained"] < 1 << 20, (start, now)
    assert now["in_use"] - start["in_use"] >= 32 * (2 << 20)  # the 32 left are counted in use
