"""The engine's own plan on the meta device (Note [planned by the engine] in
infinity/_apps/_plan.py): a trillion-parameter decoder planned for a DGX-2 and a DGX H100 agrees
with the paper's formulas and is the estimator's row of that placement, and allocates nothing; a
small model's plan is what a real engine on this machine builds, swap file by swap file."""
import os

import pytest
import torch
from _configs import zero_config
from _models import gpt2

import infinity
from infinity._apps import _runmodel as rm
from infinity._apps._estimate_model import Shape, parse_size
from infinity._apps._estimator import Precision, estimate
from infinity._apps._plan import Node, build_meta, plan_config, plan_model
from infinity._offload._placement import Machine
from infinity.testing import run_ranks

SHAPE = Shape(layers=128, hidden=25600, heads=200)  # GPT-2 of 1.008T parameters
NODES = {"dgx2": 8, "h100x8": 8}  # drives


def _node(name: str) -> Node:
    _, gpus, gpu_mem, cpu_mem, nvme = rm.NODES[name]
    return Node(ranks=gpus, nodes=1, accelerator=True, gpu_mem=parse_size(gpu_mem), host_mem=parse_size(cpu_mem),
                nvme=parse_size(nvme), name=name)


@pytest.fixture(scope="module")
def trillion():
    return build_meta(shape=SHAPE)


@pytest.mark.parametrize("name", sorted(NODES))
def test_a_trillion_parameters_planned_agree_with_the_formulas(tmp_path, trillion, name):
    node = _node(name)
    drives = tuple(f"{tmp_path}/nvme{i}" for i in range(NODES[name]))
    cfg = plan_config("nvme,nvme", "bf16", drives=drives)
    plan = plan_model(trillion, cfg, node)
    psi, ranks = plan.params, node.ranks
    assert 1.0e12 < psi < 1.01e12 and plan.trainable == psi
    assert all(p.device.type == "meta" for p in trillion.parameters())  # nothing allocated ...
    assert not any(os.scandir(tmp_path))  # ... and no file made
    _, gpus, gpu_mem, cpu_mem, nvme = rm.NODES[name]
    est = estimate(layers=SHAPE.layers, hidden=SHAPE.hidden, heads=SHAPE.heads, gpus=gpus, gpu_mem=gpu_mem,
                   cpu_mem=cpu_mem, nvme=nvme, dtype="bf16", arch="gpt2")
    row = est.placement(3, "nvme", "nvme")
    prec = Precision.of("bf16")
    shard = -(-psi // ranks)
    # 002 §3 per rank: the bf16 parameters (2 bytes) and the fp32 states with the fp32 gradient
    # (16 bytes: master, m, v, gradient), to within each unit's padding and 4 KiB alignment
    files = plan.swap_files
    assert files["params.swp"] == pytest.approx(prec.param * shard, rel=1e-4)
    fp32 = sum(n for f, n in files.items() if f != "params.swp") + plan.categories["host"].get("gradients", 0)
    assert fp32 == pytest.approx(prec.optimizer * shard, rel=1e-4)
    assert sum(files.values()) == plan.per_rank["nvme"]  # the swap files are the memory model's NVMe bytes
    # the paper also counts the bf16 gradient (2 bytes) with the optimizer's tier; the engine
    # never stores it: it is reduce-scattered from the device's buckets into the fp32 gradient
    assert est.params == psi
    assert est.terms.model_states == pytest.approx(plan.per_rank["nvme"] * ranks + prec.grad * psi, rel=1e-4)
    # the estimator's row of this placement is this plan (Note [the planned decoder] in _estimate_model.py)
    assert row.nvme_bytes == plan.per_rank["nvme"] * ranks and row.host_bytes == plan.host_per_rank * ranks
    assert row.host_plan == {k: ranks * v for k, v in plan.categories["host"].items()}
    # every drive of the node: its ranks' swap files (Note [many drives] in _drives.py)
    assert sorted(plan.drives) == sorted(drives) and sorted(plan.drive_ranks) == sorted(drives)
    assert set(plan.drives.values()) == {plan.per_rank["nvme"] * ranks // len(drives)}
    assert sorted(r for mine in plan.drive_ranks.values() for r in mine) == list(range(ranks))  # each on one drive
    assert plan.host_per_rank * ranks <= node.host_mem and plan.per_rank["nvme"] * ranks <= node.nvme


def _engine_built(cfg: dict) -> dict:
    """What a real engine of the small model holds on this rank: its preflight plan, its swap files, its layout."""
    model, opt = infinity.initialize(gpt2(layers=3), cfg)
    try:
        return {"categories": opt.engine.memory_plan["categories"],
                "swap_files": {f: os.path.getsize(os.path.join(d.path, f)) for d in opt.engine.swap_dirs.values()
                               for f in os.listdir(d.path) if f.endswith(".swp")},
                "layout": (opt.layout.param_total, opt.layout.opt_total, len(opt.engine.units))}
    finally:
        infinity.close(model)


@pytest.mark.parametrize("world", [1, 2])
def test_a_small_plan_is_what_the_engine_builds_here(tmp_path, world):
    """The plan of a model on the meta device, for this machine, is the preflight's plan of the
    real engine on each rank, and its swap files are the files each rank makes."""
    cfg = zero_config(3, param="nvme", optim="nvme", nvme=str(tmp_path / "nvme"), dtype="bf16", chunk=4096)
    here = Machine.here()
    node = Node(ranks=world, nodes=1, accelerator=here.accelerator, gpu_mem=here.host_available,
                host_mem=here.host_available, nvme=1 << 40)
    with torch.device("meta"):
        planned = plan_model(gpt2(layers=3), infinity.Config.from_dict(cfg), node)
    built = [_engine_built(cfg)] if world == 1 else run_ranks(_engine_built, world, cfg, timeout=300)
    for rank in built:
        assert planned.categories == rank["categories"]
        assert planned.swap_files == rank["swap_files"]
        assert (planned.param_total, planned.opt_total, planned.units) == rank["layout"]
