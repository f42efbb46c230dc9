"""The speculative update (Note [speculative update] in _zero/_speculative_update.py): each
unit is updated while backward goes on, speculating that the step will not clip; the guess
stands when it holds and is put back exactly when it does not. Every case compares the
parameters, master weights and both moments bit for bit with the same training with the
speculation off, at one rank and at two, and counts the pieces speculated and committed.

The device is the emulated one (Note [emulated accelerator] in _emulated.py): the host's
cores run the update while the device "computes" (``compute_delay``), as with a GPU.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
from _models import gpt2
from _update_pace import pace_chunks

import infinity
from infinity._runtime import _accelerator as acc
from infinity.testing import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")

STEPS, LAYERS, HIDDEN = 4, 4, 64


def _config(speculate: str, *, clip: float = 0.0, dtype: str = "fp32", accumulation: int = 1) -> dict:
    return {"gradient_accumulation_steps": accumulation,
            "zero": {"stage": 3, "offload_param": {"device": "cpu"}, "reduce_bucket_size": 4096,  # a bucket a block
                     "offload_optimizer": {"device": "cpu", "overlap_step": "on", "speculate": speculate,
                                           "chunk_size": 1024},
                     "prefetch": {"persistence_threshold": 0}},
            "precision": {"dtype": dtype, "on_nonfinite": "skip"}, "gradient_clipping": clip,
            "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01}}


def _train(speculate: str, *, clip: float = 0.0, dtype: str = "fp32", accumulation: int = 1,
           backwards: int = 0, nan_step: int = -1, discard_step: int = -1, delay: float = 0.0,
           update_s: float = 0.0) -> dict:
    """Train STEPS steps of ``accumulation`` micro-batches (``backwards`` of them if set: more or
    fewer than the config says); a non-finite loss at ``nan_step``; a backward dropped by
    zero_grad before ``discard_step``'s. Returns the states and the speculation's counts."""
    from infinity._runtime._accelerator import _emulated

    with acc.using("emulated"):
        dev = acc.device()
        model, opt = infinity.initialize(gpt2(layers=LAYERS, hidden=HIDDEN),
                                         config=_config(speculate, clip=clip, dtype=dtype, accumulation=accumulation))
        chunks: list = []
        if update_s:
            _slowed(opt, chunks, update_s)
        g = torch.Generator().manual_seed(3 + comm_rank())
        losses, seconds = [], []
        try:
            with _emulated.compute_delay(delay):
                for step in range(STEPS):
                    start = time.perf_counter()
                    if step == discard_step:  # a batch given up after its backward
                        ids = torch.randint(0, 96, (4, 16), generator=g).to(dev)
                        model(input_ids=ids, labels=ids).loss.backward()
                        opt.zero_grad()
                    for _ in range(backwards or accumulation):
                        ids = torch.randint(0, 96, (4, 16), generator=g).to(dev)
                        loss = model(input_ids=ids, labels=ids).loss
                        if step == nan_step:
                            loss = loss * math.nan
                        loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                    seconds.append(time.perf_counter() - start)
                opt.wait_step()
            store, spec = opt.store, opt.engine.telemetry()["speculation"]
            out = {"losses": losses, "seconds": seconds, "chunks": chunks,
                   "master": store.master.clone(), "exp_avg": store.exp_avg.clone(),
                   "exp_avg_sq": store.exp_avg_sq.clone(), "params": opt.param_store.flat.clone(),
                   "skipped": opt.nonfinite_skipped,
                   "speculated": spec["speculated"], "committed": spec["committed"]}
        finally:
            opt.engine.close()
    return out


def comm_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _slowed(opt, chunks: list, update_s: float) -> None:
    """Each chunk at a large model's pace (_update_pace.py), recording whether it was speculative."""
    pace_chunks(opt, "_update_chunk_in_range", chunks, update_s, lambda args, kwargs: kwargs.get("speculative", False))


