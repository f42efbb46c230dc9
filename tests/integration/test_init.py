"""infinity.Init: models built partitioned, Hugging Face initialization intact, bounded memory."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _models import build, train_losses

import infinity
from infinity.errors import InsufficientResourcesError
from infinity.testing import run_ranks


def _gpt2_config(**kw):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_hf_init_takes_effect_and_ties_survive(tmp_path, offload):
    from transformers import AutoModelForCausalLM

    cfg = _gpt2_config()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(0)
    with infinity.Init(offload=offload, nvme_path=str(tmp_path)):
        model = AutoModelForCausalLM.from_config(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    w = model.transformer.h[0].mlp.c_fc.weight
    assert w.shape == (32, 128) and w.numel() == 32 * 128  # full shape queryable while partitioned
    # Before initialize, an operation on a partitioned parameter runs on the full tensor
    # (materialized for that one operation), never on the empty placeholder.
    assert (w + 1).shape == (32, 128)
    with infinity.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.std().item() == pytest.approx(q.std().item(), rel=1e-6, abs=1e-7), name
            assert torch.equal(p, q), name  # same RNG stream: bitwise the model built without Init
    # initializer_range=0.2 really applied (default would be 0.02)
    with infinity.GatheredParameters([w]):
        assert 0.15 < w.std().item() < 0.25


def _init_then_train(nvme, stage):
    cfg = {"zero": {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           "optimizer": {"lr": 2e-3}, "gradient_clipping": 0.0}
    if stage == 3:
        cfg["zero"]["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    torch.manual_seed(0)
    with infinity.Init(config=cfg if stage == 3 else None, offload=None if stage == 3 else "cpu"):
        model = build("custom")
    model, opt = infinity.initialize(model, cfg)
    losses = train_losses(model, opt, "custom", 3)
    opt.engine.close()
    return losses


def _plain(steps=3):
    torch.manual_seed(0)
    model = build("custom")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    return train_losses(model, opt, "custom", steps)


@pytest.mark.parametrize("stage", [2, 3])
def test_init_then_train_on_two_ranks(tmp_path, stage):
    losses = run_ranks(_init_then_train, 2, str(tmp_path), stage)[0]
    assert losses == pytest.approx(_plain(), rel=1e-5)
    assert os.listdir(tmp_path) == []


def _init_on_two_train_on_one(nvme):
    with infinity.Init(offload="cpu"):
        model = build("stack")
    return model


def test_world_size_mismatch_is_refused(tmp_path):
    with infinity.Init(offload="cpu"):
        model = build("stack")
    # Pretend Init ran over two ranks: initialize in a one-rank job must refuse, not mis-shard.
    from infinity._zero._param import info_of

    for p in model.parameters():
        info_of(p).unit.world_size = 2
    with pytest.raises(RuntimeError, match="partitioned by infinity.Init over 2 rank"):
        infinity.initialize(model, {"zero": {"stage": 3}})


def test_init_of_big_model_keeps_rss_low(tmp_path):
    """48 x Linear(4096, 4096) (~0.8B parameters, 3.2 GB in fp32) built under Init on NVMe."""
    script = textwrap.dedent(f"""
        import resource, torch, infinity
        from torch import nn
        torch.set_num_threads(2)
        nn.Linear(64, 64)  # warm up the allocator and the op library
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with infinity.Init(offload="nvme", nvme_path={str(tmp_path)!r}):
            model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(48)])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        n = sum(p.numel() for p in model.parameters())
        print("PARAMS", n, "PEAK_DELTA", peak - base)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    fields = out.stdout.split()
    params, delta = int(fields[fields.index("PARAMS") + 1]), int(fields[fields.index("PEAK_DELTA") + 1])
    assert params == 48 * (4096 * 4096 + 4096)
    assert delta < 1 << 30, f"peak RSS rose by {delta / 2**30:.2f} GiB"


def _modify_under_init():
    rank = torch.distributed.get_rank()
    with infinity.Init(offload="cpu"):
        lin = torch.nn.Linear(5, 3)  # 15 weights: padded and cut into two chunks
    with infinity.GatheredParameters([lin.weight], modifier_rank=0):
        lin.weight.data.copy_(torch.arange(15.0).view(3, 5) * (rank + 1))  # rank 1 writes other values
    with infinity.GatheredParameters([lin.weight]):
        seen = lin.weight.detach().clone()
    model, _ = infinity.initialize(lin, {"zero": {"stage": 3}})
    with infinity.GatheredParameters([model.weight]):
        after = model.weight.detach().clone()
    return seen, after


