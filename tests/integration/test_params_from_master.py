"""fp32 parameters on NVMe are read from the master weights (Note [parameters from the master]
in _placement.py): no params.swp, no parameter bytes written per step, and training exactly
like plain ``torch.optim.AdamW`` with the overlapped step, gradient accumulation, clipping, two
ranks and a checkpoint round trip.
"""
import os

import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of

import infinity
from infinity._offload._layout import ParamSource
from infinity.testing import run_ranks

STEPS, ACCUM, LR, WD, CLIP = 4, 2, 2e-3, 0.01, 0.5
RTOL = ATOL = 1e-5  # as tests/integration/test_exact_training.py: Adam amplifies rounding where v is tiny


def _cfg(optim, nvme, **extra):
    # Small chunks: several per unit, so units span chunks and the step publishes piece by piece;
    # persistence 0: every unit is really partitioned and fetched from its tier.
    cfg = zero_config(3, param="nvme", optim=optim, nvme=nvme, chunk=4096, bucket=3000, clip=CLIP, lr=LR,
                      weight_decay=WD, adam="adamw", accumulation=ACCUM, prefetch={"persistence_threshold": 0},
                      optim_extra={"gradients": "cpu"} if optim == "nvme" else None)
    return {**cfg, **extra}


def _plain(steps=STEPS):
    """Plain PyTorch on the whole global batch: the reference losses and final weights."""
    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for ids in batches(steps, global_batch=8):
        total = 0.0
        for half in ids.chunk(ACCUM):
            loss = loss_of(model, "gpt2", half)
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, [p.detach().clone() for p in model.parameters()]


