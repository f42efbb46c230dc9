"""The step-time half of Note [run model] in infinity/_apps/_runmodel.py: its counts and how its terms
combine, and the projections of ``python -m infinity.estimate --hardware ... --step-time``.
Timings are never asserted: scripts/check_run_model.py compares predictions with measured steps."""
import math

import pytest

from infinity._apps import _runmodel as rm
from infinity._apps._estimate_cli import main as estimate_main

GPT2 = dict(layers=12, hidden=768, heads=12, vocab=50257, micro_batch=4, seq_len=256)


def rates(**kw):
    return rm.Rates(**{**dict(flops=1e11, nvme_read=2e9, nvme_write=1e9, adam=5e8), **kw})


def test_flops_are_six_per_parameter_and_token_plus_attention():
    run = rm.Run(params=124_439_808, **GPT2)
    blocks, head = rm.compute_flops(run)
    assert head == 6 * 50257 * 768 * 1024
    assert blocks + head == 6 * run.params * 1024 + 12 * 12 * 4 * 256**2 * 768
    ckpt = rm.Run(params=run.params, ckpt_interval=1, **GPT2)
    assert sum(rm.compute_flops(ckpt)) * 6 == sum(rm.compute_flops(run)) * 8  # the forward runs twice


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_on_the_cpu_the_disk_hides_by_the_measured_overlap(overlap):
    run = rm.Run(params=124_439_808, param_tier="nvme", optimizer_tier="nvme", **GPT2)
    st = rm.step_time(run, rates(overlap=overlap))
    cpu, disk = st["compute"] + st["adam"], st["nvme_read"] + st["nvme_write"]
    assert st["nvme_read"] == st["nvme_bytes"]["read"] / 2e9 and st["nvme_write"] == st["nvme_bytes"]["write"] / 1e9
    assert math.isclose(st["predicted"], cpu + disk - overlap * min(cpu, disk))
    assert st["compute"] == st["flops"] / 1e11


def test_with_an_accelerator_the_disk_hides_under_the_rest_of_the_step():
    run = rm.Run(params=10**12, layers=128, hidden=25600, heads=256, vocab=0, micro_batch=7, seq_len=1024, dtype="bf16",
                 ranks=16, device_is_host=False, ckpt_interval=1, host_mem=int(1.5e12))
    st = rm.step_time(run, rm.DGX2)
    rest = st["backward"] + st["adam_head"] + max(st["forward"], st["adam"] - st["adam_head"])
    assert st["predicted"] == max(rest, st["nvme_read"] + st["nvme_write"])
    shard = math.ceil(10**12 / 16)
    # parameters (2 B) re-read by backward past the parameter cache (an eighth of the node's host
    # memory, Note [parameter cache] in _nvme_param_store.py), master weights and moments (12 B) past the host cache,
    # gradients (4 B: 1.5 TB of host memory cannot hold them) read back by the step
    cached = int(1.5e12) // 8 // 16 // 2
    assert st["nvme_bytes"]["read"] == pytest.approx(18 * shard - 2 * cached, rel=0.001)


@pytest.mark.parametrize("optimizer, overlapped", [("cpu", True), ("none", False)])
def test_with_an_accelerator_the_update_runs_beside_the_next_forward(optimizer, overlapped):
    """Note [overlapped step] in _zero_optimizer.py: backward + the embedding's Adam + max(forward, the rest's Adam); the
    copies over PCIe bound each pass:
    the forward by the parameter shards, the backward by them again and by the fp32 gradient shards."""
    run = rm.Run(params=1_557_611_200, layers=48, hidden=1600, heads=25, vocab=50257, micro_batch=8, seq_len=1024,
                 dtype="bf16", param_tier="cpu", optimizer_tier=optimizer, device_is_host=False)
    st = rm.step_time(run, rates(flops=200e12, adam=4e9, pcie=40e9))
    assert st["h2d"] == run.params * 2 / 40e9
    assert st["d2h"] == (run.params * 4 / 40e9 if optimizer == "cpu" else 0.0)
    assert st["forward"] == pytest.approx(max(st["compute"] / 3, st["h2d"]))
    assert st["backward"] == pytest.approx(max(st["compute"] * 2 / 3, st["h2d"], st["d2h"]))
    assert st["overlapped"] is overlapped
    if overlapped:  # the embedding's update inside step(), the rest beside the forward
        assert st["adam"] == run.params / 4e9
        assert st["adam_head"] == pytest.approx(50257 * 1600 / 4e9)
        rest = st["adam"] - st["adam_head"]
        assert st["predicted"] == pytest.approx(st["backward"] + st["adam_head"] + max(st["forward"], rest))
    else:  # the optimizer's states on the device: its update is not the host's
        assert st["adam"] == 0.0 and st["predicted"] == st["backward"] + st["forward"]


