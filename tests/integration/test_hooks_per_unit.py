"""Forward hooks per unit (Note [hooks per unit] in _zero/_module_state.py): at stage 3 only the
modules whose ancestors do not already hold their units get hooks, and training is bit for bit
what it is with a hook on every module. Hook calls are counted, not timed."""
from __future__ import annotations

import pytest
import torch
from _models import batches, gpt2
from torch import nn

import infinity


def _config(hooks: str, **zero) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                     "fetch_units": {"hooks": hooks}, **zero},
            "precision": {"dtype": "fp32"}, "gradient_clipping": 1.0, "optimizer": {"type": "adamw", "lr": 1e-3}}


def _train(model, hooks: str, steps: int = 3, **zero) -> dict:
    model, opt = infinity.initialize(model, config=_config(hooks, **zero))
    engine = opt.engine
    calls = {"n": 0}
    pre = engine._pre_forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return pre(*args, **kwargs)

    engine._pre_forward = counted  # the bound method the hooks were installed with is the original: count it there
    engine.remove_hooks()
    engine.install_hooks()
    losses = []
    try:
        for ids in batches(steps):
            loss = model(input_ids=ids, labels=ids).loss if hasattr(model, "config") else model(ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.wait_step()
        master = opt.store.master.clone()
        hooked = sorted(s.name for m, s in engine.states.items() if m in engine._hooked)
    finally:
        engine.close()
    return {"losses": losses, "master": master, "hooked": hooked, "pre_forward_calls": calls["n"]}


def test_gpt2_hooks_its_units_owners_only_and_trains_bit_for_bit():
    unit, module = _train(gpt2(layers=3, hidden=32), "unit"), _train(gpt2(layers=3, hidden=32), "module")
    assert unit["losses"] == module["losses"] and torch.equal(unit["master"], module["master"])
    assert unit["hooked"] == ["", "lm_head", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                              "transformer.ln_f", "transformer.wpe", "transformer.wte"]
    assert unit["pre_forward_calls"] * 4 < module["pre_forward_calls"], (unit["pre_forward_calls"],
                                                                         module["pre_forward_calls"])


def test_activation_checkpointing_recomputes_inside_the_blocks_hold():
    def checkpointed():
        model = gpt2(layers=3, hidden=32)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    unit, module = _train(checkpointed(), "unit"), _train(checkpointed(), "module")
    assert unit["losses"] == module["losses"] and torch.equal(unit["master"], module["master"])


class _Shared(nn.Module):
    """One Linear reached under two names, called from both places, outside the block that
    holds its unit the second time."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(96, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.again = self.blocks[0][0]  # the same module under a second name
        self.head = nn.Linear(16, 96)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        x = torch.tanh(self.again(x))  # outside blocks[0]'s forward
        logits = self.head(x)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1))


def test_a_module_reached_under_two_names_keeps_its_hooks_and_trains_exactly():
    unit, module = _train(_Shared(), "unit"), _train(_Shared(), "module")
    assert unit["losses"] == module["losses"] and torch.equal(unit["master"], module["master"])
    assert "blocks.0.0" in unit["hooked"]


def test_hooks_module_is_refused_when_misspelt():
    with pytest.raises(Exception, match="hooks"):
        infinity.Config.from_dict({"zero": {"fetch_units": {"hooks": "layer"}}})
