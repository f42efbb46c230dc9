"""``infinity.initialize``: wrap a model and build its partitioned optimizer."""
from __future__ import annotations

from typing import Tuple

from torch import nn

from . import _comm as comm
from ._activation_offload import ActivationOffloader
from ._engine import Engine, engine_of, forget_engine
from ._log import logger
from ._optimizer import ZeroOptimizer
from ._param_groups import resolve_groups
from .errors import EngineError, UsageTypeError
from .tiling import check_working_memory, retarget_groups, tile_model


def initialize(model: nn.Module, config=None, param_groups=None) -> Tuple[nn.Module, ZeroOptimizer]:
    """Return ``(model, optimizer)``: the same module with hooks installed and a partitioned
    optimizer, so ``loss.backward()``, ``optimizer.step()`` and ``optimizer.zero_grad()``
    work unchanged. ``config`` is a Config, a dict, a path (YAML/JSON/DeepSpeed JSON) or None.
    ``param_groups``: torch-style groups (``[{"params": [...], "weight_decay": 0.0}, ...]``)
    over the model's parameters, every trainable parameter in exactly one; keys a group
    leaves out (lr, betas, eps, weight_decay) come from the config's ``optimizer``. None:
    one group of every trainable parameter."""
    from .config import Config

    if not isinstance(model, nn.Module):
        raise UsageTypeError(f"infinity.initialize expects an nn.Module, got {type(model).__name__}")
    if engine_of(model) is not None:
        raise EngineError("this model was already passed to infinity.initialize; call it once per model")
    cfg = Config.coerce(config)
    comm.ensure_initialized()
    tiling = cfg.zero.tiling
    replaced = tile_model(model, tiling.enabled, tiling.min_params, tiling.max_tile_params)
    groups = resolve_groups(list(model.named_parameters()), retarget_groups(param_groups, replaced))
    engine = Engine(model, cfg)
    try:
        check_working_memory(engine, cfg)  # Note [operator working memory] in tiling.py
        optimizer = ZeroOptimizer(engine, cfg, groups)  # takes fp32 master weights before the cast
    except BaseException:
        forget_engine(model)  # refused (bad groups, does not fit): the model may be passed again
        raise
    engine.optimizer = optimizer
    engine.cast_and_partition()
    engine.install_hooks()
    if cfg.activation_checkpointing.offload == "cpu":  # Note [which tensors are offloaded] in _activation_offload.py
        engine.activation_offload = ActivationOffloader()
        engine._handles.extend(engine.activation_offload.install(model))
    logger.info("ZeRO stage %d on %d rank(s): %d fetch units, %.1fM parameters, %s",
                cfg.zero.stage, engine.world_size, len(engine.units),
                sum(u.shard_numel for u in engine.units) * engine.world_size / 1e6, cfg.precision.dtype)
    return model, optimizer
