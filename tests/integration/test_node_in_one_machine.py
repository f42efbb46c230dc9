"""A node in one machine: 8 gloo ranks (LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them) of a
tiny GPT-2, stage 3 with parameters and optimizer states on NVMe over 2 drives (Note [many drives]
in _offload/_drives.py: each rank's swap files on one of them), each rank on its share of the
cores (Note [rank placement] in _runtime/_topology.py): every step's loss and the trained
parameters match plain PyTorch AdamW on the whole global batch, and each rank's threads are split
and placed as the note says."""
import os

import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, rank_losses

import infinity
from infinity._runtime import _topology as topo
from infinity.testing import run_ranks

RANKS, STEPS, LR, CLIP = 8, 3, 2e-3, 0.5
DRIVES = 2
GLOBAL_BATCH = RANKS  # a row a rank


def _config(drives):
    return zero_config(3, param="nvme", optim="nvme", nvme=drives if len(drives) > 1 else drives[0], chunk=4096,
                       bucket=3000, clip=CLIP, lr=LR, adam="adamw", weight_decay=0.01)


def _rank(drives):
    model, opt = infinity.initialize(build("gpt2"), _config(drives))
    share = topo.current()
    losses = rank_losses(model, opt, batches(STEPS, global_batch=GLOBAL_BATCH), lambda m, ids: loss_of(m, "gpt2", ids))
    opt.wait_step()
    with infinity.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    telemetry = infinity.telemetry(model)
    threads_of = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    out = {
        "local": (int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])),
        "share": share, "torch_threads": torch.get_num_threads(), "adam_threads": topo.default_threads(),
        "update_threads": telemetry["update"]["peak_threads"], "placement": telemetry["placement"],
        "thread_cpus": threads_of, "policy": topo.memory_policy(),
        "swap_dirs": {d: os.listdir(d) for d in drives},
        "losses": losses, "params": params if share.local_rank == 0 else None,
    }
    infinity.close(model)
    return out


def _reference():
    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids in batches(STEPS, global_batch=GLOBAL_BATCH):
        loss = loss_of(model, "gpt2", ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    drives = [str(tmp_path_factory.mktemp(f"drive{i}")) for i in range(DRIVES)]
    return run_ranks(_rank, RANKS, drives, timeout=300), drives


def test_eight_ranks_on_the_drives_match_plain_pytorch(node):
    results, drives = node
    ref_losses, ref_params = _reference()
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    params = results[0]["params"]
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert ref_losses[-1] < ref_losses[0]  # batches repeat with period 2: it learns
    used = {d for r in results for d, names in r["swap_dirs"].items() if names}
    assert used == set(drives)  # every drive holds swap files while the ranks train
    assert all(os.listdir(d) == [] for d in drives)  # and every rank removed its own at close


def test_each_rank_runs_on_its_share_of_the_cores(node):
    results, _ = node
    allowed = os.sched_getaffinity(0)
    machine = topo.Topology.read()
    assert [r["local"] for r in results] == [(rank, RANKS) for rank in range(RANKS)]
    for rank, r in enumerate(results):
        share = r["share"]
        expected = topo.share_of(machine, allowed, rank, RANKS)
        assert share == expected
        assert share.threads == share.cores >= 1 and set(share.cpus) <= allowed
        assert r["torch_threads"] == r["adam_threads"] == share.threads
        assert 1 <= r["update_threads"] <= share.threads
        assert r["placement"]["threads"] == share.threads and r["placement"]["cpus"] == topo.format_cpulist(share.cpus)
        assert all(cpus == list(share.cpus) for cpus in r["thread_cpus"].values()), r["thread_cpus"]  # every thread
        # one NUMA node: no memory policy is set; on more, the rank's main thread prefers its node
        assert r["policy"] == ((topo.MPOL_PREFERRED, (share.node,)) if share.memory_node is not None
                               else (topo.MPOL_DEFAULT, ()))
        assert share.memory_node == (share.node if len(machine.nodes) > 1 else None)
    cores = [c for node_cpus in machine.nodes.values() for c in node_cpus if c in allowed]
    taken = [c for r in results for c in r["share"].cpus]
    assert set(taken) == set(cores)  # the ranks cover every core they may use
    if len(cores) >= RANKS:
        assert len(taken) == len(set(taken))  # and no two share one while there are enough
