"""``adam_step``: one fused Adam/AdamW pass over flat fp32 master weights and moments.

Note: the formula is torch's (``torch.optim.Adam``/``AdamW``, foreach=False), in fp32:

    adamw:  p = p * (1 - lr*wd)            adam (L2): g = g + wd*p
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Bias corrections are computed in double here, as torch does on the Python side, then
passed as fp32. Low-precision gradients are widened exactly; ``params_out`` receives the
updated fp32 weights rounded to nearest even, bit for bit what ``p.to(bf16|fp16)`` gives.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

from .._runtime._topology import default_threads
from ..errors import UsageError, UsageTypeError
from . import _native

_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_CODES = {torch.bfloat16: 1, torch.float16: 2}
GRAD_DTYPES = tuple(_GRAD_CODES)


@dataclass(frozen=True)
class Hyper:
    """Validated hyperparameters of one step (one optimizer group)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool

    @classmethod
    def checked(cls, lr, betas, eps, weight_decay, adamw) -> "Hyper":
        lr, eps, weight_decay = _scalar("lr", lr), _scalar("eps", eps), _scalar("weight_decay", weight_decay)
        try:
            beta1, beta2 = (_scalar("betas", b) for b in betas)
        except (TypeError, ValueError):
            raise UsageError(f"betas must be a pair of floats in [0, 1), got {betas!r}") from None
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not (math.isfinite(value) and value >= 0.0):
                raise UsageError(f"{name} must be a finite number >= 0, got {value}")
        for name, value in (("betas[0]", beta1), ("betas[1]", beta2)):
            if not 0.0 <= value < 1.0:
                raise UsageError(f"{name} must be in [0, 1), got {value}")
        if not isinstance(adamw, bool):
            raise UsageTypeError(f"adamw must be True (AdamW) or False (Adam with L2 decay), got {adamw!r}")
        return cls(lr, beta1, beta2, eps, weight_decay, adamw)

    def native_args(self) -> dict:
        l2 = not self.adamw and self.weight_decay != 0.0
        return dict(
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            decay_factor=1.0 if l2 else 1.0 - self.lr * self.weight_decay,
            l2=self.weight_decay if l2 else 0.0,
            decay_mode=1 if l2 else 0,
        )

    def step_scalars(self, step: int) -> tuple[float, float]:
        """(lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t)) for step t >= 1."""
        return self.lr / (1.0 - self.beta1**step), 1.0 / math.sqrt(1.0 - self.beta2**step)


