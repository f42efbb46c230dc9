"""The offload engine: every tier placement trains exactly like the no-offload run.

Stage 3 with parameters on none/cpu/nvme x optimizer states on none/cpu/nvme, and optimizer
offload for stages 1 and 2, on one rank and on two, fp32 within 1e-5 (the math is the same:
only where the bytes live changes). Plus the swap-file life cycle, the preflight refusal,
an injected I/O failure, and host memory that stays flat over many steps.
"""
import itertools
import os
import time

import psutil
import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, train_accumulated, train_losses

import infinity
from infinity.testing import run_ranks

STEPS = 4
PLACEMENTS = [(3, p, o) for p, o in itertools.product(["none", "cpu", "nvme"], repeat=2)] + \
             [(s, "none", o) for s in (1, 2) for o in ("cpu", "nvme")]


def _config(stage, param, optim, nvme, dtype="fp32", **extra):
    return {**zero_config(stage, param=param if stage == 3 else None, optim=optim, nvme=nvme, chunk=4096, bucket=3000,
                          dtype=dtype, clip=0.5), **extra}


def _train(kind, cfg, steps=STEPS):
    model, opt = infinity.initialize(build(kind), cfg)
    losses = train_losses(model, opt, kind, steps)
    swap = [d.path for d in opt.engine.swap_dirs.values()]
    opt.engine.close()
    assert not any(os.path.exists(p) for p in swap), "swap files left behind after close"
    return losses


def _all_placements(nvme):
    out = {}
    for kind in ("gpt2", "custom"):
        out[(kind, "base")] = _train(kind, _config(3, "none", "none", nvme))
        for stage, param, optim in PLACEMENTS:
            out[(kind, stage, param, optim)] = _train(kind, _config(stage, param, optim, nvme))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def placements(request, tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp(f"nvme{request.param}"))
    return run_ranks(_all_placements, request.param, nvme, timeout=600)[0], nvme


@pytest.mark.parametrize("kind", ["gpt2", "custom"])
@pytest.mark.parametrize("stage,param,optim", PLACEMENTS)
def test_placement_matches_no_offload(placements, kind, stage, param, optim):
    results, nvme = placements
    assert results[(kind, stage, param, optim)] == pytest.approx(results[(kind, "base")], rel=1e-5, abs=1e-6)
    assert os.listdir(nvme) == []  # every run removed its directory


def test_bf16_nvme_matches_no_offload(tmp_path):
    base = _train("gpt2", _config(3, "none", "none", str(tmp_path), "bf16"))
    nvme = _train("gpt2", _config(3, "nvme", "nvme", str(tmp_path), "bf16"))
    assert nvme == pytest.approx(base, rel=1e-6)