def test_modifier_rank_edit_under_init_reaches_every_rank():
    """GatheredParameters(modifier_rank=0) on a parameter of infinity.Init, before initialize: rank 0's values are
    written into each rank's chunk of the Init store, and initialize adopts them."""
    expected = torch.arange(15.0).view(3, 5)
    for seen, after in run_ranks(_modify_under_init, 2):
        assert torch.equal(seen, expected) and torch.equal(after, expected)


def test_a_model_whose_states_cannot_fit_is_refused_before_its_parameters_exist():
    """Note [Init preflight] in _init_context.py: a Hugging Face GPT-2 whose parameters would fit in host memory but
    whose optimizer states and gradients (Init(cpu), optimizer on cpu: 16 more bytes per
    parameter) would not is refused at Init, from a copy built on the meta device, before its
    first parameter is allocated: RSS stays flat and nothing was partitioned."""
    import psutil
    from transformers import GPT2Config, GPT2LMHeadModel

    from infinity._runtime._host_memory import available

    d = 2048
    per_layer = 12 * d * d
    avail = available()[0]  # what Init measures its room against (a memory cgroup's limit counts)
    layers = int(1.5 * avail) // (16 * per_layer)  # their states alone take 1.5x what is available
    assert 4 * layers * per_layer < avail * 0.8, "the parameters alone must fit: the refusal is about the states"
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    proc = psutil.Process()
    before = proc.memory_info().rss
    init = infinity.Init(config=cfg)
    with pytest.raises(InsufficientResourcesError, match=r"(?s)GPT2LMHeadModel \(.*B parameters\).*refused "
                       r"before its parameters are allocated.*host memory"):
        with init:
            GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=d, n_head=16, vocab_size=1024, n_positions=128))
    assert init.units == []
    assert proc.memory_info().rss - before < 512 << 20


def _refusals_under_a_memory_limit(headroom):
    """Inside a memory cgroup that leaves ``headroom`` bytes: what Init refuses (a GPT-2 of 57M
    parameters, about 1.2 GB with its states in host memory) and what initialize's preflight
    refuses (16.8M parameters built before the limit, about 270 MB of host states); the
    cgroup's directory and what the machine has available."""
    from _cgroup import memory_limit
    from transformers import GPT2Config, GPT2LMHeadModel

    from infinity._runtime._host_memory import available

    cfg = {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
           "precision": {"dtype": "fp32"}}  # pinned: the byte counts above are fp32's on every CPU
    small = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    machine = available()[0]
    messages = []
    with memory_limit(headroom) as cgroup:
        for attempt in ("Init", "initialize"):
            try:
                if attempt == "Init":
                    with infinity.Init(config=cfg):
                        GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=768, n_head=12, vocab_size=1024, n_positions=128))
                else:
                    infinity.initialize(small, config=cfg)
                messages.append(None)
            except InsufficientResourcesError as e:
                messages.append(str(e))
    return messages, cgroup, machine


def test_a_memory_cgroup_limit_is_the_room_not_the_machines_memory():
    """Note [host memory available] in _host_memory.py: in a container (a memory cgroup), Init and the preflight
    measure the room against the cgroup's limit, which the kernel's OOM killer enforces, and
    name it; the machine's MemAvailable would have let both start and be killed."""
    from _cgroup import skip_unless_memory_limits

    skip_unless_memory_limits()
    (init_msg, preflight_msg), cgroup, machine = run_ranks(_refusals_under_a_memory_limit, 1, 128 << 20, timeout=180)[0]
    assert machine > 4 << 30, "the machine itself must have room for both: the refusals are the cgroup's"
    assert init_msg is not None and "refused before its parameters are allocated" in init_msg, init_msg
    assert f"host memory (bound by the memory cgroup {cgroup})" in init_msg, init_msg
    assert preflight_msg is not None and "does not fit on this machine" in preflight_msg, preflight_msg
    assert f"host memory (bound by the memory cgroup {cgroup})" in preflight_msg, preflight_msg


def test_a_mistyped_nvme_path_is_refused_and_not_created(tmp_path):
    """Note [swap directories] in _swap.py: Init makes a missing nvme_path only inside an
    existing directory, as the engine does; a path whose parent is missing (a typo) is refused
    and nothing of it is made."""
    from infinity.errors import UsageError

    with pytest.raises(UsageError, match="does not exist, and infinity does not create it"):
        with infinity.Init(offload="nvme", nvme_path=str(tmp_path / "typo" / "nvme")):
            torch.nn.Linear(8, 8)
    assert not (tmp_path / "typo").exists()
    with infinity.Init(offload="nvme", nvme_path=str(tmp_path / "nvme")):  # one level is made
        torch.nn.Linear(8, 8)
    assert (tmp_path / "nvme").is_dir()