def _scalar(name, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(f"{name} must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageTypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_step(step) -> int:
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 1:
        raise UsageError(f"step must be an integer >= 1 (the count including this step), got {step!r}")
    return value


def check_tensor(name: str, t, dtypes, numel: int | None = None) -> None:
    """A clear exception unless ``t`` is a contiguous CPU tensor of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise UsageTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise UsageError(f"{name} is on {t.device}; CPU Adam needs CPU tensors (move it with .cpu())")
    if t.layout != torch.strided:
        raise UsageError(f"{name} has layout {t.layout}; CPU Adam needs dense (strided) tensors")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise UsageTypeError(f"{name} has dtype {t.dtype}; expected {names}")
    if not t.is_contiguous():
        raise UsageError(f"{name} is not contiguous (strides {t.stride()}); pass {name}.contiguous()")
    if numel is not None and t.numel() != numel:
        raise UsageError(f"{name} has {t.numel()} elements but params has {numel}; sizes must match")


def check_no_overlap(named: dict) -> None:
    """Refuses tensors whose memory overlaps: the step writes some of them in place."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in named.items() if t.numel()]
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise UsageError(f"{name_a} and {name_b} share memory; each needs its own buffer")


def segment(params, grads, exp_avg, exp_avg_sq, params_out, hyper: Hyper, step: int, sources=None) -> tuple:
    """The native call's description of one tensor (see native/cpu_adam/bindings.cpp);
    ``sources``: the (params, exp_avg, exp_avg_sq) it reads, when not the ones it writes."""
    step_size, inv_bc2_sqrt = hyper.step_scalars(step)
    out_ptr = params_out.data_ptr() if params_out is not None else 0
    ins = tuple(t.data_ptr() for t in sources) if sources is not None else (0, 0, 0)
    return (
        params.data_ptr(), grads.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        out_ptr, params.numel(), step_size, inv_bc2_sqrt, *ins,
    )


def run_native(segments, hyper: Hyper, grad_dtype, out_dtype, num_threads, simd, written,
               grad_scale: float = 1.0) -> None:
    """One native call over ``segments``; the caller keeps their tensors alive. Each gradient
    is multiplied by ``grad_scale`` as it is read (in fp32, as ``grads.mul_(grad_scale)``
    would, without the pass over them).

    ``written`` are the tensors the call updates: their autograd version counters are
    bumped as an in-place torch op would, so a stale use in a graph is still caught.
    """
    if not segments:
        return
    isa, hw_bf16, _ = _native.resolve(simd)
    threads = default_threads() if num_threads is None else num_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UsageError(f"num_threads must be a positive integer or None, got {num_threads!r}")
    grad_scale = _scalar("grad_scale", grad_scale)
    if not math.isfinite(grad_scale):
        raise UsageError(f"grad_scale must be a finite number, got {grad_scale}")
    _native.lib().step(
        segments,
        grad_dtype=_GRAD_CODES[grad_dtype],
        out_dtype=-1 if out_dtype is None else _OUT_CODES[out_dtype],
        isa=isa,
        hw_bf16=hw_bf16,
        threads=threads,
        grad_scale=grad_scale,
        **hyper.native_args(),
    )
    torch.autograd.graph.increment_version(written)


def adam_step(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    params_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    simd: str | None = None,
    grad_scale: float = 1.0,
    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One fused Adam (``adamw=False``, L2 decay) or AdamW step, in place, or out of place
    with ``sources``.

    ``params``, ``exp_avg`` and ``exp_avg_sq`` are contiguous fp32 CPU tensors (views with a
    storage offset are fine); ``grads`` is fp32, bf16 or fp16 with as many elements;
    ``step`` counts steps including this one (1 on the first). ``params_out``, when given,
    is a bf16 or fp16 tensor that receives the updated parameters in the same pass.
    ``num_threads`` defaults to this rank's share (``torch.get_num_threads()`` once an engine placed
    the rank, else capped at its share of the CPUs: Note [rank placement] in _runtime/_topology.py); ``simd`` pins a path
    ("scalar", "avx2", "avx512"), otherwise ``INFINITY_CPU_ADAM_SIMD`` or the best one.
    ``grad_scale`` multiplies each gradient as it is read (unscaling and clipping by the global
    norm, folded into the pass: the result is that of ``grads.mul_(grad_scale)`` first).
    ``sources``: fp32 (params, exp_avg, exp_avg_sq) holding the states before the step, which
    it reads instead of ``params``, ``exp_avg``, ``exp_avg_sq``, leaving them as they are and
    writing the updated states into those three (the same bits as the step in place).
    """
    hyper = Hyper.checked(lr, betas, eps, weight_decay, adamw)
    step = check_step(step)
    check_tensor("params", params, (torch.float32,))
    n = params.numel()
    check_tensor("grads", grads, GRAD_DTYPES, n)
    check_tensor("exp_avg", exp_avg, (torch.float32,), n)
    check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    named = {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if params_out is not None:
        check_tensor("params_out", params_out, tuple(_OUT_CODES), n)
        named["params_out"] = params_out
    if sources is not None:
        for what, t in zip(("params", "exp_avg", "exp_avg_sq"), sources):
            check_tensor(f"sources' {what}", t, (torch.float32,), n)
            named[f"sources' {what}"] = t
    check_no_overlap(named)
    if n == 0:
        return
    seg = segment(params, grads, exp_avg, exp_avg_sq, params_out, hyper, step, sources)
    out_dtype = None if params_out is None else params_out.dtype
    written = [params, exp_avg, exp_avg_sq] + ([] if params_out is None else [params_out])
    run_native([seg], hyper, grads.dtype, out_dtype, num_threads, simd, written, grad_scale)


def torch_adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay, adamw, grad_scale=1.0):
    """torch.optim.Adam/AdamW's single-tensor math, elementwise identical, on the gradient
    times ``grad_scale`` (scaled in place: the step consumes its gradients)."""
    beta1, beta2 = betas
    if grad_scale != 1.0:
        grad.mul_(grad_scale)
    if adamw:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