def test_gradient_accumulation_on_nvme(tmp_path):
    """Several backward calls per step read, add and write the gradient shards on NVMe."""
    results = []
    for optim in ("none", "nvme"):
        model, opt = infinity.initialize(build("custom"), _config(3, optim, optim, str(tmp_path),
                                                                  gradient_accumulation_steps=2))
        results.append(train_accumulated(model, opt, "custom"))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _TailHeavy(torch.nn.Module):
    """Two used layers, then a large layer the forward never calls: it is last in the flat
    space, so the overlapped step is still updating it when the next backward runs."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 1)
        self.tail = torch.nn.Linear(128, 128)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _train_tail_heavy(cfg, monkeypatch=None):
    from infinity._zero import _zero_optimizer as _optimizer

    torch.manual_seed(0)
    model, opt = infinity.initialize(_TailHeavy(), cfg)
    during_step = []  # per gradient arrival: was the previous step still running?
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: during_step.append(opt.gate.running))
    if monkeypatch is not None:  # a slow step: every chunk of the update takes 20 ms longer
        real = _optimizer.ZeroOptimizer._update_chunk

        def slow(self, *args, **kwargs):
            time.sleep(0.02)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(_optimizer.ZeroOptimizer, "_update_chunk", slow)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        for _ in range(2):  # gradient accumulation: the second micro-batch reads and adds
            loss = model(torch.randn(6, 32, generator=g))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()  # while the step may still run: it clears the gradients being accumulated
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    return losses, params, during_step


@pytest.mark.parametrize("optim", ["nvme", "cpu"])
@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "reads"])
def test_backward_overlaps_the_running_step(tmp_path, monkeypatch, handoff, optim):
    """The next forward and backward (with accumulation, and zero_grad) run while the
    overlapped step is still updating: the same result as with the step in memory. Without
    the hand-off every fetch reads shards the step published before their writes landed.
    With the optimizer states in host memory the step overlaps too (its parameter writes)."""
    if not handoff:
        import infinity._offload._nvme_param_store as stores

        monkeypatch.setattr(stores.NvmeParamStore, "take_handoff", lambda self, offset, numel: None)
    ref = _train_tail_heavy(_config(3, "none", "none", str(tmp_path), gradient_accumulation_steps=2))
    got = _train_tail_heavy(_config(3, "nvme", optim, str(tmp_path), gradient_accumulation_steps=2), monkeypatch)
    assert any(got[2]), "no gradient arrived while the previous step was running: the test lost its point"
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_swap_dirs_are_per_run(tmp_path):
    m1, o1 = infinity.initialize(build("stack"), _config(3, "nvme", "nvme", str(tmp_path)))
    m2, o2 = infinity.initialize(build("stack"), _config(3, "nvme", "nvme", str(tmp_path)))
    d1 = {d.path for d in o1.engine.swap_dirs.values()}
    d2 = {d.path for d in o2.engine.swap_dirs.values()}
    assert d1 and d2 and not d1 & d2
    o1.engine.close()
    o2.engine.close()
    assert os.listdir(tmp_path) == []


def test_preflight_refuses_what_does_not_fit(tmp_path, monkeypatch):
    import infinity._offload._preflight as pf

    class _Tiny:
        free = 1 << 16  # far below the swap files of the smallest model

    monkeypatch.setattr(pf.shutil, "disk_usage", lambda path: _Tiny)
    with pytest.raises(pf.InsufficientResourcesError, match=r"disk under .*[GM]iB of swap files needed"):
        infinity.initialize(build("gpt2"), _config(3, "nvme", "nvme", str(tmp_path)))
    assert os.listdir(tmp_path) == []  # refused before creating anything


@pytest.mark.parametrize("dtype,swap_file", [("bf16", "params.swp"), ("fp32", "master.swp")])
def test_injected_io_failure_raises(tmp_path, dtype, swap_file):
    """fp32 parameters live in the master's file (Note [parameters from the master] in _placement.py)."""
    from infinity.aio import AioError

    cfg = _config(3, "nvme", "nvme", str(tmp_path), dtype)
    # every fetch reads the file (Note [parameter cache] in _nvme_param_store.py)
    cfg["zero"]["offload_param"]["max_in_cpu"] = 0
    model, opt = infinity.initialize(build("stack"), cfg)
    x = torch.randn(4, 32, dtype=opt.engine.dtype)
    loss = model(x)
    loss.backward()
    opt.step()
    opt.wait_step()  # the overlapped step has written every shard: now inject the failure
    path = opt.param_store.path
    os.truncate(path, 0)  # the parameter shards vanish under the engine
    with pytest.raises(AioError, match=swap_file):
        model(x)
    opt.engine.close()


def test_host_memory_flat_over_many_steps(tmp_path):
    """From step 20 on nothing may grow: every buffer, file mapping and cache is sized at
    initialize or by the first steps. What may still move is a few MiB of glibc's and Python's
    free lists. A leak of one 16 KiB scratch buffer per bf16 matmul (fixed: Note [block cache] in host_alloc.cpp,
    the raw deleter) grew RSS by 0.5 MiB a step here on AVX512-bf16 CPUs."""
    model, opt = infinity.initialize(build("gpt2"), _config(3, "nvme", "nvme", str(tmp_path), "bf16"))
    proc = psutil.Process()
    ids = batches(1)[0]
    rss = []
    for step in range(200):
        loss_of(model, "gpt2", ids).backward()
        opt.step()
        opt.zero_grad()
        if step in (20, 199):
            rss.append(proc.memory_info().rss)
    opt.engine.close()
    assert rss[1] - rss[0] < 32 << 20, f"RSS grew by {(rss[1] - rss[0]) >> 20} MiB between steps 20 and 199"


