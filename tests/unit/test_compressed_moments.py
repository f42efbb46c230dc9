"""Compressed Adam moments on NVMe (Note [compressed moments] in infinity/_offload/_moments.py,
Note [compressed moments on disk] in infinity/_offload/_nvme_optimizer_store.py).

The codes' round-trip errors are bounded element by element (native and torch paths); training
with bf16 / int8 moments stays close to fp32 moments; the bytes moved per step for the moments
and the files' sizes are counted and match the memory plan; checkpoints move between fp32 and
int8 runs both ways; fp32 (the default) stays exact; bad values are refused by name.
"""
import dataclasses
import os

import numpy as np
import pytest
import torch
from _configs import zero_config
from _models import batches, gpt2

import infinity
from infinity._checkpoint._format import rank_file
from infinity._offload._memory_plan import OPT_FILES
from infinity._offload._moments import BLOCK, Codec, _native, file_bytes
from infinity._offload._preflight import plan
from infinity.config import Config, ConfigError

CHUNK = 1 << 16  # int8 records: 64 Ki codes + 128 B of scales, padded to 4 KiB: 3.76x fewer bytes than fp32
PATHS = [True, False] if _native() is not None else [False]


def _moments(n=3 * BLOCK + 100, seed=0):
    """Adam-like moments: magnitudes spread over several decades within a block, some zeros."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g)) * 1e-3
    m[::97] = 0.0
    return m, m.square() * 3


def _round_trip(mode, x, signed, native, seed=0):
    c = Codec(mode, 4 * BLOCK, native=native)
    rec = torch.empty(c.record, dtype=torch.uint8)
    out = torch.empty_like(x)
    c.encode(x, rec, signed, torch.Generator().manual_seed(seed))
    c.decode(rec, out, signed)
    return out


def _block_max(x):
    pad = torch.zeros(-(-x.numel() // BLOCK) * BLOCK)
    pad[: x.numel()] = x.abs()
    return pad.view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[: x.numel()]


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "torch")
def test_bf16_round_trip_within_one_ulp(native):
    m, v = _moments()
    for x, signed in ((m, True), (v, False)):
        out = _round_trip("bf16", x, signed, native)
        assert torch.all((out - x).abs() <= x.abs() * 2.0**-7)  # stochastic rounding: the two neighbours
        assert torch.equal(out, out.bfloat16().float())
        assert torch.equal(out == 0, x == 0)


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "torch")
def test_int8_round_trip_bounds(native):
    """exp_avg: q = 127 sqrt(|x|/M), one code step is (2|q|+1) M / 127^2; exp_avg_sq: the
    error of sqrt(v) is one step of (q/255)^2 sqrt(M). Zeros stay zero, a nonzero v nonzero,
    signs are kept, and the block's largest element comes back."""
    m, v = _moments()
    out = _round_trip("int8", m, True, native)
    big = _block_max(m)
    step = (2 * 127 * (m.abs() / big).sqrt() + 2) * big / 127**2
    assert torch.all((out - m).abs() <= step * 1.0001)
    assert torch.all(out * m >= 0) and torch.equal(out == 0, (m == 0) | (out == 0))
    torch.testing.assert_close(out[m.abs() == big], m[m.abs() == big], rtol=1e-6, atol=0)  # exact but for fp32 rounding
    out = _round_trip("int8", v, False, native)
    big = _block_max(v)
    root = big.sqrt()
    step = (2 * 255 * (v / big).pow(0.25) + 2) * root / 255**2
    assert torch.all((out.sqrt() - v.sqrt()).abs() <= step * 1.0001)
    assert torch.equal(out == 0, v == 0), "a nonzero v must never decode to 0: Adam would divide by eps"


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_stochastic_rounding_is_unbiased(native, mode):
    """Averaged over many encodings a value comes back (v = 0.999 v + 0.001 g^2 moves v by
    less than a rounding step: round-to-nearest would freeze it)."""
    x = torch.full((BLOCK,), 1.0)
    x[1:] = 0.3337  # not representable in either code; x[0] fixes the block's scale
    outs = torch.stack([_round_trip(mode, x, False, native, seed=s) for s in range(400)])
    mean = outs[:, 1:].mean()
    assert outs[:, 1:].std() > 0
    if mode == "bf16":
        assert mean == pytest.approx(0.3337, rel=2e-4)
    else:  # unbiased in code space: v = (q/255)^4, so within the curvature of one code step
        assert mean == pytest.approx(0.3337, rel=5e-3)


