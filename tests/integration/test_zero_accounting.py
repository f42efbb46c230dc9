"""Memory and communication of each ZeRO stage, from the engine's own accounting.

Memory (paper 000 §5): per-rank bytes of parameters, gradients and optimizer states, read
from ``engine.model_state_bytes()`` after one full step and one more backward (so Adam's
moments exist and a step's gradients are live). With Ψ parameters, Ψp the padded count (each
parameter rounded up to a multiple of N), N ranks and b bytes per compute-dtype element, ours
keeps gradient shards in fp32 and fp32 master weights plus two Adam moments:

    stage 1: params bΨ      grads bΨ       optimizer 12Ψp/N
    stage 2: params bΨ      grads 4Ψp/N    optimizer 12Ψp/N
    stage 3: params bΨp/N   grads 4Ψp/N    optimizer 12Ψp/N (8Ψp/N in fp32: the shard is the master)

The paper's mixed-precision figures (fp16 gradient shards) are 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and
16Ψ/N; ours meets them exactly in stage 1 and with +2Ψp/N (fp32 gradient shards) in stages 2-3.

Communication (paper 000 §7, Note [communication volume] in _comm.py): elements of the full
tensors moved per step, 2Ψp for stages 1 and 2 (reduce-scatter + all-gather), 3Ψp for stage 3
(all-gather in forward, again in backward, reduce-scatter), on a model that uses each
parameter once. World sizes 2 and 3 (3 divides none of the bias sizes: padding is exercised).
"""
import pytest
import torch
import torch.distributed as dist
from _configs import zero_config
from _models import batches, build, loss_of

import infinity
from infinity._runtime import _comm
from infinity.testing import run_ranks

STAGES = [1, 2, 3]
DTYPES = ["fp32", "bf16", "fp16"]
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
COMM_STEPS = 3


def _config(stage, dtype, prefetch=True):
    precision = {"dtype": dtype}
    if dtype == "fp16":
        precision["loss_scale"] = 1024.0  # static: the first step is not skipped, Adam states exist
    # persistence_threshold 0: every stage-3 parameter is partitioned between uses, as in the paper
    return zero_config(stage, bucket=2000, prefetch={"persistence_threshold": 0, "enabled": prefetch},
                       precision=precision, adam="adamw", lr=2e-3, clip=1.0)


def _counts(model, world):
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(-(-p.numel() // world) * world for p in params)


def _measure_on_ranks():
    """Per rank: model-state bytes of every (stage, dtype) and per-step comm volume per stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    memory, comm = {}, {}
    for stage in STAGES:
        for dtype in DTYPES:
            model = build("custom")
            psi, psi_padded = _counts(model, world)
            model, opt = infinity.initialize(model, _config(stage, dtype))
            first, second = (ids.chunk(world)[rank] for ids in batches(2))
            loss_of(model, "custom", first).backward()
            opt.step()
            assert not opt.skipped
            opt.zero_grad()
            loss_of(model, "custom", second).backward()
            memory[(stage, dtype)] = (psi, psi_padded, opt.engine.model_state_bytes())
    for stage in STAGES:
        for prefetch in (False, True):
            model = build("stack")
            _, psi_padded = _counts(model, world)
            _, last_padded = _counts(model.layers[-1], world)
            model, opt = infinity.initialize(model, _config(stage, "fp32", prefetch))
            g = torch.Generator().manual_seed(rank)
            steps = []
            for _ in range(COMM_STEPS):
                _comm.counters.reset()
                model(torch.randn(4, 32, generator=g)).backward()
                opt.step()
                opt.zero_grad()
                steps.append(_comm.counters.snapshot()["elements"])
            comm[(stage, prefetch)] = (psi_padded, last_padded, steps)
    return {"memory": memory, "comm": comm}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def measured(request):
    world = request.param
    return world, run_ranks(_measure_on_ranks, world, timeout=300)


def _ours(stage, dtype, psi, psi_padded, world):
    """Our documented per-rank bytes (module docstring)."""
    b, shard = BYTES[dtype], psi_padded // world
    if stage == 1:
        return {"params": b * psi, "grads": b * psi, "optimizer": 12 * shard}
    if stage == 2:
        return {"params": b * psi, "grads": 4 * shard, "optimizer": 12 * shard}
    return {"params": b * shard, "grads": 4 * shard, "optimizer": (8 if dtype == "fp32" else 12) * shard}


def _paper_mixed_precision(stage, psi, psi_padded, world):
    """Paper 000 §5 with K = 12 and fp16 parameters and gradients; Ψ/N terms padded."""
    shard = psi_padded // world
    return {1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_model_state_bytes_match_formulas(measured, stage, dtype):
    world, results = measured
    for rank, result in enumerate(results):
        psi, psi_padded, got = result["memory"][(stage, dtype)]
        assert got == _ours(stage, dtype, psi, psi_padded, world), f"rank {rank}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_meets_paper(measured, stage, dtype):
    """The paper's figure holds exactly, plus 2Ψp/N in stages 2-3 for fp32 gradient shards."""
    world, results = measured
    psi, psi_padded, got = results[0]["memory"][(stage, dtype)]
    extra = 0 if stage == 1 else 2 * psi_padded // world
    assert sum(got.values()) == _paper_mixed_precision(stage, psi, psi_padded, world) + extra


def test_padding_is_counted(measured):
    """Uneven sizes: with 3 ranks the padded count exceeds Ψ and the shards hold it."""
    world, results = measured
    psi, psi_padded, _ = results[0]["memory"][(3, "fp32")]
    assert psi_padded % world == 0
    if world == 3:
        assert psi_padded > psi


@pytest.mark.parametrize("stage", STAGES)
def test_communication_volume_per_step(measured, stage):
    """The paper's 2Ψ (stages 1-2) and 3Ψ (stage 3) exactly, without the prefetcher."""
    world, results = measured
    for rank, result in enumerate(results):
        psi_padded, _, steps = result["comm"][(stage, False)]
        gathers = 2 if stage == 3 else 1  # stage 3 gathers in forward and again in backward
        for step, elements in enumerate(steps):
            assert elements == {"all_gather": gathers * psi_padded, "reduce_scatter": psi_padded}, \
                f"rank {rank}, step {step}"
            assert sum(elements.values()) == (3 if stage == 3 else 2) * psi_padded


@pytest.mark.parametrize("stage", STAGES)
def test_prefetcher_saves_the_turn_gather(measured, stage):
    """With the prefetcher, stage 3 keeps the last forward layer gathered into backward once
    the trace is known: 3Ψ minus that layer from the second step on; stages 1-2 unchanged."""
    world, results = measured
    for rank, result in enumerate(results):
        psi_padded, last_padded, steps = result["comm"][(stage, True)]
        for step, elements in enumerate(steps):
            if stage < 3:
                expected = psi_padded
            else:
                expected = 2 * psi_padded - (last_padded if step > 0 else 0)  # step 0 records the trace
            assert elements == {"all_gather": expected, "reduce_scatter": psi_padded}, f"rank {rank}, step {step}"