def test_io_wait_timeout_names_the_shard_and_rank(tmp_path, monkeypatch):
    """Every NVMe wait has a timeout (INFINITY_COMM_TIMEOUT seconds); its error names what
    was awaited. A 64 MiB shard read cannot land within the 1 ms timeout set here."""
    from infinity._runtime import _comm

    torch.manual_seed(0)
    # bf16: fp32 parameters would be read from the master weights in memory (Note [parameters from the master] in _placement.py)
    cfg = _config(3, "nvme", "none", str(tmp_path), "bf16")
    model, opt = infinity.initialize(torch.nn.Linear(4096, 4096), cfg)
    monkeypatch.setattr(_comm._TIMEOUT, "seconds", 1e-6)
    # the bias is below persistence_threshold: a unit of its own (Note [persistent parameters] in _unit_plan.py)
    with pytest.raises(TimeoutError, match=r"the shard of <root> \(1 params, first weight\) on rank 0"):
        model(torch.randn(2, 4096, dtype=torch.bfloat16))
    monkeypatch.setattr(_comm._TIMEOUT, "seconds", 600.0)
    opt.engine.close()


def test_fresh_shards_are_handed_off_to_the_next_forward(tmp_path):
    """The shards the overlapped step just wrote serve the next forward from memory (Note
    [hand-off] in _nvme_param_store.py); what is fetched is still exactly the updated values."""
    ref = _train_tail_heavy(_config(3, "none", "none", str(tmp_path), gradient_accumulation_steps=2))
    cfg = _config(3, "nvme", "nvme", str(tmp_path), gradient_accumulation_steps=2)
    cfg["zero"]["offload_optimizer"]["chunk_size"] = 2048  # several chunks per unit
    # else the parameter cache serves first (Note [parameter cache] in _nvme_param_store.py)
    cfg["zero"]["offload_param"]["max_in_cpu"] = 0
    torch.manual_seed(0)
    model, opt = infinity.initialize(_TailHeavy(), cfg)
    g = torch.Generator().manual_seed(3)
    losses, handed = [], []
    opt.engine.telemetry()
    for _ in range(4):
        for _ in range(2):
            loss = model(torch.randn(6, 32, generator=g))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        handed.append(opt.engine.telemetry()["bytes"].get("param_handoff", 0))
    opt.engine.close()
    assert losses == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert handed[0] == 0 and all(h > 0 for h in handed[1:]), handed  # from the second step on


