"""``python -m infinity.check_model MODEL``: does this model build and train under ``infinity.Init``
exactly as without it?

MODEL is a Hugging Face model directory (its ``config.json`` is read; no weights are loaded), a
``config.json`` path, or ``module:Callable`` for a custom model (a class or function that takes no
arguments and returns the ``nn.Module``). The model is built twice from the same seed, plainly and
under ``infinity.Init``, and every parameter and buffer compared bit for bit; then one AdamW step
(fp32, stage 3 against ``torch.optim.AdamW``) on a random batch of token ids, where the model's
forward takes ``input_ids``. Each difference is named, with how it differs. ``--tiny`` shrinks a
Hugging Face config first (2 layers, hidden 32, vocabulary 128), so a 70B config checks in seconds.
Exit status 0: identical; 1: a difference or an error under Init; 2: bad arguments.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from typing import Callable, Dict, List

import torch
from torch import nn

import infinity

_TINY = {"num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 1, "decoder_layers": 1,
         "hidden_size": 32, "n_embd": 32, "d_model": 32, "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64,
         "num_attention_heads": 2, "n_head": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128,
         "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4}


def _builder(target: str, tiny: bool) -> Callable[[], nn.Module]:
    if ":" in target and not os.path.exists(target):
        module, _, name = target.partition(":")
        sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module), name)
    path = os.path.join(target, "config.json") if os.path.isdir(target) else target
    with open(path) as f:
        raw = json.load(f)
    if tiny:
        raw.update({k: v for k, v in _TINY.items() if k in raw})
        if "num_key_value_heads" in raw:
            raw["num_key_value_heads"] = 1
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**raw)
    for key, value in list(vars(cfg).items()):  # a forward is then a function of weights and batch
        if isinstance(value, float) and "drop" in key:
            setattr(cfg, key, 0.0)
    cfg.use_cache = False
    auto = AutoModelForCausalLM if type(cfg) in AutoModelForCausalLM._model_mapping else AutoModel
    return lambda: auto.from_config(cfg)


def _build(make, seed: int, init: bool) -> nn.Module:
    torch.manual_seed(seed)
    if not init:
        return make()
    with infinity.Init(offload="cpu"):
        return make()


def _state(model: nn.Module) -> Dict[str, torch.Tensor]:
    with infinity.GatheredParameters(list(model.parameters())) if _managed(model) else _Nothing():
        out = {f"parameter {n}": p.detach().clone() for n, p in model.named_parameters()}
        out.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def _managed(model) -> bool:
    from ._zero._param import info_of

    return any(info_of(p) is not None for p in model.parameters())


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def why(plain: torch.Tensor, other: torch.Tensor) -> str:
    """How one tensor differs from the plain model's."""
    if plain.shape != other.shape or plain.dtype != other.dtype:
        return f"shape/dtype {tuple(other.shape)} {other.dtype}, plain {tuple(plain.shape)} {plain.dtype}"
    differ = (plain != other) & ~(plain.isnan() & other.isnan()) if plain.is_floating_point() else plain != other
    n = int(differ.sum())
    if other.is_floating_point() and not other.any() and plain.any():
        return "all zero under Init"
    rows = f", rows {differ.reshape(differ.shape[0], -1).any(1).nonzero().flatten()[:8].tolist()}" if plain.dim() else ""
    diff = float((plain.double() - other.double()).abs().max())
    return f"{n} of {plain.numel()} elements differ (max {diff:.3g}){rows}"


def compare(plain: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor], tol: float = 0.0) -> List[str]:
    """One line per tensor that differs (beyond ``tol``; 0: bit for bit)."""
    lines = [f"{n}: missing under Init" for n in plain if n not in other]
    lines += [f"{n}: only under Init" for n in other if n not in plain]
    for n in plain.keys() & other.keys():
        a, b = plain[n], other[n]
        same = a.shape == b.shape and a.dtype == b.dtype and (
            torch.equal(a, b) if tol == 0 or not a.is_floating_point() else torch.allclose(a, b, rtol=tol, atol=tol))
        if not same:
            lines.append(f"{n}: {why(a, b)}")
    return sorted(lines)


def _batch(model: nn.Module, seed: int):
    forward = inspect.signature(model.forward).parameters
    if "input_ids" not in forward:
        return None
    vocab = getattr(getattr(model, "config", None), "vocab_size", 64)
    ids = torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, **({"labels": ids} if "labels" in forward else {})}


def _loss(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None:
        first = out if isinstance(out, torch.Tensor) else out[0]
        loss = first.float().pow(2).mean()
    return loss


def _step(make, seed: int, inputs: dict, lr: float) -> List[str]:
    """One AdamW step both ways: the differences in loss and parameters (beyond 1e-6)."""
    plain = _build(make, seed, False).train()
    opt = torch.optim.AdamW(plain.parameters(), lr=lr, eps=1e-6)
    want = _loss(plain(**inputs))
    want.backward()
    opt.step()
    cfg = {"zero": {"stage": 3}, "precision": {"dtype": "fp32"}, "gradient_clipping": 0.0,
           "optimizer": {"type": "adamw", "lr": lr, "eps": 1e-6, "weight_decay": 0.01}}
    with infinity.Init(config=cfg):
        torch.manual_seed(seed)
        model = make()
    model, zopt = infinity.initialize(model.train(), cfg)
    try:
        got = _loss(model(**inputs))
        got.backward()
        zopt.step()
        lines = [] if abs(got.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item())) else [
            f"loss of the step: {got.item():.8g} under infinity, plain {want.item():.8g}"]
        after = {f"parameter {n}": p.detach().clone() for n, p in plain.named_parameters()}
        return lines + compare(after, _state(model), tol=1e-6)
    finally:
        zopt.engine.close()


def check(make: Callable[[], nn.Module], seed: int = 0, step: bool = True, lr: float = 1e-3, out=print) -> bool:
    """Build ``make()`` both ways and compare (then one step); print what differs; True if nothing does."""
    plain = _state(_build(make, seed, False))
    try:
        under = _state(_build(make, seed, True))
    except Exception as err:  # what Init refuses, it refuses by name: report it as the difference
        out(f"building under infinity.Init raised {type(err).__name__}: {err}")
        return False
    lines = compare(plain, under)
    out(f"initialization: {len(plain)} tensors, " + (f"{len(lines)} differ:" if lines else "all bit-identical"))
    for line in lines:
        out(f"  {line}")
    if step and not lines:
        inputs = _batch(_build(make, seed, False), seed + 1)
        if inputs is None:
            out("step: skipped (the model's forward takes no input_ids)")
        else:
            step_lines = _step(make, seed, inputs, lr)
            out("one AdamW step: " + (f"{len(step_lines)} differ beyond 1e-6:" if step_lines else "equal within 1e-6"))
            for line in step_lines:
                out(f"  {line}")
            lines += step_lines
    return not lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infinity.check_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory, a config.json, or module:Callable")
    parser.add_argument("--tiny", action="store_true", help="shrink a Hugging Face config first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-step", action="store_true", help="compare the initialization only")
    args = parser.parse_args(argv)
    try:
        make = _builder(args.model, args.tiny)
    except (OSError, ValueError, ImportError, AttributeError, KeyError) as err:
        print(f"cannot build {args.model!r}: {err}", file=sys.stderr)
        return 2
    return 0 if check(make, args.seed, step=not args.no_step) else 1


if __name__ == "__main__":
    sys.exit(main())