# ------------------------------------------------------------------ training


def _cfg(nvme, moments, host_cache=0):
    return zero_config(3, param="nvme", optim="nvme", nvme=nvme, chunk=CHUNK, lr=1e-3,
                       optim_extra={"host_cache": host_cache, "gradients": "nvme", "moments": moments})


def _model():
    return gpt2(seed=0, layers=2, hidden=128, heads=2)  # ~0.4M parameters: several chunks


def _train(model, opt, steps, seed=1, after_first=lambda: None):
    losses = []
    for ids in batches(steps, seed=seed):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if len(losses) == 1:
            opt.wait_step()
            after_first()
    opt.wait_step()
    return losses


def _params(model):
    with infinity.GatheredParameters(list(model.parameters())):
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each mode, 6 steps from the same model and data, with and without the host cache."""
    out = {}
    for mode in ("fp32", "bf16", "int8"):
        for cache in (0, None):
            nvme = str(tmp_path_factory.mktemp(f"{mode}{cache}"))
            model, opt = infinity.initialize(_model(), _cfg(nvme, mode, cache))
            store = opt.store
            before = {k: list(v) for k, v in store.array_io.items()}
            after_one = {}
            losses = _train(model, opt, 6, after_first=lambda: after_one.update(
                {k: list(v) for k, v in store.array_io.items()}))
            sizes = {n: os.path.getsize(str(p)) for n, p in store.paths.items()}
            need = plan(opt.placement, opt.engine.cfg)
            blocks = {b for o, n in opt.layout.opt_ranges for b in range(o // 1024, -(-(o + n) // 1024))}
            out[(mode, cache)] = dict(losses=losses, params=_params(model), sizes=sizes, total=store.total,
                                      in_blocks=1024 * len(blocks),  # elements of the 4 KiB blocks holding states
                                      chunk=store.chunk, nvme=need["categories"]["nvme"][OPT_FILES],
                                      io=(before, after_one), nbytes=store.nbytes())
            opt.engine.close()
    return out


def test_fp32_moments_are_the_default_and_unchanged(runs, tmp_path):
    """fp32 (the default) keeps fp32 files: an explicit ``moments: fp32`` run equals a run
    without the key, bit for bit."""
    assert Config().zero.offload_optimizer.moments == "fp32"
    cfg = _cfg(str(tmp_path), "fp32")
    del cfg["zero"]["offload_optimizer"]["moments"]
    model, opt = infinity.initialize(_model(), cfg)
    losses = _train(model, opt, 6)
    params = _params(model)
    opt.engine.close()
    assert losses == runs[("fp32", 0)]["losses"]
    assert torch.equal(params, runs[("fp32", 0)]["params"])


def _adam_step_bounds(steps, betas=(0.9, 0.999)):
    """The largest |m_hat| / sqrt(v_hat) exact Adam can reach at each step t = 1..steps: by
    Cauchy-Schwarz over the two moving averages' weights w_i (first moment) and u_i (second),
    sqrt(sum_i w_i^2 / u_i). It is 1 at the first step and grows slowly (1.016 at the sixth)."""
    b1, b2 = betas
    out = []
    for t in range(1, steps + 1):
        w = [(1 - b1) * b1 ** (t - i) / (1 - b1**t) for i in range(1, t + 1)]
        u = [(1 - b2) * b2 ** (t - i) / (1 - b2**t) for i in range(1, t + 1)]
        out.append(sum(a * a / b for a, b in zip(w, u)) ** 0.5)
    return out


@pytest.mark.parametrize("mode,tol", [("bf16", 2e-4), ("int8", 2e-3)])
@pytest.mark.parametrize("cache", [0, None], ids=["streamed", "cached"])
def test_training_close_to_fp32_moments(runs, mode, tol, cache):
    """Six steps at lr 1e-3 (weight decay 0.01). A moment error of e (bf16: < 0.4%; int8: a few
    % on the small elements) changes an element's Adam step lr * m / sqrt(v) by about e: the
    mean deviation stays within 6 lr e. The largest one comes from the arithmetic, not from a
    run: exact Adam moves an element by at most lr * B, B the sum of the per-step bounds of
    |m_hat| / sqrt(v_hat) (``_adam_step_bounds``, 6.04 here), plus the decay. bf16 codes keep
    each moment within 2^-8, so the ratio and the bound hardly change. int8 codes are coarse
    near zero: an element far below its block's largest moments decodes to the first code of
    each, M_m / 127^2 and sqrt(M_v) / 255^2 (M the block's largest), and since |m| <= b_t
    sqrt(v) holds for every element, M_m <= b_t sqrt(M_v): such a step is at most (255/127)^2
    b_t lr = 4.03 b_t lr (stochastic rounding makes it rare and unbiased). The losses must agree
    to the relative tolerance given (10-100x the observed deviation on this model, far below
    the 2e-2 a step changes the loss)."""
    ref, got = runs[("fp32", 0)], runs[(mode, cache)]
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol)
    lr, decay = 1e-3, 1e-2
    initial = _params_initial()
    adam = lr * sum(_adam_step_bounds(6)) + 6 * lr * decay * initial.abs().max().item()
    assert (ref["params"] - initial).abs().max() <= adam * 1.0001, "fp32 moments: exact Adam's own bound"
    ours = adam * (1 + (255 / 127) ** 2) if mode == "int8" else adam * (1 + 2.0**-6)
    diff = (got["params"] - ref["params"]).abs()
    assert diff.max() <= adam + ours
    assert (got["params"] - initial).abs().max() <= ours * 1.0001
    assert diff.mean() <= 6 * lr * (0.01 if mode == "bf16" else 0.05)
    moved = (ref["params"] - initial).abs().mean()
    assert diff.mean() < 0.1 * moved, "the deviation must be small against the training itself"


_INITIAL = {}


def _params_initial():
    if "p" not in _INITIAL:
        _INITIAL["p"] = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    return _INITIAL["p"]


@pytest.mark.parametrize("mode,ratio", [("bf16", 2.0), ("int8", 3.76)])
def test_bytes_per_step_and_file_sizes(runs, mode, ratio):
    """One step reads and writes each moment once: fp32 4 bytes per element (written only in
    the 4 KiB blocks that hold a unit's states: the padding after the last is never changed,
    Note [unchanged ranges are not written] in _swap_pipeline.py), compressed one record per chunk (bf16 half; int8
    a quarter plus the scales and the 4 KiB padding). The master weights' and gradients' bytes
    are unchanged; the plan counts the files' real sizes."""
    ref, got = runs[("fp32", 0)], runs[(mode, 0)]
    moved = file_bytes(mode, got["total"], got["chunk"])  # one record per chunk, the last one shorter
    assert ref["in_blocks"] < ref["total"]  # this model's space ends with a block of padding
    for name in ("exp_avg", "exp_avg_sq"):
        step = [[a - b for a, b in zip(run["io"][1][name], run["io"][0][name])] for run in (ref, got)]
        assert step[0] == [4 * ref["total"], 4 * ref["in_blocks"]]
        assert step[1] == [moved] * 2
        assert step[0][0] / step[1][0] == pytest.approx(ratio, rel=1e-3)
        assert got["sizes"][name] == moved
    for name in ("master", "grad"):
        assert got["sizes"][name] == ref["sizes"][name]
        assert [a - b for a, b in zip(got["io"][1][name], got["io"][0][name])] == \
            [a - b for a, b in zip(ref["io"][1][name], ref["io"][0][name])]
    assert got["nvme"] == sum(got["sizes"].values())
    assert ref["nvme"] == sum(ref["sizes"].values())
    assert got["nbytes"]["nvme"] == got["nvme"]


# ------------------------------------------------------------------ checkpoints


def _saved(directory, tag, name):
    return torch.from_numpy(np.fromfile(os.path.join(directory, tag, rank_file(0, name)), dtype=np.float32))


def _run(nvme, mode):
    return infinity.initialize(_model(), _cfg(nvme, mode, host_cache=None))


def test_checkpoint_round_trip_fp32_int8_fp32(tmp_path):
    """fp32 states saved -> loaded by an int8 run -> saved (fp32 files, the moments expanded)
    -> loaded by an fp32 run, which then trains like the fp32 run that never left fp32."""
    ckpt = str(tmp_path / "ckpt")
    model, opt = _run(str(tmp_path / "a"), "fp32")
    _train(model, opt, 3)
    infinity.save_checkpoint(ckpt, model, opt, tag="a")
    ref_losses = _train(model, opt, 3, seed=2)
    opt.engine.close()

    model, opt = _run(str(tmp_path / "b"), "int8")
    infinity.load_checkpoint(ckpt, model, opt, tag="a")
    infinity.save_checkpoint(ckpt, model, opt, tag="b")
    assert not [f for f in os.listdir(opt.store.staging.swap.path) if f.endswith(".fp32.swp")], "staging files left behind"
    int8_losses = _train(model, opt, 3, seed=2)
    opt.engine.close()

    assert torch.equal(_saved(ckpt, "b", "master"), _saved(ckpt, "a", "master"))
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        a, b = _saved(ckpt, "a", name), _saved(ckpt, "b", name)
        big = _block_max(a)
        if signed:
            bound = (2 * 127 * (a.abs() / big.clamp_min(1e-30)).sqrt() + 2) * big / 127**2
            assert torch.all((a - b).abs() <= bound * 1.0001)
        else:
            bound = (2 * 255 * (a / big.clamp_min(1e-30)).pow(0.25) + 2) * big.sqrt() / 255**2
            assert torch.all((a.sqrt() - b.sqrt()).abs() <= bound * 1.0001)
        assert torch.all(b[a == 0] == 0) and (signed or torch.equal(a == 0, b == 0))
        assert not torch.equal(a, b), "int8 must have quantised something"

    model, opt = _run(str(tmp_path / "c"), "fp32")
    infinity.load_checkpoint(ckpt, model, opt, tag="b")
    back_losses = _train(model, opt, 3, seed=2)
    opt.engine.close()
    assert int8_losses == pytest.approx(ref_losses, rel=2e-3)
    assert back_losses == pytest.approx(ref_losses, rel=2e-3)


# ------------------------------------------------------------------ config


def test_bad_values_and_tiers_are_refused():
    with pytest.raises(ConfigError, match=r"zero\.offload_optimizer\.moments"):
        Config.from_dict({"zero": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "moments": "fp8"}}})
    with pytest.raises(ConfigError, match=r"zero\.offload_optimizer\.moments.*applies to nvme"):
        Config.from_dict({"zero": {"offload_optimizer": {"device": "cpu", "moments": "int8"}}})
    Config.from_dict({"zero": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "moments": "int8"}}})



