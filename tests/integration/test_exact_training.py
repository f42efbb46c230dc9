"""Exact training for every model a user fine-tunes: infinity matches plain PyTorch AdamW.

Each cell trains one tiny model (tests/_hf_models.py: Hugging Face GPT-2 with tied
embeddings, Llama, Llama with its lower half frozen and T5, a mixture of experts whose experts
run only on the tokens routed to them, and a stack whose lower half is frozen) for a few fp32
steps under infinity, and the same model, same seed, same data, under plain
``torch.optim.AdamW`` (with ``clip_grad_norm_`` where the cell clips). Every step's loss and
the final weights must agree within 1e-5, and what plain AdamW leaves untouched (frozen
parameters, experts no token reached) must keep its initial values bit for bit. The grid
crosses the ZeRO stage, stage 3's parameter tier (device, CPU, NVMe; persistence threshold 0
where every unit must really be partitioned), the optimizer tier and activation checkpointing
(none, reentrant, non-reentrant, and for the custom models a checkpointed block that
checkpoints a sub-block again), on one rank and, for a subset, on two gloo ranks each holding
half of the global batch.

Axes that are independent are not fully crossed: the MoE, frozen and T5 models run a subset.
The plain-PyTorch references are checked too: checkpointing changes nothing there, the
weights move, and the MoE's routing really leaves one expert idle on every step and another
idle on every other step (``torch.optim.AdamW`` then skips those parameters and keeps a
per-parameter step count). Both ranks' halves of a batch reach the same experts (the grid
compares rank 0's routing with the whole batch's), so stage 3 gathers the same units on both.
"""
from __future__ import annotations

import functools
import os
import traceback
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from _hf_models import CUSTOM_MODES, HF_MODES, MoE, batches, build, loss_of

import infinity
from infinity.testing import run_ranks

# A nested reentrant checkpoint runs its inner checkpoint inside the outer one's no-grad forward,
# where torch warns that no input requires grad; the recomputation in backward is the real pass.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")

STEPS = 4
LR, WEIGHT_DECAY = 1e-3, 0.01
RTOL = ATOL = 1e-5
SMALL = 200  # a persistence threshold above the tiny models' norms and biases (32-128), below their matrices


@dataclass(frozen=True)
class Cell:
    kind: str
    mode: str  # activation checkpointing: none, reentrant, nonreentrant, nested, nested_reentrant
    stage: int
    param: str = "none"  # stage 3: zero.offload_param.device
    optim: str = "none"  # zero.offload_optimizer.device
    persist: Optional[int] = None  # stage 3: zero.prefetch.persistence_threshold (None: the default)
    clip: float = 0.0

    @property
    def id(self) -> str:
        parts = [self.kind, f"s{self.stage}"]
        if self.stage == 3:
            parts.append(f"param-{self.param}")
        parts.append(f"opt-{self.optim}")
        if self.persist is not None:
            parts.append(f"persist{self.persist}")
        if self.clip:
            parts.append(f"clip{self.clip:g}")
        parts.append(self.mode)
        return "-".join(parts)

    def config(self, nvme: str) -> dict:
        zero = {"stage": self.stage, "reduce_bucket_size": 4096,
                "offload_optimizer": {"device": self.optim, "nvme_path": nvme if self.optim == "nvme" else None}}
        if self.stage == 3:
            zero["offload_param"] = {"device": self.param, "nvme_path": nvme if self.param == "nvme" else None}
            if self.persist is not None:
                zero["prefetch"] = {"persistence_threshold": self.persist}
        return {"zero": zero, "precision": {"dtype": "fp32"},
                "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
                "gradient_clipping": self.clip}


