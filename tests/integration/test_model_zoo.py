"""Every architecture of the zoo (tests/_zoo.py: decoder LMs, encoders, encoder-decoders, vision,
vision-language, state-space and hybrid, mixtures of experts), built under infinity.Init, is the
model plain PyTorch builds, and trains and generates as it does:

- built from its config under Init with the plain model's seed: every parameter and buffer bit
  for bit the plain model's (Note [touched placeholders] in _init_ops.py);
- ``from_pretrained`` under Init of the plain model's ``save_pretrained``: bit for bit;
- trained (stage 3, fp32, AdamW, a few steps, a different batch each step): every loss and the
  final parameters within 1e-6 of ``torch.optim.AdamW``, with and without activation
  checkpointing where the model supports it;
- greedy ``generate`` under stage 3: the plain model's tokens;
- on two gloo ranks, each with its own half of every batch (so routing and control flow differ
  between the ranks): built and trained, equal to plain AdamW on the whole batches.

The plain reference of an architecture is computed once. The default selection runs every
architecture's initialization, from_pretrained, training and generation on one rank, and a
representative set with checkpointing and on two ranks (the mixtures of experts among them); the
rest of those cells are ``slow``. An architecture this transformers cannot build is skipped with
its reason."""
from __future__ import annotations

import functools

import pytest
import torch
from _zoo import BY_NAME, ZOO, Arch, batch, build, loss, model_class, prompt, shard

import infinity
from infinity.testing import run_ranks

STEPS, LR, WEIGHT_DECAY, TOL = 3, 1e-3, 0.01, 1e-6
# Adam's eps, the same in both: a parameter whose true gradient is 0 (an attention key's bias: the
# softmax ignores it) gets rounding noise of 1e-9 as gradient, which Adam's eps of 1e-8 would turn
# into steps of lr in a direction set by the order of a sum, not by the model; 1e-6 keeps those
# steps below the tolerance and changes nothing measurable for real gradients (1e-3 and more).
EPS = 1e-6
# Even so, the key bias's noise is the order of a sum, which differs with the threads a reduction
# runs on: CLIP's vision k_proj.bias ended 0.97e-6 from plain AdamW in one process and 1.22e-6 in
# another on an AMD EPYC with avx512_bf16, every other parameter within 1.2e-7. Those biases carry
# no signal to compare; they are held to the bound of what noise can move them (a step of lr each).
NOISE_ONLY = ("k_proj.bias",)
NAMES = [a.name for a in ZOO]
CHECKPOINTED = ("llama", "gemma2", "opt", "bert", "t5", "whisper", "mixtral", "llava")  # checkpointing, by default
TWO_RANKS = ("opt", "gemma2", "bert", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")  # two ranks, by default
GENERATES = [a.name for a in ZOO if a.generates]

# The zoo's models warn about what tiny configs lack (kernels not installed, RoPE factors); not under test.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _arch(name: str) -> Arch:
    arch = BY_NAME[name]
    cls, why = model_class(arch)
    if cls is None:
        pytest.skip(why)
    return arch


def _slow_unless(names, pool):
    return [n if n in names else pytest.param(n, marks=pytest.mark.slow) for n in pool]


def _state(model) -> dict:
    """Every parameter and buffer by name (gathered), as plain tensors."""
    params = list(model.parameters())
    with infinity.GatheredParameters(params) if _managed(params) else _nothing():
        out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
        out.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def _managed(params) -> bool:
    from infinity._zero._param import info_of

    return any(info_of(p) is not None for p in params)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [n for n in want if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
              or not torch.equal(got[n], want[n])]
    assert not differ, f"not bit-identical to the plain model: {differ}"


def _config(nvme: str = "") -> dict:
    zero = {"stage": 3, "reduce_bucket_size": 4096, "prefetch": {"persistence_threshold": 0}}
    if nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"zero": zero, "precision": {"dtype": "fp32"}, "gradient_clipping": 0.0,
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY, "eps": EPS}}


# ------------------------------------------------------------------ the plain references


@functools.lru_cache(maxsize=None)
def _plain_state(name: str) -> dict:
    return _state(build(BY_NAME[name]))


