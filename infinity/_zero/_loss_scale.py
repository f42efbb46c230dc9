"""Loss scaling for fp16: dynamic (like torch's GradScaler) or static."""
from __future__ import annotations

from .._runtime._log import logger
from ._phase import tensors_in


class LossScaler:
    """Grows the scale by 2 after ``window`` clean steps; halves it after ``hysteresis``
    consecutive overflows (each overflowing step is skipped); never below ``min_scale``.
    A positive ``static_scale`` fixes the scale (overflowing steps are still skipped)."""

    def __init__(self, *, static_scale: float = 0.0, initial_scale_power: int = 16, window: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0):
        self.dynamic = static_scale <= 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._clean_steps = 0
        self._overflows_left = hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self._clean_steps = 0
            if not self.dynamic:
                logger.warning("fp16 overflow with static loss scale %g: step skipped", self.scale)
                return
            if self.scale <= self.min_scale:
                # Nothing left to back off: the gradients overflow whatever the scale.
                logger.warning("fp16 gradient overflow with the loss scale at its minimum %g: step skipped; look for "
                               "inf/nan in the loss or the inputs, or lower precision.min_loss_scale", self.scale)
                return
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self._overflows_left = self.hysteresis
            logger.info("fp16 gradient overflow: step skipped, loss scale now %g", self.scale)
            return
        self._overflows_left = self.hysteresis
        self._clean_steps += 1
        if self.dynamic and self._clean_steps >= self.window:
            self.scale *= 2
            self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = sd["scale"]
        self._clean_steps = sd["clean_steps"]
        self._overflows_left = sd["overflows_left"]
        self.skipped_steps = sd["skipped_steps"]


def scale_outputs(scaler: LossScaler, output) -> None:
    """fp16: scale the gradient entering the graph at the model's outputs."""
    outs = [t for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
    scale = scaler.scale
    for t in _terminal(outs):
        t.register_hook(lambda g, s=scale: g * s)


def _terminal(outs):
    """Outputs that no other output depends on: scaling only these scales each path once."""
    if len(outs) <= 1:
        return outs
    nodes = {t.grad_fn: t for t in outs}
    reachable = set()
    for t in outs:
        seen, todo = set(), [t.grad_fn]
        while todo:
            fn = todo.pop()
            for nxt, _ in getattr(fn, "next_functions", ()):
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reachable |= seen & nodes.keys()
    return [t for t in outs if t.grad_fn not in reachable]
