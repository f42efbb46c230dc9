"""The trace-based prefetcher: it changes when bytes move, never what is computed.

- prefetch on and off train identically (stages 1-3, tiers none/cpu/nvme, 1 and 2 ranks,
  persistence_threshold 0 and default), on the GPT-2 and custom models of _models.py;
- a model whose control flow changes between iterations (a block skipped on odd steps, an
  early exit every third step) trains exactly like plain PyTorch with everything on NVMe,
  the divergences are counted (at most one per direction per iteration) and not logged in bulk;
- gathered parameter elements stay within zero.prefetch.max_live_parameters;
- slowed NVMe reads still give the same losses, and the stall shows in telemetry;
- telemetry after a step: stalls >= 0, NVMe bytes equal to what the store read, hit rate.
"""
import time

import pytest
import torch
from _configs import zero_config
from _logs import kept_logs
from _models import Stack, build, train_losses
from torch import nn

import infinity
import infinity._offload._nvme_param_store as stores
from infinity.testing import run_ranks

STEPS = 4
LR = 2e-3
CLIP = 0.5
# (stage, offload_param, offload_optimizer): stages 1-2 keep parameters whole (the
# prefetcher is idle there, but the flag must not change anything); stage 3 the subset the
# issue names.
PLACEMENTS = [(1, "none", "none"), (1, "none", "nvme"), (2, "none", "none"), (2, "none", "cpu"),
              (3, "none", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "nvme", "none")]
DEFAULT_PERSIST = None  # leave zero.prefetch.persistence_threshold at its default


def _config(stage, param, optim, nvme, *, prefetch=True, persist=DEFAULT_PERSIST, **prefetch_extra):
    pf = {"enabled": prefetch, **prefetch_extra}
    if persist is not None:
        pf["persistence_threshold"] = persist
    cfg = zero_config(stage, param=param if stage == 3 else None, optim=optim, nvme=nvme, chunk=4096, bucket=3000,
                      prefetch=pf, adam="adamw", lr=LR, weight_decay=0.01, clip=CLIP)
    if param == "nvme":  # the prefetcher's reads, not the parameter cache's hits (tests/unit/test_param_cache.py)
        cfg["zero"]["offload_param"]["max_in_cpu"] = 0
    return cfg


def _train(kind, cfg, steps=STEPS):
    model, opt = infinity.initialize(build(kind), cfg)
    try:
        losses = train_losses(model, opt, kind, steps)
        tel = opt.engine.telemetry()
    finally:
        opt.engine.close()
    return losses, tel


def _parity_runs(nvme):
    """On each rank: every (kind, placement, persistence, prefetch) combination."""
    out = {}
    for kind in ("gpt2", "custom"):
        for stage, param, optim in PLACEMENTS:
            persists = (DEFAULT_PERSIST, 0) if stage == 3 else (DEFAULT_PERSIST,)
            for persist in persists:
                for prefetch in (True, False):
                    cfg = _config(stage, param, optim, nvme, prefetch=prefetch, persist=persist)
                    out[(kind, stage, param, optim, persist, prefetch)] = _train(kind, cfg)
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def parity(request, tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp(f"nvme{request.param}"))
    # one thread per rank: tiny models, and spinning OpenMP threads only slow a shared machine
    return run_ranks(_parity_runs, request.param, nvme, timeout=300, threads=1)[0]


@pytest.mark.parametrize("kind", ["gpt2", "custom"])
@pytest.mark.parametrize("stage,param,optim", PLACEMENTS)
def test_prefetch_on_off_identical(parity, kind, stage, param, optim):
    persists = (DEFAULT_PERSIST, 0) if stage == 3 else (DEFAULT_PERSIST,)
    for persist in persists:
        on, tel_on = parity[(kind, stage, param, optim, persist, True)]
        off, tel_off = parity[(kind, stage, param, optim, persist, False)]
        assert on == pytest.approx(off, rel=0, abs=1e-6), f"persistence_threshold={persist}"
        assert on[-1] < on[0]  # it learns
        assert tel_on["trace_divergences"] == 0  # a static model never diverges
        if stage == 3 and persist == 0:  # the prefetcher really ran ahead of the computation
            assert tel_on["prefetch_hit_rate"] > tel_off["prefetch_hit_rate"]
    if stage == 3:  # every unit partitioned vs small units kept gathered: the same math
        default = parity[(kind, stage, param, optim, DEFAULT_PERSIST, True)][0]
        zero = parity[(kind, stage, param, optim, 0, True)][0]
        assert default == pytest.approx(zero, rel=0, abs=1e-6)