@functools.lru_cache(maxsize=None)
def _plain_training(name: str, checkpointing: bool) -> tuple:
    """Plain AdamW on the whole global batches: the losses and the final parameters."""
    arch = BY_NAME[name]
    model = build(arch, checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    losses = []
    for step in range(STEPS):
        out = loss(model, batch(arch, step))
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _plain_tokens(name: str) -> torch.Tensor:
    arch = BY_NAME[name]
    model = build(arch).eval()
    with torch.no_grad():
        return model.generate(prompt(arch), max_new_tokens=4, do_sample=False, use_cache=False)


# ------------------------------------------------------------------ under infinity


def _train(name: str, checkpointing: bool, nvme: str = "") -> tuple:
    """Built under Init (stage 3), initialized, trained on this rank's share of every global batch:
    the global mean loss of each step and the final parameters (gathered)."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    arch = BY_NAME[name]
    cfg = _config(nvme)
    with infinity.Init(config=cfg):
        model = build(arch, checkpointing=checkpointing)
    model, opt = infinity.initialize(model, cfg)
    try:
        losses = []
        for step in range(STEPS):
            out = loss(model, shard(batch(arch, step), rank, world))
            out.backward()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([out.item()], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(t)
            losses.append(t.item() / world)
        with infinity.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        opt.engine.close()
    return losses, params


def _assert_trains_like_plain(name: str, checkpointing: bool, got: tuple) -> None:
    want_losses, want_params = _plain_training(name, checkpointing)
    losses, params = got
    assert losses == pytest.approx(want_losses, abs=TOL, rel=TOL)
    assert params.keys() == want_params.keys()
    far = {n: float((params[n] - want_params[n]).abs().max()) for n in want_params
           if not torch.allclose(params[n], want_params[n], atol=LR * STEPS if n.endswith(NOISE_ONLY) else TOL,
                                 rtol=TOL)}
    assert not far, f"final parameters further than {TOL} from plain AdamW: {far}"


@pytest.mark.parametrize("name", NAMES)
def test_built_from_config_under_init_is_bit_identical(name):
    arch = _arch(name)
    with infinity.Init(offload="cpu"):
        model = build(arch)
    _assert_identical(_state(model), _plain_state(name))


@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_under_init_is_bit_identical(name, tmp_path):
    arch = _arch(name)
    cls, _ = model_class(arch)
    build(arch).save_pretrained(str(tmp_path))
    plain = cls.from_pretrained(str(tmp_path)).train()
    with infinity.Init(offload="cpu"):
        model = cls.from_pretrained(str(tmp_path)).train()
    got, want = _state(model), _state(plain)
    _assert_identical(got, want)
    _assert_identical({k: v for k, v in got.items() if k.startswith("param")},
                      {k: v for k, v in _plain_state(name).items() if k.startswith("param")})


@pytest.mark.parametrize("name", NAMES)
def test_training_matches_plain_adamw(name):
    _arch(name)
    _assert_trains_like_plain(name, False, _train(name, False))


@pytest.mark.parametrize("name", _slow_unless(CHECKPOINTED, [a.name for a in ZOO if a.checkpointing]))
def test_training_with_activation_checkpointing_matches_plain_adamw(name):
    _arch(name)
    _assert_trains_like_plain(name, True, _train(name, True))


@pytest.mark.parametrize("name", GENERATES)
def test_greedy_generation_under_stage_3_gives_the_plain_tokens(name):
    arch = _arch(name)
    cfg = _config()
    with infinity.Init(config=cfg):
        model = build(arch)
    model, opt = infinity.initialize(model.eval(), cfg)
    try:
        with torch.no_grad():
            tokens = model.generate(prompt(arch), max_new_tokens=4, do_sample=False, use_cache=False)
    finally:
        opt.engine.close()
    assert torch.equal(tokens, _plain_tokens(name))


def _two_rank_cell(name: str, nvme: str) -> tuple:
    """On each rank: built under Init from config (bit-identical to plain), then trained."""
    arch = BY_NAME[name]
    with infinity.Init(offload="cpu"):
        model = build(arch)
    state = _state(model)
    return state, _train(name, False, nvme)


@pytest.mark.parametrize("name", _slow_unless(TWO_RANKS, NAMES))
def test_two_ranks_with_their_own_data_build_and_train_like_plain(name, tmp_path):
    if not _arch(name).per_row_loss:
        pytest.skip(f"{name}'s loss couples the rows of a batch (in-batch negatives): two ranks with half a batch "
                    f"each compute another loss than one process on the whole batch")
    results = run_ranks(_two_rank_cell, 2, name, str(tmp_path), timeout=300)
    for state, trained in results:
        _assert_identical(state, _plain_state(name))
        _assert_trains_like_plain(name, False, trained)


def test_the_zoo_covers_every_family():
    """The zoo names at least 30 architectures and each family the tests promise."""
    assert len(ZOO) >= 30
    types = {a.model_type for a in ZOO}
    for needed in ("gemma2", "mistral", "bert", "albert", "t5", "bart", "whisper", "vit", "clip", "llava", "mamba",
                   "jamba", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "opt"):
        assert needed in types, needed
    assert set(TWO_RANKS) <= set(NAMES) and set(CHECKPOINTED) <= set(NAMES)
