"""fp16 loss scaling, gradient accumulation and gradient clipping against plain PyTorch.

- Loss scaler: with hysteresis 1 its scale follows torch.amp.GradScaler step for step;
  hysteresis, the floor and a static scale behave as documented.
- fp16 training (stages 1-3): a high initial scale overflows, those steps are skipped and the
  scale backs off, then training proceeds; the scale doubles after ``loss_scale_window`` clean
  steps. The reference is plain PyTorch doing the same data-parallel computation serially: fp16
  model, each rank's micro-batch backward with the same scale, fp32 sum, an overflow check of
  its own, fp32 master weights, clip_grad_norm_ and AdamW; ``last_grad_norm`` is the unscaled
  norm. Before the first non-skipped step the losses agree exactly (nothing was updated); from
  it on within one fp16 ulp (FP16_TOL).
- Gradient accumulation: k backward calls then one step equals plain PyTorch on the
  concatenated batch (mean loss), fp32 within 1e-5, with clipping on.
- Clipping by the global norm across ranks equals torch.nn.utils.clip_grad_norm_ on the
  reference, and ``optimizer.last_grad_norm`` its total norm before clipping, within 1e-5.
- Uneven sizes: parameters with fewer elements than ranks (1 and 2 elements on 3 ranks) train
  like plain PyTorch in every stage.
World sizes 2 and 3, one spawn each; the custom model has sizes 3 does not divide.
"""
import copy
import logging
import math
import random

import pytest
import torch
import torch.distributed as dist
from _configs import zero_config
from _logs import kept_logs
from _models import batches, build, loss_of
from torch import nn

import infinity
from infinity._zero._loss_scale import LossScaler
from infinity.testing import run_ranks

LR = 2e-3
STAGES = [1, 2, 3]
KIND = "custom"
FP16_TOL = 2.0**-10  # one fp16 ulp at magnitude 1
FP16_STEPS = 16
DYNAMIC = {"dtype": "fp16", "initial_scale_power": 18, "loss_scale_window": 4, "hysteresis": 2}
STATIC = {"dtype": "fp16", "loss_scale": 1024.0}
STATIC_STEPS = 6
ACCUM = 3
STEPS = 4
CLIP = 9.9  # between this model's gradient norms: some steps are clipped, some not


def _config(stage, precision, clip=0.0, accumulation=1):
    return zero_config(stage, bucket=2000, precision=precision, adam="adamw", lr=LR, weight_decay=0.01, clip=clip,
                       accumulation=accumulation)


# ---------------------------------------------------------------- the loss scaler alone


def test_dynamic_scale_follows_torch_grad_scaler():
    rng = random.Random(0)
    overflows = [rng.random() < 0.3 for _ in range(60)] + [False] * 7
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = LossScaler(initial_scale_power=10, window=3, hysteresis=1)
    scales = set()
    for overflow in overflows:
        theirs.scale(p.sum())
        p.grad = torch.full((1,), math.inf if overflow else 1.0)
        theirs.step(opt)
        theirs.update()
        ours.update(overflow)
        assert ours.scale == theirs.get_scale()
        scales.add(ours.scale)
    assert ours.skipped_steps == sum(overflows)
    assert min(scales) < 2**10 < max(scales)  # it both backed off and grew


def test_hysteresis_delays_the_backoff():
    s = LossScaler(initial_scale_power=8, window=100, hysteresis=3)
    for _ in range(2):
        s.update(True)
    assert s.scale == 256
    s.update(False)  # a clean step forgives the earlier overflows
    for _ in range(2):
        s.update(True)
    assert s.scale == 256
    s.update(True)
    assert s.scale == 128 and s.skipped_steps == 5


def test_dynamic_scale_never_drops_below_min_scale_and_says_so():
    s = LossScaler(initial_scale_power=3, window=100, hysteresis=1, min_scale=2.0)
    with kept_logs(logging.INFO) as records:
        for _ in range(5):
            s.update(True)
    assert s.scale == 2.0 and s.skipped_steps == 5
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("at its minimum 2" in w for w in warnings), warnings


def test_scaler_state_round_trips():
    s = LossScaler(initial_scale_power=12, window=3, hysteresis=2)
    for overflow in (True, True, False, False):
        s.update(overflow)
    t = LossScaler(initial_scale_power=0, window=3, hysteresis=2)  # same settings, fresh state
    t.load_state_dict(s.state_dict())
    for overflow in (False, True, True, False, False, False):
        s.update(overflow)
        t.update(overflow)
        assert (t.scale, t.skipped_steps) == (s.scale, s.skipped_steps)