# ------------------------------------------------------------------ dynamic control flow


class Dynamic(nn.Module):
    """Four blocks; block 2 skipped on odd steps; an early exit after block 1 every 3rd step."""

    def __init__(self, dim=48, depth=4):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
                                     for _ in range(depth)])
        self.out = nn.Linear(dim, 1)

    def forward(self, x, step):
        h = torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            if i == 2 and step % 2 == 1:
                continue
            h = h + block(h)
            if i == 1 and step % 3 == 0:
                break
        return self.out(h).pow(2).mean()


def _dynamic_data(steps):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 48, generator=g) for _ in range(steps)]


def _dynamic_reference(steps):
    """Plain PyTorch AdamW: a block skipped in a step has no gradient, so it, its moments
    and its step count stay as they are."""
    torch.manual_seed(0)
    model = Dynamic()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step, x in enumerate(_dynamic_data(steps)):
        loss = model(x, step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _train_dynamic(cfg, steps):
    torch.manual_seed(0)
    model, opt = infinity.initialize(Dynamic(), cfg)
    losses, divergences, hit_rates = [], [], []
    with kept_logs() as handler:
        for step, x in enumerate(_dynamic_data(steps)):
            loss = model(x, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            tel = opt.engine.telemetry()
            divergences.append(tel["trace_divergences"])
            hit_rates.append(tel["prefetch_hit_rate"])
    with infinity.GatheredParameters(list(model.parameters())):
        final = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    return losses, divergences, hit_rates, handler.records, final


def test_dynamic_control_flow_on_nvme(tmp_path):
    steps = 8
    losses, divergences, hit_rates, records, final = _train_dynamic(
        _config(3, "nvme", "nvme", str(tmp_path), persist=0), steps)
    off = _train_dynamic(_config(3, "nvme", "nvme", str(tmp_path), prefetch=False, persist=0), steps)
    ref_losses, ref_final = _dynamic_reference(steps)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for ours, ref in zip(final, ref_final):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(off[0], rel=0, abs=1e-6)
    assert divergences[0] == 0  # the first iteration records
    assert sum(divergences) > 0
    assert all(d <= 2 for d in divergences), divergences  # at most one per direction per iteration
    assert len(records) < 4, [r.getMessage() for r in records]
    assert all(0.0 <= h <= 1.0 for h in hit_rates if h is not None)


# ------------------------------------------------------------------ live parameters


def _train_deep(cfg, steps=4, slow=0.0, monkeypatch=None):
    torch.manual_seed(0)
    model, opt = infinity.initialize(Stack(dim=64, depth=8), cfg)
    g = torch.Generator().manual_seed(5)
    losses, tels = [], []
    try:
        for _ in range(steps):
            loss = model(torch.randn(8, 64, generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            tels.append(opt.engine.telemetry())
        peak = opt.engine.peak_live_elems
        units = [u.full_numel for u in opt.engine.units]
    finally:
        opt.engine.close()
    return losses, tels, peak, units


@pytest.mark.parametrize("tier", ["none", "nvme"])
def test_live_parameters_bounded(tmp_path, tier):
    unit = 64 * 64 + 64
    cap = int(2.5 * unit)
    ref = _train_deep(_config(3, tier, tier, str(tmp_path), prefetch=False, persist=0))
    losses, _, peak, units = _train_deep(_config(3, tier, tier, str(tmp_path), persist=0, depth=3,
                                                 max_live_parameters=cap))
    assert max(units) == unit
    assert peak <= max(cap, max(units)), f"peak {peak} gathered elements over max_live_parameters {cap}"
    assert peak >= unit  # it did gather
    assert losses == pytest.approx(ref[0], rel=0, abs=1e-6)


@pytest.mark.parametrize("depths", [(1, 0, 0), (1, 1, 1), (3, 2, 1), (4, 3, 3)], ids=lambda d: "-".join(map(str, d)))
def test_stage_depths(tmp_path, depths):
    """NVMe->host, host->device and all-gather each run their own depth ahead: the same
    losses for every setting, and the all-gather stage holds gather_depth units ahead."""
    depth, device_depth, gather_depth = depths
    unit = 64 * 64 + 64
    ref = _train_deep(_config(3, "nvme", "nvme", str(tmp_path), prefetch=False, persist=0))
    losses, tels, peak, _ = _train_deep(_config(3, "nvme", "nvme", str(tmp_path), persist=0, depth=depth,
                                                 device_depth=device_depth, gather_depth=gather_depth))
    assert losses == pytest.approx(ref[0], rel=0, abs=1e-6)
    # module i computes while i+1 .. i+gather_depth are gathered, and no more
    assert peak == (1 + gather_depth) * unit
    if gather_depth:
        assert all(t["prefetch_hit_rate"] > 0.5 for t in tels[1:])


def test_backward_keeps_what_forward_ended_with(tmp_path):
    """The last module of forward is the first of backward: with the prefetcher on it stays
    gathered across the turn instead of being fetched again, and nothing stays gathered after
    backward. (A fetch either reads the disk or takes the shard the step handed off.)"""
    from infinity._zero._param import ParamState

    reads = {}
    for prefetch in (False, True):
        torch.manual_seed(0)
        # optimizer on NVMe: fp32 parameters with the master in memory would be the master (Note [parameters
        # from the master] in _placement.py), fetched without a read or a hand-off
        model, opt = infinity.initialize(Stack(dim=64, depth=8), _config(3, "nvme", "nvme", str(tmp_path),
                                                                          prefetch=prefetch, persist=0))
        g = torch.Generator().manual_seed(5)
        per_step = []
        for _ in range(3):
            opt.engine.telemetry()  # resets the counters
            model(torch.randn(8, 64, generator=g)).backward()
            assert all(u.state is ParamState.RELEASED for u in opt.engine.units)
            moved = opt.engine.telemetry()["bytes"]
            per_step.append(moved.get("nvme_read", 0) + moved.get("param_handoff", 0))
            opt.step()
            opt.zero_grad()
        opt.engine.close()
        reads[prefetch] = per_step
    shard_bytes = (64 * 64 + 64) * 4
    assert reads[False] == [2 * 8 * shard_bytes] * 3  # every layer fetched in forward and in backward
    assert reads[True][1:] == [(2 * 8 - 1) * shard_bytes] * 2  # the last layer is fetched once


def _tied_fetches(tmp_path, prefetch, max_live=None):
    """Per step after the first: the fetches of each unit (a read or the step's hand-off)
    in a training iteration and in a forward under no_grad; the losses."""
    from _models import gpt2

    from infinity._zero import _unit

    extra = {} if max_live is None else {"max_live_parameters": max_live}
    model, opt = infinity.initialize(gpt2(), _config(3, "nvme", "nvme", str(tmp_path), prefetch=prefetch,
                                                     persist=0, **extra))  # as in the test above
    fetched, real = [], _unit.FetchUnit.stage_to_host

    def counting(unit, **kw):
        ok = real(unit, **kw)
        if ok and not unit.store.tier.resident:
            fetched.append(unit.module_name)
        return ok

    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    train, evals, losses = [], [], []
    _unit.FetchUnit.stage_to_host = counting
    try:
        for _ in range(3):
            fetched.clear()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            train.append(sorted(fetched))
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            fetched.clear()
            with torch.no_grad():
                model(input_ids=ids)
            evals.append(sorted(fetched))
        units = sorted(u.module_name for u in opt.engine.units if u.partitioned)
    finally:
        _unit.FetchUnit.stage_to_host = real
        opt.engine.close()
    return train[1:], evals[1:], losses, units


def test_tied_embedding_kept_until_its_last_use(tmp_path):
    """GPT-2's tied embedding is used by the first module of forward and by the last: with
    the prefetcher on it stays gathered in between instead of being fetched twice per
    forward; under a max_live_parameters too small to keep it, it is fetched again, and
    every loss is the same."""
    off_train, off_eval, ref, units = _tied_fetches(tmp_path, False)
    assert "transformer.wte" in units
    twice = sorted(units + ["transformer.wte"])
    # forward fetches it for the embedding and again for the output layer; backward keeps it
    # from the output layer on, waiting for its gradient
    assert off_train == [sorted(units + twice)] * 2
    assert off_eval == [twice] * 2

    on_train, on_eval, losses, _ = _tied_fetches(tmp_path, True)
    # forward fetches every unit once; backward every unit but the tied one (kept across the turn)
    assert on_train == [sorted(units + [u for u in units if u != "transformer.wte"])] * 2
    assert on_eval == [units] * 2
    assert losses == ref

    wte = 96 * 32
    tight_train, tight_eval, tight, _ = _tied_fetches(tmp_path, True, max_live=wte + 3 * 32 * 32)
    assert tight_eval == [twice] * 2  # no room to keep it through the forward
    assert tight == ref


# ------------------------------------------------------------------ slowed I/O


def test_slow_nvme_reads_same_result(tmp_path, monkeypatch):
    fast = _train_deep(_config(3, "nvme", "nvme", str(tmp_path), persist=0))
    real = stores.NvmeParamStore.finish_read

    def slow_finish_read(self, pending, **kwargs):
        time.sleep(0.02)
        return real(self, pending, **kwargs)

    monkeypatch.setattr(stores.NvmeParamStore, "finish_read", slow_finish_read)
    losses, tels, _, _ = _train_deep(_config(3, "nvme", "nvme", str(tmp_path), persist=0))
    assert losses == fast[0]
    assert all(t["stall_s"]["nvme_read"] > 0.02 for t in tels)
    assert sum(t["stall_s"]["nvme_read"] for t in tels) > sum(t["stall_s"]["nvme_read"] for t in fast[1])


# ------------------------------------------------------------------ telemetry


def _telemetry_run(tmp_path, prefetch):
    cfg = _config(3, "nvme", "nvme", str(tmp_path), prefetch=prefetch, persist=0)
    torch.manual_seed(0)
    model, opt = infinity.initialize(Stack(dim=64, depth=8), cfg)
    g = torch.Generator().manual_seed(5)
    tels, read = [], []
    try:
        opt.engine.telemetry()  # setup traffic (initial shard writes) is not a step's
        for _ in range(3):
            before = opt.param_store.bytes_read
            loss = model(torch.randn(8, 64, generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
            tels.append(opt.engine.telemetry())
            read.append(opt.param_store.bytes_read - before)
    finally:
        opt.engine.close()
    return tels, read


def test_telemetry_after_a_step(tmp_path):
    on, read_on = _telemetry_run(tmp_path, True)
    off, read_off = _telemetry_run(tmp_path, False)
    for tels, read in ((on, read_on), (off, read_off)):
        for tel, nbytes in zip(tels, read):
            assert set(tel["stall_s"]) >= {"nvme_read", "host_to_device", "all_gather", "reduce_scatter",
                                           "grad_offload"}
            assert all(v >= 0 for v in tel["stall_s"].values()), tel["stall_s"]
            assert nbytes > 0
            assert tel["bytes"]["nvme_read"] == nbytes
            assert 0.0 <= tel["prefetch_hit_rate"] <= 1.0
            assert tel["trace_divergences"] == 0
    assert all(t["prefetch_hit_rate"] > 0.5 for t in on[1:]), [t["prefetch_hit_rate"] for t in on]
    assert all(a["prefetch_hit_rate"] > b["prefetch_hit_rate"] for a, b in zip(on[1:], off[1:]))