def _grid_one_rank() -> list:
    cells = []
    for kind in ("gpt2", "llama"):
        for mode in HF_MODES:
            cells += [Cell(kind, mode, 1, optim="nvme" if (kind, mode) == ("gpt2", "reentrant") else "none"),
                      Cell(kind, mode, 2, optim={"reentrant": "cpu", "nonreentrant": "nvme"}.get(mode, "none")),
                      Cell(kind, mode, 3, "none", "none", persist=0),
                      Cell(kind, mode, 3, "cpu", "cpu"),
                      Cell(kind, mode, 3, "nvme", "nvme" if kind == "gpt2" else "cpu", persist=0)]
        cells.append(Cell(kind, "nonreentrant", 3, "none", "none"))  # the default threshold: units stay gathered
        # Note [persistent parameters] in _unit_plan.py: the norms and biases stay gathered, the matrices do not
        cells += [Cell(kind, "none", 3, "none", "none", persist=SMALL),
                  Cell(kind, "reentrant", 3, "nvme", "cpu", persist=SMALL)]
    cells += [Cell("gpt2", "nonreentrant", 3, "nvme", "nvme", persist=0, clip=1.0),
              Cell("llama", "reentrant", 2, clip=1.0)]
    cells += [Cell("llama_frozen", "reentrant", 2)]
    cells += [Cell("llama_frozen", mode, 3, "none", "none", persist=0) for mode in HF_MODES]
    cells += [Cell("llama_frozen", "nonreentrant", 3, "nvme", "nvme", persist=0)]
    cells += [Cell("t5", "none", 1), Cell("t5", "nonreentrant", 2)]
    cells += [Cell("t5", mode, 3, "none", "none", persist=0) for mode in HF_MODES]
    cells += [Cell("t5", mode, 3, "nvme", "nvme", persist=0) for mode in ("reentrant", "nonreentrant")]
    cells += [Cell("moe", "none", 1), Cell("moe", "none", 2), Cell("moe", "nonreentrant", 2, optim="nvme"),
              Cell("moe", "none", 3, "none", "none", persist=0), Cell("moe", "nonreentrant", 3, "none", "none", persist=0),
              Cell("moe", "reentrant", 3, "nvme", "nvme", persist=0), Cell("moe", "nested", 3, "nvme", "cpu", persist=0)]
    cells += [Cell("frozen", "nested", 1), Cell("frozen", "none", 2), Cell("frozen", "reentrant", 2),
              Cell("frozen", "nested", 2, optim="nvme")]
    cells += [Cell("frozen", mode, 3, "none", "none", persist=0) for mode in CUSTOM_MODES]
    cells += [Cell("frozen", mode, 3, "nvme", "nvme", persist=0) for mode in ("nonreentrant", "nested", "nested_reentrant")]
    cells += [Cell("frozen", "nested", 3, "cpu", "cpu")]
    return cells


GRID_ONE_RANK = _grid_one_rank()
GRID_TWO_RANKS = [
    Cell("gpt2", "nonreentrant", 3, "nvme", "nvme", persist=0),
    Cell("gpt2", "reentrant", 3, "nvme", "cpu", persist=0),
    Cell("llama", "nonreentrant", 3, "nvme", "cpu", persist=0),
    Cell("llama", "reentrant", 3, "nvme", "nvme", persist=0),
    Cell("gpt2", "reentrant", 2),
    Cell("llama", "nonreentrant", 1, optim="nvme"),
    Cell("llama_frozen", "nonreentrant", 3, "nvme", "nvme", persist=0),
    Cell("t5", "nonreentrant", 3, "nvme", "nvme", persist=0),
    Cell("t5", "reentrant", 3, "none", "none", persist=0),
    Cell("gpt2", "none", 3, "none", "none", persist=0),
    Cell("llama", "reentrant", 2, optim="nvme"),
    Cell("llama_frozen", "reentrant", 3, "none", "none", persist=0),
    Cell("moe", "none", 2),
    Cell("moe", "nonreentrant", 3, "nvme", "nvme", persist=0),
    Cell("frozen", "nested", 3, "nvme", "nvme", persist=0),
    Cell("frozen", "nonreentrant", 3, "none", "none", persist=0),
    Cell("frozen", "nested_reentrant", 2),
]
assert len({c.id for c in GRID_ONE_RANK}) == len(GRID_ONE_RANK)
assert len({c.id for c in GRID_TWO_RANKS}) == len(GRID_TWO_RANKS)


