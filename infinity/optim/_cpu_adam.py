"""``CPUAdam``: a ``torch.optim.Optimizer`` over the native fused step.

Its state uses torch's names (``step`` as a float32 scalar tensor, ``exp_avg``,
``exp_avg_sq``), and ``state_dict`` also writes ``decoupled_weight_decay``, so states load
into ``torch.optim.AdamW``/``Adam`` and back. Every ``step()`` reads each group's
hyperparameters afresh, so schedulers that edit ``param_group["lr"]`` work as with torch.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..errors import UsageError
from . import _functional as F
from . import _native

# torch options whose non-default values change the math, and why we refuse them.
_REFUSED = {
    "amsgrad": "amsgrad is not supported; use torch.optim.AdamW(amsgrad=True)",
    "maximize": "maximize is not supported; negate the loss instead",
    "capturable": "capturable is a CUDA-graph option; CPUAdam steps on the CPU",
    "differentiable": "differentiable optimizer steps are not supported",
}


def _refuse_unsupported(options: dict) -> None:
    for key, why in _REFUSED.items():
        if options.get(key):
            raise UsageError(f"CPUAdam: {key}={options[key]!r}: {why}")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on the CPU with the native AVX512/AVX2/scalar kernel.

    ``adamw=True`` decouples weight decay (``torch.optim.AdamW``); ``adamw=False`` adds it
    to the gradient (``torch.optim.Adam``). Parameters must be fp32 CPU tensors.
    ``num_threads`` (default: this rank's share of the cores, Note [rank placement] in
    _runtime/_topology.py) and ``simd`` are passed to
    ``adam_step``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        num_threads: int | None = None,
        simd: str | None = None,
    ) -> None:
        _refuse_unsupported(dict(amsgrad=amsgrad, maximize=maximize, capturable=capturable, differentiable=differentiable))
        if foreach is not None or fused is not None:
            raise UsageError("CPUAdam: foreach/fused select torch kernels; CPUAdam always runs its own fused kernel")
        F.Hyper.checked(lr, betas, eps, weight_decay, adamw)
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1):
            raise UsageError(f"num_threads must be a positive integer or None, got {num_threads!r}")
        _native.resolve(simd)  # an unknown or unsupported path fails here, not at the first step
        self._num_threads = num_threads
        self._simd = simd
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except (TypeError, ValueError):
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    @staticmethod
    def _check_group(group: dict, index: int) -> None:
        _refuse_unsupported(group)
        F.Hyper.checked(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["adamw"])
        for i, p in enumerate(group["params"]):
            if p.device.type != "cpu" or p.dtype != torch.float32 or p.is_complex() or p.layout != torch.strided:
                raise UsageError(
                    f"CPUAdam: parameter {i} of group {index} is a {p.dtype} {p.layout} tensor on {p.device}; "
                    "CPUAdam updates dense fp32 CPU tensors (keep fp32 master weights on the CPU)"
                )

    def __setstate__(self, state: dict) -> None:
        # Called by load_state_dict: accept torch Adam/AdamW groups (decoupled_weight_decay
        # instead of adamw) and refuse options whose math we do not implement.
        super().__setstate__(state)
        for group in self.param_groups:
            _refuse_unsupported(group)
            if "adamw" not in group:
                group["adamw"] = bool(group.get("decoupled_weight_decay", self.defaults["adamw"]))
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        for group in sd["param_groups"]:
            # So torch.optim.Adam/AdamW read the same decay rule back.
            group["decoupled_weight_decay"] = bool(group["adamw"])
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
        return sd

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss

    def _state_for(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        for key in ("exp_avg", "exp_avg_sq"):
            if not st[key].is_contiguous():  # e.g. loaded from a state with other strides
                st[key] = st[key].contiguous()
        return st

    def _step_group(self, index: int, group: dict) -> None:
        _refuse_unsupported(group)
        hyper = F.Hyper.checked(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["adamw"])
        segments: defaultdict = defaultdict(list)  # by gradient dtype
        written: defaultdict = defaultdict(list)
        keep = []  # contiguous copies that must outlive the native call
        write_back = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise UsageError(f"CPUAdam: group {index} has a sparse gradient; use torch.optim.SparseAdam")
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise UsageError(f"CPUAdam: group {index} holds a {p.dtype} tensor on {p.device}; it needs fp32 CPU")
            grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            F.check_tensor(f"the gradient of a parameter in group {index}", grad, F.GRAD_DTYPES, p.numel())
            data = p if p.is_contiguous() else p.contiguous()
            if data is not p:
                write_back.append((p, data))
            keep.append((grad, data))
            st = self._state_for(p)
            st["step"] += 1
            written[grad.dtype] += [data, st["exp_avg"], st["exp_avg_sq"]]
            seg = F.segment(data, grad, st["exp_avg"], st["exp_avg_sq"], None, hyper, int(st["step"].item()))
            segments[grad.dtype].append(seg)
        for grad_dtype, segs in segments.items():
            F.run_native(segs, hyper, grad_dtype, None, self._num_threads, self._simd, written[grad_dtype])
        for p, data in write_back:
            p.copy_(data)