@pytest.mark.parametrize("adam", [4e9, 1e9])  # the update shorter than backward, and longer
def test_a_speculative_update_runs_during_backward_too(adam):
    """Note [speculative update] in _zero/_speculative_update.py: as much of the update as backward
    lasts runs beside it, the embedding's inside step(), what is left beside the next forward."""
    kw = dict(params=1_557_611_200, layers=48, hidden=1600, heads=25, vocab=50257, micro_batch=8, seq_len=1024,
              dtype="bf16", param_tier="cpu", optimizer_tier="cpu", device_is_host=False)
    r = rates(flops=200e12, adam=adam, pcie=40e9)
    serial, spec = rm.step_time(rm.Run(**kw), r), rm.step_time(rm.Run(**kw, speculate=True), r)
    rest = spec["adam"] - spec["adam_head"]
    assert spec["adam_in_backward"] == pytest.approx(min(rest, spec["backward"])) and serial["adam_in_backward"] == 0
    assert spec["predicted"] == pytest.approx(spec["backward"] + spec["adam_head"] + max(
        spec["forward"], rest - spec["adam_in_backward"]))
    assert spec["predicted"] <= serial["predicted"]


@pytest.mark.parametrize("node, ranks", [("dgx2", 16), ("h100x8", 8)])
def test_the_projection_cli_names_the_node_and_the_bottleneck(node, ranks, capsys):
    assert estimate_main(["--params", "1T", "--hardware", node, "--micro-batch", "7", "--step-time"]) == 0
    out = capsys.readouterr().out
    assert f"{ranks} rank(s)" in out and "bottleneck: nvme" in out and rm.NODES[node][0].name in out


@pytest.mark.parametrize("allocator", ["cache", "release"])
def test_a_host_cache_past_the_last_element_moves_no_negative_bytes(allocator):
    """The optimizer's host cache is whole chunks, so on a small model it ends past the last
    element: everything is cached, nothing is read past it, and every state is written through
    once. With ``zero.host_allocator: release`` (the default) the cache gives its pages back
    through forward and is read again before the update (Note [host cache] in
    _nvme_optimizer_store.py): once, whole."""
    run = rm.Run(params=2_000_000, layers=2, hidden=256, heads=4, vocab=50257, micro_batch=4, seq_len=128,
                 optimizer_tier="nvme", param_tier="nvme", host_allocator=allocator)
    _, total, *_ = rm._layout(run)
    assert rm.nvme_bytes(run) == {"read": 12 * total if allocator == "release" else 0, "write": 12 * total}


def test_the_hosts_own_work_is_counted_in_bytes_and_units():
    """Note [run model] in infinity/_apps/_runmodel.py: the gradients' landing (8 bytes an element
    of the shard) and the norm's pass (4, only when clipping) at the host's copy rate, and the
    engine's work per fetch unit (a GPT's 2 a block and 3 more unless the run says) and per step,
    on the cores beside compute and Adam."""
    run = rm.Run(params=124_439_808, param_tier="cpu", optimizer_tier="cpu", **GPT2)
    plain = rm.step_time(run, rates())
    st = rm.step_time(run, rates(host_copy=10e9, unit_s=1e-3, step_s=5e-3))
    assert st["grad_landing"] == 8 * run.params / 10e9 and st["norm"] == 4 * run.params / 10e9
    assert st["units"] == pytest.approx((2 * 12 + 3) * 1e-3 + 5e-3)
    assert st["predicted"] == pytest.approx(plain["predicted"] + st["grad_landing"] + st["norm"] + st["units"])
    unclipped = rm.step_time(rm.Run(params=run.params, param_tier="cpu", optimizer_tier="cpu", clip=False, units=40,
                                    **GPT2), rates(host_copy=10e9, unit_s=1e-3, step_s=5e-3))
    assert unclipped["norm"] == 0.0 and unclipped["units"] == pytest.approx(40e-3 + 5e-3)


def test_with_an_accelerator_the_units_work_is_issued_beside_the_devices_compute():
    run = rm.Run(params=124_439_808, param_tier="cpu", optimizer_tier="cpu", device_is_host=False, **GPT2)
    fast_host = rm.step_time(run, rates(flops=1e13, pcie=25e9, unit_s=1e-6))
    slow_host = rm.step_time(run, rates(flops=1e13, pcie=25e9, unit_s=1.0))
    assert fast_host["forward"] == max(fast_host["compute"] / 3, fast_host["h2d"])  # hidden under the device's work
    assert slow_host["forward"] == pytest.approx(slow_host["units"] / 3)  # the host issues slower than it computes
    assert slow_host["predicted"] > fast_host["predicted"]