def _train(model, opt, global_batches):
    """Each rank on its slice, ACCUM micro-batches per step; per step: the global mean loss
    and the telemetry (NVMe bytes by store)."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses, tele = [], []
    opt.engine.telemetry()
    for ids in global_batches:
        total = torch.zeros(1)
        for half in ids.chunk(world)[rank].chunk(ACCUM):
            loss = loss_of(model, "gpt2", half)
            loss.backward()
            total += loss.item() / ACCUM
        opt.step()
        opt.zero_grad()
        opt.wait_step()  # the step's writes belong to this step's telemetry
        tele.append(opt.engine.telemetry())
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, tele


def _run(optim, nvme, steps=STEPS):
    model, opt = infinity.initialize(build("gpt2"), _cfg(optim, nvme))
    swap_files = sorted(f for d in opt.engine.swap_dirs.values() for f in os.listdir(d.path) if f.endswith(".swp"))
    losses, tele = _train(model, opt, batches(steps, global_batch=8))
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    blocks = {b for o, n in opt.layout.opt_ranges for b in range(o // 1024, -(-(o + n) // 1024))}
    out = dict(losses=losses, params=params, swap_files=swap_files, total=opt.layout.opt_total,
               in_blocks=1024 * len(blocks),  # elements of the 4 KiB blocks that hold a unit's states
               plan_nvme=opt.engine.memory_plan["categories"]["nvme"], tier_bytes=opt.engine.tier_bytes(),
               params_read=[t.get("nvme_params_read_bytes", 0) for t in tele],
               params_written=[t.get("nvme_params_write_bytes", 0) for t in tele],
               opt_written=[t.get("nvme_optimizer_write_bytes", 0) for t in tele])
    opt.engine.close()
    return out


@pytest.fixture(scope="module")
def plain():
    return _plain()


@pytest.mark.parametrize("world,optim", [(1, "cpu"), (1, "nvme"), (2, "nvme")])
def test_matches_plain_adamw_with_no_parameter_writes(tmp_path, plain, world, optim):
    got = _run(optim, str(tmp_path)) if world == 1 else run_ranks(_run, world, optim, str(tmp_path), timeout=300)[0]
    ref_losses, ref_params = plain
    assert got["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    for a, b in zip(got["params"], ref_params):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert "params.swp" not in got["swap_files"]
    assert got["params_written"] == [0] * STEPS  # before: 4 bytes per parameter every step
    total = got["total"]
    if optim == "nvme":
        assert got["swap_files"] == ["exp_avg.swp", "exp_avg_sq.swp", "master.swp"]
        # the master weights and both moments once each: 12 bytes per parameter, not 16; the
        # parameter store writes the master weights of whole unit slots, the optimizer store the
        # moments' blocks that hold states, not the padding after a unit (Note [unchanged ranges
        # are not written] in _swap_pipeline.py)
        assert got["in_blocks"] < total
        assert got["opt_written"] == [4 * total + 8 * got["in_blocks"]] * STEPS
        assert got["plan_nvme"].get("param_files", 0) == 0 and got["plan_nvme"]["optimizer_files"] == 12 * total
        assert got["tier_bytes"]["nvme"] == 12 * total
    else:
        assert got["swap_files"] == []  # the parameter tier is the master tensor in host memory
        assert got["params_read"] == [0] * STEPS
        assert sum(got["plan_nvme"].values()) == 0 and got["tier_bytes"]["nvme"] == 0


def _checkpoint_round_trip(tmp, src, dst):
    """Train half the steps in ``src``, save; resume in ``dst`` for the other half."""
    steps = batches(STEPS, global_batch=8)
    model, opt = infinity.initialize(build("gpt2"), _cfg(src, f"{tmp}/nvme"))
    first, _ = _train(model, opt, steps[: STEPS // 2])
    infinity.save_checkpoint(f"{tmp}/ck", model, opt)
    opt.engine.close()
    model, opt = infinity.initialize(build("gpt2", seed=5), _cfg(dst, f"{tmp}/nvme"))
    infinity.load_checkpoint(f"{tmp}/ck", model, opt)
    second, _ = _train(model, opt, steps[STEPS // 2 :])
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    return first + second, params


@pytest.mark.parametrize("src,dst", [("nvme", "nvme"), ("nvme", "cpu")])
def test_checkpoint_round_trip_matches_plain_adamw(tmp_path, plain, src, dst):
    losses, params = _checkpoint_round_trip(str(tmp_path), src, dst)
    ref_losses, ref_params = plain
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


FROZEN_LAYERS = 7  # of 9 transformer blocks; the embeddings, the last two blocks and ln_f train


def _partly_frozen(seed=0):
    from _models import gpt2

    model = gpt2(seed, layers=9)
    for block in model.transformer.h[:FROZEN_LAYERS]:
        block.requires_grad_(False)
    return model


def _plain_partly_frozen():
    model = _partly_frozen()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    losses = []
    for ids in batches(STEPS, global_batch=8):
        total = 0.0
        for half in ids.chunk(ACCUM):
            loss = loss_of(model, "gpt2", half)
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, [p.detach().clone() for p in model.parameters()]


def _swap_bytes(opt) -> dict:
    return {f: os.path.getsize(os.path.join(d.path, f)) for d in opt.engine.swap_dirs.values()
            for f in os.listdir(d.path) if f.endswith(".swp")}


@pytest.mark.parametrize("resume", ["nvme", "cpu"])
def test_partly_frozen_model_stores_nothing_twice(tmp_path, resume):
    """Frozen units leave the trainable ones read from master.swp: the swap files hold the
    trainable units' master weights and moments and the frozen units' parameters, each once;
    training stays exact, also resumed from a checkpoint in the same placement or in one that
    keeps every unit in params.swp (optimizer states in host memory)."""
    model, opt = infinity.initialize(_partly_frozen(), _cfg("nvme", f"{tmp_path}/nvme"))
    layout = opt.layout
    assert opt.placement.param_source is ParamSource.MASTER_FILE and layout.frozen_total > 0
    files = _swap_bytes(opt)
    assert files == {"master.swp": 4 * layout.opt_total, "exp_avg.swp": 4 * layout.opt_total,
                     "exp_avg_sq.swp": 4 * layout.opt_total, "params.swp": 4 * layout.frozen_total}
    assert opt.engine.memory_plan["categories"]["nvme"] == {"optimizer_files": 12 * layout.opt_total,
                                                            "param_files": 4 * layout.frozen_total}
    # the states of the trainable parameters plus the frozen parameters, each slot padded to 2048
    # elements: at most one slot's padding per unit above 12 bytes per trainable parameter and 4
    # per frozen one
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    padding = 4 * 3 * 2048 * len(opt.engine.units)
    assert 12 * trainable + 4 * frozen <= sum(files.values()) <= 12 * trainable + 4 * frozen + padding
    losses, tele = _train(model, opt, batches(STEPS // 2, global_batch=8))
    assert [t.get("nvme_params_write_bytes", 0) for t in tele] == [0] * (STEPS // 2)  # frozen: never rewritten
    infinity.save_checkpoint(f"{tmp_path}/ck", model, opt)
    opt.engine.close()
    model, opt = infinity.initialize(_partly_frozen(seed=5), _cfg(resume, f"{tmp_path}/nvme"))
    assert opt.placement.param_source is (ParamSource.OWN if resume == "cpu" else ParamSource.MASTER_FILE)
    infinity.load_checkpoint(f"{tmp_path}/ck", model, opt)
    more, _ = _train(model, opt, batches(STEPS, global_batch=8)[STEPS // 2 :])
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    ref_losses, ref_params = _plain_partly_frozen()
    assert losses + more == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_partly_frozen_model_with_the_master_in_memory_keeps_only_the_frozen_shards(tmp_path):
    """MASTER with frozen units: the parameter store is the master tensor for the trainable
    units and a tensor of the frozen units' shards beside it on the same tier, nothing twice;
    exact, also resumed in the NVMe placement from an asynchronous checkpoint."""
    cfg = zero_config(3, param="cpu", optim="cpu", chunk=4096, bucket=3000, clip=CLIP, lr=LR, weight_decay=WD,
                      adam="adamw", accumulation=ACCUM, prefetch={"persistence_threshold": 0})
    model, opt = infinity.initialize(_partly_frozen(), cfg)
    layout, store = opt.layout, opt.param_store
    assert opt.placement.param_source is ParamSource.MASTER and layout.frozen_total > 0
    master, frozen = store.resident_tensors()
    assert master is opt.store.master_view() and frozen.numel() == layout.frozen_total
    host = opt.engine.memory_plan["categories"]["host"]
    assert host["param_shards"] == 4 * layout.frozen_total  # the trainable units' are the master's
    assert opt.engine.tier_bytes()["host"] == sum(host.values())
    losses, _ = _train(model, opt, batches(STEPS // 2, global_batch=8))
    saving = infinity.save_checkpoint(f"{tmp_path}/ck", model, opt, blocking=False)  # the states of the call ...
    _train(model, opt, batches(1, global_batch=8))  # ... not those of a step taken meanwhile
    saving.wait()
    opt.engine.close()
    model, opt = infinity.initialize(_partly_frozen(seed=5), _cfg("nvme", f"{tmp_path}/nvme"))
    infinity.load_checkpoint(f"{tmp_path}/ck", model, opt)
    more, _ = _train(model, opt, batches(STEPS, global_batch=8)[STEPS // 2 :])
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    ref_losses, ref_params = _plain_partly_frozen()
    assert losses + more == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
