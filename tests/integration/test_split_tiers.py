"""One state split over host memory and NVMe trains exactly as the whole state on one tier
(Note [split tiers] in infinity/_offload/_split.py).

The reference is the same placement with nothing split (every state on NVMe, the same native
Adam), so parameters must be bit-identical; the losses also match training without offload.
The NVMe share is all that reaches the disk, and a checkpoint saved under one split loads
bit-exact under another, under all-NVMe and under all-cpu.
"""
import pytest
import torch
from _configs import zero_config
from _models import build, train_losses

import infinity
from infinity._offload._preflight import plan
from infinity._zero._unit_plan import placement_of
from infinity.config import Config
from infinity.testing import run_ranks

STEPS = 3
HALF = {"cpu": 0.5, "nvme": 0.5}
CELLS = {  # name: (stage, optimizer split, parameter split)
    "opt_half": (3, HALF, None),
    "param_half": (3, None, HALF),
    "both": (3, {"cpu": 0.75, "nvme": 0.25}, {"cpu": 0.25, "nvme": 0.75}),
    "stage2_opt_half": (2, HALF, None),
}


def _config(nvme, stage=3, opt_split=None, param_split=None, dtype="fp32", tier="nvme"):
    cfg = zero_config(stage, param=tier if stage == 3 else None, optim=tier, nvme=nvme, chunk=2048, bucket=3000,
                      clip=0.5, dtype=dtype, optim_extra={"host_cache": 0, "gradients": "nvme"})
    if opt_split:
        cfg["zero"]["offload_optimizer"]["split"] = opt_split
    if param_split:
        cfg["zero"]["offload_param"]["split"] = param_split
    return cfg


def _train(cfg, kind="gpt2"):
    model, opt = infinity.initialize(build(kind), cfg)
    losses = train_losses(model, opt, kind, STEPS)
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    store = opt.store
    out = {"losses": losses, "params": params,
           "opt_written": getattr(store, "bytes_written", 0), "opt_read": getattr(store, "bytes_read", 0),
           "opt_total": store.total, "opt_host": store.memory_elems,
           "param_host": opt.param_store.host_upto if opt.param_store is not None else 0}
    opt.engine.close()
    return out