def test_static_scale_stays_fixed_and_still_skips():
    s = LossScaler(static_scale=512.0, window=1)
    for overflow in (False, True, False, False):
        s.update(overflow)
        assert s.scale == 512.0
    assert s.skipped_steps == 1


# ---------------------------------------------------------------- on ranks


def _mean_over_ranks(x):
    t = torch.tensor([x])
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _params(model):
    with infinity.GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _fp16_run(stage, precision, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = infinity.initialize(build(KIND), _config(stage, precision, clip=CLIP))
    record = []
    for ids in batches(steps):
        scale = opt.scaler.scale
        loss = loss_of(model, KIND, ids.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        record.append((scale, opt.skipped, _mean_over_ranks(loss.item()), None if opt.skipped else opt.last_grad_norm))
    return record, _params(model), opt.scaler.skipped_steps


def _accumulation_run(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = infinity.initialize(build(KIND), _config(stage, {"dtype": "fp32"}, clip=CLIP, accumulation=ACCUM))
    norms = []
    for ids in batches(STEPS, global_batch=world * ACCUM * 2):
        for micro in ids.chunk(world)[rank].chunk(ACCUM):
            loss_of(model, KIND, micro).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return norms, _params(model)


def _clipping_run(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = infinity.initialize(build(KIND), _config(stage, {"dtype": "fp32"}, clip=CLIP))
    norms = []
    for ids in batches(STEPS):
        loss_of(model, KIND, ids.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return norms, _params(model)


class _Tiny(nn.Module):
    """Parameters of 1 and 2 elements: most ranks hold only padding of them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1))
        self.b = nn.Parameter(torch.randn(2))
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        return (self.lin(x * self.b) * self.a).pow(2).mean()


def _tiny_batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(6, 2, generator=g) for _ in range(STEPS)]


def _tiny_run(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, opt = infinity.initialize(_Tiny(), _config(stage, {"dtype": "fp32"}, clip=CLIP))
    for x in _tiny_batches():
        model(x.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _on_ranks():
    out = {}
    for stage in STAGES:
        out[("tiny", stage)] = _tiny_run(stage)
        out[("dynamic", stage)] = _fp16_run(stage, DYNAMIC, FP16_STEPS)
        out[("accumulation", stage)] = _accumulation_run(stage)
        out[("clipping", stage)] = _clipping_run(stage)
    out[("static", 3)] = _fp16_run(3, STATIC, STATIC_STEPS)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def ranks(request):
    world = request.param
    return world, run_ranks(_on_ranks, world, timeout=300)


# ---------------------------------------------------------------- references


def _reference_fp16(world, scales):
    """Plain PyTorch, the data-parallel fp16 step done serially with the given scales."""
    model = build(KIND)
    master = copy.deepcopy(model)
    model.half()
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.01)
    record = []
    for ids, scale in zip(batches(len(scales)), scales):
        grads = [torch.zeros_like(m) for m in master.parameters()]
        losses = []
        for chunk in ids.chunk(world):
            loss = loss_of(model, KIND, chunk)
            loss.backward(torch.full_like(loss, scale))
            for g, p in zip(grads, model.parameters()):
                g.add_(p.grad.float())
            model.zero_grad()
            losses.append(loss.item())
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        norm = None
        if not overflow:
            for m, g in zip(master.parameters(), grads):
                m.grad = g / (world * scale)
            norm = torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP).item()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, m in zip(model.parameters(), master.parameters()):
                    p.copy_(m)
        record.append((overflow, sum(losses) / world, norm))
    return record, {n: p.detach().float() for n, p in model.named_parameters()}


def _reference_fp32(global_batch, clip):
    model = build(KIND)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    norms = []
    for ids in batches(STEPS, global_batch=global_batch):
        loss_of(model, KIND, ids).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return norms, {n: p.detach() for n, p in model.named_parameters()}


def _assert_params_close(ours, ref, rtol, atol, what):
    assert ours.keys() == ref.keys()
    for name, p in ours.items():
        torch.testing.assert_close(p, ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


# ---------------------------------------------------------------- fp16


def _check_scale_rule(record, window, hysteresis):
    """The scale between consecutive steps changes exactly as documented in LossScaler."""
    overflows_in_a_row = clean_in_a_row = 0
    for (scale, skipped, *_), (next_scale, *_) in zip(record, record[1:]):
        if skipped:
            clean_in_a_row = 0
            overflows_in_a_row += 1
            halves = overflows_in_a_row == hysteresis
            overflows_in_a_row %= hysteresis
            assert next_scale == (scale / 2 if halves else scale)
        else:
            overflows_in_a_row = 0
            clean_in_a_row += 1
            doubles = clean_in_a_row == window
            clean_in_a_row %= window
            assert next_scale == (scale * 2 if doubles else scale)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_dynamic_loss_scaling_matches_plain_pytorch(ranks, stage):
    world, results = ranks
    record, params, skipped_steps = results[0][("dynamic", stage)]
    for other in results[1:]:
        assert [r[:2] for r in other[("dynamic", stage)][0]] == [r[:2] for r in record]
    scales = [r[0] for r in record]
    skipped = [r[1] for r in record]
    assert scales[0] == 2.0**18 and skipped[:2] == [True, True]  # too high: overflow, skip
    assert min(scales) < scales[0] and not all(skipped)  # backed off, then trained
    assert skipped_steps == sum(skipped)
    _check_scale_rule(record, DYNAMIC["loss_scale_window"], DYNAMIC["hysteresis"])
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), "the scale never grew after a clean window"

    ref_record, ref_params = _reference_fp16(world, scales)
    assert [r[0] for r in ref_record] == skipped, "our overflow decisions differ from the reference's"
    first_step = skipped.index(False)
    for i, ((_, _, loss, norm), (_, ref_loss, ref_norm)) in enumerate(zip(record, ref_record)):
        assert (norm is None) == (ref_norm is None) and (norm is None or norm == pytest.approx(ref_norm, rel=1e-5))
        if i <= first_step:
            assert loss == ref_loss, f"step {i}: parameters changed before the first non-skipped step"
        else:
            assert loss == pytest.approx(ref_loss, rel=FP16_TOL), f"step {i}"
    _assert_params_close(params, ref_params, FP16_TOL, FP16_TOL, f"world {world} stage {stage}")
    losses = [r[2] for r in record]
    assert losses[-2] < losses[first_step]  # it learns (batches repeat with period 2)


def test_fp16_static_loss_scale(ranks):
    world, results = ranks
    record, params, skipped_steps = results[0][("static", 3)]
    assert [r[0] for r in record] == [STATIC["loss_scale"]] * STATIC_STEPS
    assert skipped_steps == 0 and not any(r[1] for r in record)
    ref_record, ref_params = _reference_fp16(world, [r[0] for r in record])
    assert not any(r[0] for r in ref_record)
    assert [r[2] for r in record] == pytest.approx([r[1] for r in ref_record], rel=FP16_TOL)
    assert [r[3] for r in record] == pytest.approx([r[2] for r in ref_record], rel=1e-5)  # clipping norms
    _assert_params_close(params, ref_params, FP16_TOL, FP16_TOL, f"world {world} static")


# ---------------------------------------------------------------- accumulation and clipping


@pytest.fixture(scope="module")
def references():
    return {("clipping", None): _reference_fp32(6, CLIP),
            **{("accumulation", w): _reference_fp32(w * ACCUM * 2, CLIP) for w in (2, 3)}}


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_accumulation_matches_one_big_batch(ranks, references, stage):
    world, results = ranks
    ref_norms, ref_params = references[("accumulation", world)]
    for rank, r in enumerate(results):
        norms, params = r[("accumulation", stage)]
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}"
        _assert_params_close(params, ref_params, 1e-5, 1e-5, f"world {world} rank {rank} stage {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_clipping_by_global_norm_matches_clip_grad_norm(ranks, references, stage):
    world, results = ranks
    ref_norms, ref_params = references[("clipping", None)]
    assert min(ref_norms) < CLIP < max(ref_norms), "the data should exercise clipped and unclipped steps"
    for rank, r in enumerate(results):
        norms, params = r[("clipping", stage)]
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}: last_grad_norm"
        _assert_params_close(params, ref_params, 1e-5, 1e-5, f"world {world} rank {rank} stage {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_smaller_than_the_world_size(ranks, stage):
    world, results = ranks
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for x in _tiny_batches():
        model(x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    for rank, r in enumerate(results):
        _assert_params_close(r[("tiny", stage)], ref, 1e-6, 1e-6, f"world {world} rank {rank} stage {stage}")
