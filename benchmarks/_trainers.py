"""One training step per contender, all training the same way.

Every trainer takes the model whole on the CPU (``_models.gpt2``) and trains it with AdamW
(lr 1e-4, weight decay 0.01, betas 0.9/0.999, eps 1e-8) and gradient clipping at norm 1.0. In
``bf16`` the forward and backward compute in bf16 and the optimizer updates fp32 master
weights; in ``fp32`` everything is fp32. A trainer has ``step(ids) -> loss`` (the loss tensor,
detached: reading it is the caller's synchronize), made of ``forward_backward(ids) -> loss`` and
``update()`` (clipping, the optimizer step, gradients cleared), which a benchmark may time apart;
``finish()`` (wait for work the step left running, such as infinity's overlapped update) and
``close()``.

- ``PlainTrainer``: the whole model on the device. bf16: bf16 parameters with fp32 master
  copies, torch's fused AdamW on the masters, the clipping on the masters' gradients; fp32:
  AdamW on the parameters (fused where torch has it for the device).
- ``InfinityTrainer``: ``infinity.initialize`` with ``infinity_config`` (ZeRO-3, parameters
  and optimizer states on one tier; the one config builder of the benchmarks, each adding the
  keys it measures).
- ``DeepSpeedTrainer``: ``deepspeed.initialize`` with ``deepspeed_config`` (ZeRO-3, offload to
  cpu or NVMe, DeepSpeed's CPU AdamW). The model is handed over whole and DeepSpeed partitions
  it: under ``deepspeed.zero.Init`` without transformers' DeepSpeed integration, transformers
  skips its weight initialization, and a different init would make the losses incomparable.
- ``Fsdp2Trainer``: torch's ``fully_shard`` on every block and the root, ``CPUOffloadPolicy``
  (the fp32 shards and the optimizer on the host, torch's AdamW stepping there),
  ``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient reduction).

DeepSpeed and FSDP2 need a process group: each makes one of its process alone (``one_rank_env``).
"""
from __future__ import annotations

import abc
import os
import socket
import time
from typing import Optional

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0


def set_clip(clip: float) -> None:
    """Every trainer of this process clips at ``clip`` (0: none) instead of CLIP (a benchmark's --clip)."""
    global CLIP
    CLIP = float(clip)


def _clip(params) -> None:
    import torch

    if CLIP > 0:
        torch.nn.utils.clip_grad_norm_(params, CLIP)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


class Trainer(abc.ABC):
    @abc.abstractmethod
    def forward_backward(self, ids):
        """One micro-batch's forward and backward; its loss."""

    @abc.abstractmethod
    def update(self) -> None:
        """The optimizer step and the gradients dropped."""

    def step(self, ids):
        loss = self.forward_backward(ids)
        self.update()
        return loss

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def timed_parts(trainer: Trainer, ids) -> tuple:
    """One step, as (forward and backward seconds, update seconds), by the host's clock."""
    start = time.perf_counter()
    trainer.forward_backward(ids)
    mid = time.perf_counter()
    trainer.update()
    return mid - start, time.perf_counter() - mid


class PlainTrainer(Trainer):
    def __init__(self, model, device, dtype: str):
        import torch

        self.model = model.to(device)
        self.params = list(self.model.parameters())
        self.masters = self.params
        if dtype == "bf16":
            self.masters = [p.detach().clone() for p in self.params]  # from the fp32 weights
            self.model.to(torch.bfloat16)
        fused = device.type in ("cuda", "cpu")  # torch's fused AdamW kernels
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)

    def forward_backward(self, ids):
        loss = _loss(self.model, ids)
        loss.backward()
        return loss.detach()

    def update(self) -> None:
        import torch

        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
                p.grad = None
        _clip(self.masters)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)


def merged(base: dict, more: dict) -> dict:
    """``base`` with ``more`` written over it, dicts merged key by key."""
    out = dict(base)
    for key, value in more.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def infinity_config(tier: str, dtype: str, nvme_path: Optional[str] = None, *, optimizer_tier: Optional[str] = None,
                    clip: Optional[float] = -1.0, optimizer: Optional[dict] = None, **more) -> dict:
    """ZeRO-3, parameters on ``tier`` and optimizer states on ``optimizer_tier`` (cpu, nvme or
    none; by default ``tier``), the common AdamW (``optimizer`` instead where a benchmark's
    figures need its own) and clipping (``clip`` None: the config's default; negative: CLIP); ``more`` is merged
    over the result (``zero={"prefetch": {...}}``, ``device_memory_limit=...``)."""
    def offload(device: str) -> dict:
        return {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}

    common = {"type": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999], "eps": 1e-8}
    cfg = {"zero": {"stage": 3, "offload_param": offload(tier), "offload_optimizer": offload(optimizer_tier or tier)},
           "precision": {"dtype": dtype}, "optimizer": optimizer or common}
    if clip is not None:
        cfg["gradient_clipping"] = CLIP if clip < 0 else clip
    return merged(cfg, more)


class InfinityTrainer(Trainer):
    def __init__(self, model, config: dict):
        import infinity

        self.model, self.opt = infinity.initialize(model, infinity.Config.from_dict(config))

    def forward_backward(self, ids):
        loss = _loss(self.model, ids)
        loss.backward()
        return loss.detach()

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def finish(self) -> None:
        self.opt.wait_step()

    def telemetry(self) -> dict:
        """The engine's counters since the last call."""
        import infinity

        return infinity.telemetry(self.model, reset=True)

    def close(self) -> None:
        import infinity

        infinity.close(self.model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_env() -> None:
    """The environment of a process group of this process alone (rank 0 of 1)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")


def deepspeed_config(tier: str, dtype: str, micro_batch: int, nvme_path: Optional[str], pin: bool) -> dict:
    """ZeRO-3 with parameters and optimizer states offloaded to ``tier``; DeepSpeed's defaults
    otherwise (on NVMe its parameter offload keeps up to ``max_in_cpu`` = 1e9 elements in host
    memory, as a user who names NVMe gets)."""
    offload = {"device": tier, "pin_memory": pin, **({"nvme_path": nvme_path} if tier == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999],
                                                      "eps": 1e-8}},
            "gradient_clipping": CLIP, "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": False},
            "zero_optimization": {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload)},
            "steps_per_print": 2**31, "wall_clock_breakdown": False}


class DeepSpeedTrainer(Trainer):
    def __init__(self, model, config: dict, backend: str):
        import deepspeed

        one_rank_env()
        deepspeed.init_distributed(dist_backend=backend)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.model = self.engine

    def forward_backward(self, ids):
        loss = _loss(self.engine, ids)
        self.engine.backward(loss)
        return loss.detach()

    def update(self) -> None:
        self.engine.step()  # clipping and the optimizer step, gradients cleared

    def close(self) -> None:
        self.engine.destroy()


class Fsdp2Trainer(Trainer):
    def __init__(self, model, dtype: str):
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        torch.cuda.set_device(0)
        one_rank_env()
        dist.init_process_group("cpu:gloo,cuda:nccl")  # the clipping's norm is reduced over host tensors
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" \
            else MixedPrecisionPolicy()
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        self.model = fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def forward_backward(self, ids):
        loss = _loss(self.model, ids)
        loss.backward()
        return loss.detach()

    def update(self) -> None:

        _clip(self.model.parameters())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