def _assert_same_states(a: dict, b: dict) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq", "params"):
        assert torch.equal(a[key], b[key]), key  # bit for bit, not close
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=0, atol=0, equal_nan=True)
    assert a["skipped"] == b["skipped"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_guess_that_holds_stands_bit_for_bit(dtype):
    """No clipping configured, then a clip that never binds: every speculated piece stands."""
    off = _train("off", dtype=dtype)
    for clip in (0.0, 1e6):
        on = _train("always", clip=clip, dtype=dtype)
        _assert_same_states(on, off)
        assert on["speculated"] > 0 and on["committed"] == on["speculated"], on


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # the undo log of the states; the second state set
def test_clipping_puts_the_guess_back_and_the_step_is_redone_exactly(dtype):
    off, on = _train("off", clip=1e-3, dtype=dtype), _train("always", clip=1e-3, dtype=dtype)  # every step clips
    _assert_same_states(on, off)
    assert on["speculated"] > 0 and on["committed"] == 0, on


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_nonfinite_gradient_puts_the_guess_back_and_the_step_is_skipped(dtype):
    off, on = _train("off", nan_step=2, dtype=dtype), _train("always", nan_step=2, dtype=dtype)
    assert on["skipped"] == 1
    _assert_same_states(on, off)
    assert on["speculated"] > on["committed"] > 0, on  # the other steps' stood


def test_micro_batches_and_a_dropped_backward_stay_exact():
    """Two micro-batches per step as configured; then twice as many as configured (the guess
    is invalid at the first unit's second gradient, and the window learned for the next
    step); then a backward dropped by zero_grad after the speculation ran on it."""
    off, on = _train("off", accumulation=2), _train("always", accumulation=2)
    _assert_same_states(on, off)
    assert on["committed"] > 0, on
    off, on = _train("off", backwards=2, dtype="bf16"), _train("always", backwards=2, dtype="bf16")
    _assert_same_states(on, off)
    assert on["committed"] > 0, on  # from the second step on, two micro-batches are expected
    off, on = _train("off", discard_step=1, dtype="bf16"), _train("always", discard_step=1, dtype="bf16")
    _assert_same_states(on, off)


def test_on_does_not_guess_after_a_step_that_clipped():
    """speculate: on skips the guess after a step that clipped (every step here) and after the
    first step with clipping on; with no clipping it guesses from the first step on."""
    clipped, free = _train("on", clip=1e-3), _train("on")
    assert clipped["speculated"] == 0, clipped
    assert free["speculated"] > 0 and free["committed"] == free["speculated"], free
    _assert_same_states(clipped, _train("off", clip=1e-3))


def _both_at_two_ranks(clip: float) -> dict:
    on, off = _train("always", clip=clip, dtype="bf16"), _train("off", clip=clip, dtype="bf16")
    _assert_same_states(on, off)
    return {"speculated": on["speculated"], "committed": on["committed"]}


@pytest.mark.parametrize("clip,stands", [(0.0, True), (1e-3, False)])
def test_two_ranks_speculate_over_their_own_shards_exactly(clip, stands):
    for counts in run_ranks(_both_at_two_ranks, 2, clip, timeout=240):
        assert counts["speculated"] > 0, counts
        assert (counts["committed"] == counts["speculated"]) if stands else counts["committed"] == 0, counts


def test_the_update_runs_during_backward():
    """With clipping off and an update as slow as a large model's, the update of step N runs
    while the device computes backward of step N (speculative chunks counted with device
    operators running meanwhile), so a step takes about max(forward + backward, update) plus
    the tail rather than backward + max(forward, update). Timings printed, not asserted."""
    on = _train("always", delay=3e-4, update_s=0.5)  # longer than a forward: the overlapped step alone cannot hide it
    off = _train("off", delay=3e-4, update_s=0.5)
    print(f"\nstep seconds, speculative: {on['seconds'][1:]}; after backward: {off['seconds'][1:]}")
    speculative = [busy for spec, busy in on["chunks"] if spec]
    assert len(speculative) >= (STEPS - 1) * (LAYERS - 1), on["chunks"]  # most blocks each step
    assert sum(speculative) >= len(speculative) // 2, on["chunks"]  # most ran while the device computed
    assert not any(spec for spec, _ in off["chunks"])
    assert on["committed"] == on["speculated"] == len(speculative)


def test_a_second_state_set_keeps_only_the_outputs_in_the_undo_log():
    """With parameters of their own (bf16) the states are written out of place (Note [second state set] in
    _optimizer_store.py) and the undo log keeps the outputs alone; read from the master (fp32) it keeps
    the states."""
    with acc.using("emulated"):
        for dtype, second in (("bf16", True), ("fp32", False)):
            model, opt = infinity.initialize(gpt2(layers=2, hidden=32), config=_config("always", dtype=dtype))
            try:
                assert opt.store.second_set is second and opt.store.undo_log.keeps_states is not second
                assert opt.engine.memory_plan["categories"]["host"]["undo_log"] == opt.total * (
                    12 + (2 if dtype == "bf16" else 4))
                for ids in torch.randint(0, 96, (2, 4, 16), generator=torch.Generator().manual_seed(0)):
                    model(input_ids=ids.to(acc.device()), labels=ids.to(acc.device())).loss.backward()
                    opt.step()
                    opt.zero_grad()
                opt.wait_step()
                spec = opt.engine.telemetry()["speculation"]
                assert spec["speculated"] > 0
                # bytes copied aside per speculated element: the bf16 outputs (2) with a second set; the fp32 states
                # (12) where the fp32 parameters are the master and have no outputs of their own
                assert spec["kept_bytes"] % (2 if second else 12) == 0 and spec["kept_bytes"] > 0, spec
            finally:
                opt.engine.close()


def test_the_undo_log_is_in_the_plan_and_only_memory_stores_speculate():
    from infinity._offload._placement import speculate_update
    from infinity._runtime._tiers import Tier

    assert speculate_update("on", True, Tier.CPU, Tier.CPU) and speculate_update("always", True, Tier.CPU, Tier.DEVICE)
    assert not speculate_update("off", True, Tier.CPU, Tier.CPU)  # the default
    assert not speculate_update("on", True, Tier.NVME, Tier.CPU)  # no undo log on NVMe
    assert not speculate_update("on", True, Tier.CPU, Tier.NVME)
    assert not speculate_update("on", False, Tier.CPU, Tier.CPU)  # not overlapped: the update is inside step()
    with pytest.raises(Exception, match="speculate"):
        infinity.Config.from_dict({"zero": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp",
                                                                              "speculate": "on"}}})
    with acc.using("emulated"):
        model, opt = infinity.initialize(gpt2(layers=2, hidden=32), config=_config("always"))
        try:
            plan = opt.engine.memory_plan["categories"]["host"]
            assert plan["undo_log"] == 16 * opt.total  # fp32 states and fp32 outputs
            assert opt.store.undo_log.nbytes() == plan["undo_log"]
        finally:
            opt.engine.close()