def _all_cells(nvme):
    out = {}
    for dtype in ("fp32", "bf16"):
        out[("none", dtype)] = _train(_config(None, dtype=dtype, tier="none"))
        for stage in (2, 3):
            out[(f"whole{stage}", dtype)] = _train(_config(nvme, stage=stage, dtype=dtype))
        for name, (stage, o, p) in CELLS.items():
            out[(name, dtype)] = _train(_config(nvme, stage, o, p, dtype))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def trained(request, tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp(f"split{request.param}"))
    return run_ranks(_all_cells, request.param, nvme, timeout=900)[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_a_split_trains_bit_identically_to_the_whole_tier(trained, cell, dtype):
    stage = CELLS[cell][0]
    ref, got = trained[(f"whole{stage}", dtype)], trained[(cell, dtype)]
    assert got["opt_host"] or got["param_host"], "nothing was split: the test lost its point"
    assert got["losses"] == ref["losses"]
    for a, b in zip(got["params"], ref["params"]):
        assert torch.equal(a, b)
    base = trained[("none", dtype)]["losses"]
    assert got["losses"] == pytest.approx(base, rel=1e-3 if dtype == "bf16" else 1e-5, abs=1e-6)


def test_only_the_nvme_share_of_the_optimizer_reaches_the_disk(trained):
    """Bytes the optimizer store moves per run follow the NVMe fraction (in bf16 both runs keep
    their parameters in params.swp, so the optimizer's bytes are its own; fp32 all-NVMe
    parameters are master.swp, whose writes count as the optimizer's)."""
    ref, got = trained[("whole3", "bf16")], trained[("opt_half", "bf16")]
    share = 1 - got["opt_host"] / got["opt_total"]
    assert 0.3 < share < 0.7
    # within a tenth: ranges a step leaves unchanged are not written
    # (Note [unchanged ranges are not written] in _swap_pipeline.py)
    assert got["opt_written"] == pytest.approx(ref["opt_written"] * share, rel=0.1)
    assert got["opt_read"] == pytest.approx(ref["opt_read"] * share, rel=0.1)


def _resume(nvme, ckpt):
    """Train 2 steps under a split, save; load under every other placement and train 2 more;
    every continuation must equal the uninterrupted run's."""
    saved = _config(nvme, 3, {"cpu": 0.75, "nvme": 0.25}, {"cpu": 0.5, "nvme": 0.5})
    model, opt = infinity.initialize(build("gpt2"), saved)
    train_losses(model, opt, "gpt2", 2)
    infinity.save_checkpoint(ckpt, model, opt, tag="t")
    train_losses(model, opt, "gpt2", 2)
    with infinity.GatheredParameters(list(model.parameters())):
        ref = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    out = {}
    for name, cfg in {"other_split": _config(nvme, 3, HALF, {"cpu": 0.25, "nvme": 0.75}),
                      "all_nvme": _config(nvme, 3), "all_cpu": _config(None, 3, tier="cpu"),
                      "same": saved}.items():
        model, opt = infinity.initialize(build("gpt2"), cfg)
        infinity.load_checkpoint(ckpt, model, opt, tag="t")
        train_losses(model, opt, "gpt2", 2)
        with infinity.GatheredParameters(list(model.parameters())):
            out[name] = all(torch.equal(p.detach(), r) for p, r in zip(model.parameters(), ref))
        opt.engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_checkpoint_moves_between_splits_bit_exactly(tmp_path, world):
    got = run_ranks(_resume, world, str(tmp_path / "nvme"), str(tmp_path / "ckpt"), timeout=600)[0]
    assert got == {"other_split": True, "all_nvme": True, "all_cpu": True, "same": True}


def _auto(nvme):
    """device: auto with a host budget too small for every state: a split, logged, exact."""
    cfg = _auto_cfg(nvme)
    model, opt = infinity.initialize(build("gpt2"), cfg)
    losses = train_losses(model, opt, "gpt2", STEPS)
    placed = (opt.store.tier.name, opt.store.memory_elems, opt.store.total)
    opt.engine.close()
    return losses, placed


def test_auto_plans_a_split_that_trains_exactly(tmp_path):
    losses, (tier, host, total) = run_ranks(_auto, 1, str(tmp_path), timeout=300)[0]
    assert tier == "NVME" and 0 < host < total
    ref = run_ranks(_train, 1, _config(None, tier="none"), timeout=300)[0]["losses"]
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)


def _auto_cfg(nvme):
    """Both sections device: auto, the host budget 0.85 of what every state in host memory (auto's first
    choice) needs."""
    cfg = _config(nvme, 3)
    cfg["zero"]["offload_optimizer"]["device"] = cfg["zero"]["offload_param"]["device"] = "auto"
    roomy = Config.from_dict(cfg)
    every_state_in_host = plan(placement_of(build("gpt2"), roomy, 1)[0], roomy)
    cfg["zero"]["host_memory_limit"] = int(0.85 * (every_state_in_host["host"] + every_state_in_host["device"]))
    return cfg


def _auto_built(nvme, under_init):
    """The model built plainly, or under ``Init`` with the same ``device: auto`` config: its shards wait on
    NVMe (nothing of the model in host memory) until initialize plans where they go."""
    import os

    cfg = _auto_cfg(nvme)
    if under_init:
        with infinity.Init(config=cfg) as init:
            model = build("gpt2")
        waited = init.store.tier.name, any(f == "init.swp" for _, _, fs in os.walk(nvme) for f in fs)
    else:
        model, waited = build("gpt2"), None
    model, opt = infinity.initialize(model, cfg)
    losses = train_losses(model, opt, "gpt2", STEPS)
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    placed = (opt.store.tier.name, opt.store.memory_elems)
    opt.engine.close()
    return losses, params, placed, waited


def test_init_auto_waits_on_nvme_and_trains_as_the_model_built_plainly(tmp_path):
    plain = run_ranks(_auto_built, 1, str(tmp_path / "a"), False, timeout=300)[0]
    init = run_ranks(_auto_built, 1, str(tmp_path / "b"), True, timeout=300)[0]
    assert init[3] == ("NVME", True)
    assert init[2] == plain[2] and init[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(init[1], plain[1]))