# ------------------------------------------------------------------ training


def _named_params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def reference(kind: str, mode: str, clip: float = 0.0):
    """Plain PyTorch on the whole global batch: losses, final weights, initial weights, routing."""
    model = build(kind, mode)
    initial = _named_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for ids, targets in batches(kind, STEPS):
        loss = loss_of(model, kind, ids, targets)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _named_params(model), initial, getattr(model, "routing", None)


def global_losses(model, opt, kind: str, rank: int, world: int) -> list:
    """STEPS steps on this rank's share of every global batch; the global mean loss of each."""
    import torch.distributed as dist

    losses = []
    for ids, targets in batches(kind, STEPS):
        loss = loss_of(model, kind, ids.chunk(world)[rank], targets.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def train(cell: Cell, nvme: str):
    """infinity on this rank's share of every global batch: the global mean loss of each step,
    the final weights (gathered) and the MoE's routing."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model, opt = infinity.initialize(build(cell.kind, cell.mode), config=cell.config(nvme))
    swap = [d.path for d in opt.engine.swap_dirs.values()]
    try:
        losses = global_losses(model, opt, cell.kind, rank, world)
        with infinity.GatheredParameters(list(model.parameters())):
            params = _named_params(model)
    finally:
        opt.engine.close()
    left = [p for p in swap if os.path.exists(p)]
    assert not left, f"swap files left behind after close: {left}"
    return losses, params, getattr(model, "routing", None)


def _train_cells(cells, nvme):
    """On each rank: every cell in turn; a cell that raises reports its traceback."""
    out = {}
    for cell in cells:
        try:
            out[cell.id] = train(cell, nvme)
        except Exception:  # noqa: BLE001 - reported by the cell's test
            out[cell.id] = traceback.format_exc()
    return out


def check_matches_reference(cell: Cell, result) -> None:
    if isinstance(result, str):
        pytest.fail(f"{cell.id} raised on a rank:\n{result}")
    losses, params, routing = result
    ref_losses, ref_params, initial, ref_routing = reference(cell.kind, cell.mode, cell.clip)
    assert routing == ref_routing  # MoE: the same experts ran on every step
    assert params.keys() == ref_params.keys()
    problems = []
    # Parameters plain AdamW never touched (frozen ones, experts no token reached) keep their
    # initial values bit for bit: a drift by weight decay alone is below the tolerance.
    moved = [n for n, p in params.items() if torch.equal(ref_params[n], initial[n]) and not torch.equal(p, initial[n])]
    if moved:
        problems.append(f"{len(moved)} parameters that plain AdamW leaves untouched changed: " + ", ".join(
            f"{n} by {(params[n] - initial[n]).abs().max().item():.2e}" for n in moved[:6]))
    if losses != pytest.approx(ref_losses, rel=RTOL, abs=ATOL):
        problems.append("per-step losses differ: " + ", ".join(
            f"step {i}: {a:.7f} vs {b:.7f}" for i, (a, b) in enumerate(zip(losses, ref_losses))))
    bad = sorted(((p - ref_params[n]).abs().max().item(), n) for n, p in params.items()
                 if not torch.allclose(p, ref_params[n], rtol=RTOL, atol=ATOL))[::-1]
    if bad:
        problems.append(f"{len(bad)} of {len(params)} parameters differ after {STEPS} steps; largest |diff|: "
                        + ", ".join(f"{n} {e:.2e}" for e, n in bad[:6]))
    assert not problems, f"{cell.id} does not match plain AdamW:\n" + "\n".join(problems)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_small_parameters_stay_gathered_beside_their_blocks_partitioned_ones(kind, tmp_path):
    """Note [persistent parameters] in _unit_plan.py: zero.prefetch.persistence_threshold is per
    parameter, as DeepSpeed's stage3_param_persistence_threshold: within one block, the
    parameters below it (norms, biases) stay gathered after backward while the block's matrices
    are released, and the gathered elements are exactly the small parameters'. Training still
    matches plain AdamW."""
    from infinity._zero._param import ParamState, info_of

    cell = Cell(kind, "none", 3, "cpu", "cpu", persist=SMALL)
    model, opt = infinity.initialize(build(kind), config=cell.config(str(tmp_path)))
    engine = opt.engine
    try:
        named = dict(model.named_parameters())
        small = {n for n, p in named.items() if p.numel() < SMALL}
        assert small and len(small) < len(named)
        block = lambda n: ".".join(n.split(".")[:3])  # noqa: E731 - transformer.h.0, model.layers.0
        assert {block(n) for n in small} & {block(n) for n in named if n not in small}  # one block holds both
        for ids, targets in batches(kind, 2):
            loss_of(model, kind, ids, targets).backward()
            for name, p in named.items():
                unit = info_of(p).unit
                assert unit.persistent is (name in small), name
                assert unit.state is (ParamState.AVAILABLE if name in small else ParamState.RELEASED), name
            assert engine.ledger.live == sum(named[n].numel() for n in small)  # gathered: the small ones only
            opt.step()
            opt.zero_grad()
    finally:
        infinity.close(model)
    check_matches_reference(cell, train(cell, str(tmp_path)))


# ------------------------------------------------------------------ the references themselves


REF_KINDS = [(k, m) for k in ("gpt2", "llama", "llama_frozen", "t5") for m in HF_MODES if m != "none"] + \
            [(k, m) for k in ("moe", "frozen") for m in CUSTOM_MODES if m != "none"]


@pytest.mark.parametrize("kind,mode", REF_KINDS, ids=[f"{k}-{m}" for k, m in REF_KINDS])
def test_plain_pytorch_checkpointing_is_exact(kind, mode):
    """The reference of a checkpointed cell trains exactly like the same model without
    checkpointing: the mode really recomputes and every parameter still gets its gradient."""
    losses, params, initial, _ = reference(kind, mode)
    base_losses, base_params, _, _ = reference(kind, "none")
    assert losses == pytest.approx(base_losses, rel=1e-6, abs=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(p, base_params[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_frozen", "t5", "moe", "frozen"])
def test_plain_pytorch_reference_trains(kind):
    """Every trainable parameter of the reference moves, except the experts no token reached;
    frozen ones do not. The MoE's idle experts are idle as the grid needs them to be."""
    losses, params, initial, routing = reference(kind, "none")
    model = build(kind)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    dead = {n for n in params if f"experts.{MoE.DEAD}." in n} if kind == "moe" else set()
    for name, p in params.items():
        moved = not torch.equal(p, initial[name])
        assert moved == (name not in frozen and name not in dead), name
    if kind in ("frozen", "llama_frozen"):
        assert frozen and len(frozen) < len(params)
    if kind == "moe":
        assert len(routing) == STEPS
        for step, layers in enumerate(routing):
            for used in layers:
                assert MoE.DEAD not in used and 0 in used and 1 in used
                assert (MoE.SOMETIMES in used) == (step % 2 == 0), routing


# ------------------------------------------------------------------ the grid


@pytest.mark.parametrize("cell", GRID_ONE_RANK, ids=lambda c: c.id)
def test_one_rank_matches_plain_adamw(cell, tmp_path):
    result = train(cell, str(tmp_path))
    assert os.listdir(tmp_path) == []
    check_matches_reference(cell, result)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("nvme2"))
    return run_ranks(_train_cells, 2, GRID_TWO_RANKS, nvme, timeout=180, threads=1)[0], nvme


@pytest.mark.parametrize("cell", GRID_TWO_RANKS, ids=lambda c: c.id)
def test_two_ranks_match_plain_adamw(cell, two_ranks):
    results, nvme = two_ranks
    check_matches_reference(cell, results[cell.id])
    assert os.listdir(nvme) == []