@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_memory_plan_equals_the_bytes_mapped(tmp_path, mode):
    """The record buffers (one per moment in each buffer set and each cached chunk) are in the
    plan, exactly as the ledger counts them where they are mapped (Note [host memory ledger] in _memory.py);
    the run model's bytes per step are the counters'."""
    from infinity._apps import _runmodel as rm
    from infinity.aio._memory import ledger

    before = dict(ledger.snapshot()["live"])
    ledger.reset_peak()
    model, opt = _run(str(tmp_path), mode)
    need = plan(opt.placement, opt.engine.cfg)["categories"]["host"]
    _train(model, opt, 2)
    peaks = ledger.snapshot()["peak"]
    for cat in ("optimizer_buffers", "optimizer_cache"):
        assert peaks.get(cat, 0) - before.get(cat, 0) == need[cat], cat
    store = opt.store
    assert store.head > 0
    states = ("master", "exp_avg", "exp_avg_sq")
    written = sum(store.array_io[n][1] for n in states)
    _train(model, opt, 1)
    moved = sum(store.array_io[n][1] for n in states) - written  # the cache writes through: every chunk
    opt.engine.close()
    assert moved == 4 * store.total + 2 * file_bytes(mode, store.total, store.chunk)
    run = rm.Run(params=store.total, layers=2, hidden=128, heads=2, vocab=96, micro_batch=1, seq_len=12,
                 optimizer_tier="nvme", param_tier="nvme", moments=mode, host_mem=1)  # gradients on NVMe
    fp32 = rm.nvme_bytes(dataclasses.replace(run, moments="fp32"))
    assert fp32["write"] - rm.nvme_bytes(run)["write"] == pytest.approx(
        2 * (4 * store.total - file_bytes(mode, store.total, store.chunk)), rel=0.02)