def test_param_reads_wait_for_their_own_writes(tmp_path):
    """Note [write ordering] in _ordered_writes.py: writes rotate over several handles; a read right after the
    writes returns exactly what was written, whichever handle carried it, and a prefetch
    (non-blocking) read of a range still being written is refused instead of reading it."""
    from infinity._offload._nvme_param_store import NvmeParamStore
    from infinity._offload._ordered_writes import WRITE_HANDLES
    from infinity._offload._swap import SwapDir

    n, count = 1 << 16, 3 * WRITE_HANDLES
    swap = SwapDir(str(tmp_path), 0)  # the directory lives as long as this object
    store = NvmeParamStore(torch.float32, n * count, swap=swap,
                           aio_cfg=infinity.Config().aio, max_unit=n, buffer_count=2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        values = [torch.randn(n, generator=g) for _ in range(count)]
        for i, v in enumerate(values):
            store.write(i * n, v)
        for i in reversed(range(count)):
            pending = store.start_read(i * n, n, block=False)
            if pending is None:  # its write was still landing: a blocking read waits for it
                pending = store.start_read(i * n, n)
            buf = store.finish_read(pending)
            assert torch.equal(buf[:n], values[i]), f"chunk {i} read back wrong"
            store.pool.put(buf)
    store.flush()
    assert store._own._writes == []  # every write seen to land (Note [write ordering] in _ordered_writes.py)


def test_the_step_publishes_every_complete_unit_of_its_first_chunk(tmp_path, monkeypatch):
    """Note [overlapped step] in _zero_optimizer.py: once the first chunk is updated, a fetch of any unit inside it
    proceeds; the units that chunk completes are published together, not only the first."""
    import threading

    from infinity._offload._optimizer_store import MemoryOptimizerStore

    release = threading.Event()
    real_tail = MemoryOptimizerStore.update_tail

    def held_tail(self, fn):
        release.wait(30)
        return real_tail(self, fn)

    monkeypatch.setattr(MemoryOptimizerStore, "update_tail", held_tail)
    model, opt = infinity.initialize(_TailHeavy(), _config(3, "nvme", "cpu", str(tmp_path)))
    model(torch.randn(6, 32)).backward()
    opt.step()  # the head (units a and b) is updated here; the tail waits for `release`
    head_end = opt.store.head
    units = [u for u in opt.engine.units if u.opt_offset + u.shard_numel <= head_end]
    assert len(units) >= 2 and opt.gate.updated_upto >= max(u.opt_offset + u.shard_numel for u in units)
    release.set()
    opt.engine.close()


@pytest.mark.parametrize("stage,param,optim,dtype", [
    (3, "nvme", "nvme", "fp32"), (3, "nvme", "cpu", "bf16"), (3, "cpu", "cpu", "fp32"), (3, "cpu", "cpu", "bf16"),
    (3, "none", "nvme", "fp32"), (2, "none", "nvme", "fp32"), (1, "none", "cpu", "bf16"),
])
def test_preflight_plan_equals_what_the_stores_hold(tmp_path, stage, param, optim, dtype):
    """One memory model: the bytes the preflight checks before allocating are the bytes the
    stores and buffers then hold (Engine.tier_bytes), tier by tier."""
    from infinity._offload._preflight import plan

    model, opt = infinity.initialize(build("gpt2"), _config(stage, param, optim, str(tmp_path), dtype=dtype))
    need = plan(opt.placement, opt.cfg)
    held = opt.engine.tier_bytes()
    assert {"device": need["device"], "host": need["host"], "nvme": sum(need["nvme"].values())} == held
    opt.engine.close()


_HOLD = """
import sys, torch, infinity
from torch import nn
model, opt = infinity.initialize(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)), config={"zero": {"stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": sys.argv[1]},
    "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}})
print("READY", flush=True)
sys.stdin.read()  # held until the test closes this pipe (or kills the process)
"""


def test_swap_directories_of_killed_runs_are_reclaimed(tmp_path):
    """Note [swap directories] in _swap.py: a run killed with SIGKILL leaves its directory; the next run
    on the same nvme_path removes it (and says so), and leaves a live run's alone."""
    import signal
    import subprocess
    import sys

    def start():
        proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "READY"
        return proc

    killed, alive = start(), start()
    try:
        before = set(os.listdir(tmp_path))
        assert len(before) == 2
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        import logging

        records = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        logging.getLogger("infinity").addHandler(handler)
        try:
            model, opt = infinity.initialize(build("stack"), _config(3, "nvme", "nvme", str(tmp_path)))
        finally:
            logging.getLogger("infinity").removeHandler(handler)
        mine = {os.path.basename(os.path.dirname(d.path)) for d in opt.engine.swap_dirs.values()}
        left = set(os.listdir(tmp_path)) - mine
        assert len(left) == 1 and left < before  # the live run's directory stays, the killed run's is gone
        assert any("crashed runs" in r.getMessage() for r in records)
        opt.engine.close()
    finally:
        alive.stdin.close()  # ends the live run normally: its own directory goes with it
        alive.wait(30)


def test_phased_swap_io_takes_turns_and_matches_no_offload(tmp_path, monkeypatch):
    """Note [phased swap I/O] in _nvme_optimizer_store.py: with ``swap_io: phased`` no chunk's reads are submitted while
    a write of the swapper is in flight, and training is the same as without offload."""
    from infinity._offload._swap_pipeline import SwapPipeline

    submitted = []  # per tail read: was a write in flight?
    read_chunk = SwapPipeline._read_chunk

    def watched(self, s, off):
        submitted.append(any(w.in_flight() for w in self.writers))
        read_chunk(self, s, off)

    monkeypatch.setattr(SwapPipeline, "_read_chunk", watched)
    base = _train("gpt2", _config(3, "none", "none", str(tmp_path)))
    cfg = _config(3, "nvme", "nvme", str(tmp_path))
    cfg["zero"]["offload_optimizer"].update(swap_io="phased", host_cache=0, gradients="nvme")
    phased = _train("gpt2", cfg)
    assert phased == pytest.approx(base, rel=1e-5, abs=1e-6)
    assert len(submitted) > STEPS * 4 and not any(submitted)
