"""Loss scaling for fp16 training.

[Note: loss scaling]
fp16 gradients underflow for small values, so the loss is multiplied by a scale before
backward and the gradients are divided by it before the optimizer sees them. With dynamic
scaling (``fp16.loss_scale == 0``) the scale starts at ``2**initial_scale_power``; an
overflow (inf/nan in any gradient on any rank) skips the step on every rank and, once
``hysteresis`` overflows have been tolerated, halves the scale (never below
``min_loss_scale``); after ``loss_scale_window`` clean steps since the last overflow it
doubles. ``consecutive_hysteresis`` refills the hysteresis budget after every clean step
instead of only when the scale grows. The overflow decision must be global: every rank
reduces its local flag with MAX before deciding, or ranks would diverge.

A *static* fp16 scale (``fp16.loss_scale > 0``) never changes, but an overflowing step is
still skipped (``checks_overflow``): applying it would write inf/NaN into the fp32 master
weights for good. DeepSpeed's fp16 optimizers skip the step whatever the scaler; the engine
counts it in ``skipped_steps`` and warns, naming the static scale.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zero_core.config.precision import FP16Config


@dataclass
class LossScalerState:
    cur_scale: float
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2
    overflows: int = 0


class LossScaler:
    """A static loss scale (1.0 means no scaling, used for fp32 and bf16).

    ``check_overflow``: whether a step with inf/NaN gradients is skipped (fp16, whatever the
    scale; see [Note: loss scaling]).
    """

    dynamic = False

    def __init__(self, scale: float = 1.0, *, check_overflow: bool = False) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.state = LossScalerState(cur_scale=float(scale))
        self.checks_overflow = bool(check_overflow) or self.dynamic

    @property
    def loss_scale(self) -> float:
        return self.state.cur_scale

    @property
    def overflows(self) -> int:
        return self.state.overflows

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.state.cur_scale if self.state.cur_scale != 1.0 else loss

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.state.overflows += 1
        self.state.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = LossScalerState(**state)


class DynamicLossScaler(LossScaler):
    """Dynamic loss scale. See [Note: loss scaling]."""

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
        consecutive_hysteresis: bool = False,
    ) -> None:
        if scale_window < 1:
            raise ValueError(f"fp16.loss_scale_window must be >= 1, got {scale_window}")
        if hysteresis < 1:
            raise ValueError(f"fp16.hysteresis must be >= 1, got {hysteresis}")
        if not min_scale > 0:
            raise ValueError(f"fp16.min_loss_scale must be > 0, got {min_scale}")
        super().__init__(init_scale)
        self.state.cur_hysteresis = hysteresis
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        s = self.state
        if overflow:
            s.overflows += 1
            if self.hysteresis == 1 or s.cur_hysteresis == 1:
                s.cur_scale = max(s.cur_scale / self.scale_factor, self.min_scale)
            else:
                s.cur_hysteresis -= 1
            s.last_overflow_iter = s.cur_iter
        else:
            if self.consecutive_hysteresis:
                s.cur_hysteresis = self.hysteresis
            if (s.cur_iter - s.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    s.cur_hysteresis = self.hysteresis
                s.cur_scale *= self.scale_factor
        s.cur_iter += 1


def warn_static_overflow(scale: float, step: int | None, skipped: int) -> None:
    """Tell the user a step was dropped although the fp16 loss scale is fixed (it will not adapt)."""
    at = f" at step {step}" if step is not None else ""
    warnings.warn(
        f"fp16: gradients overflowed (inf/NaN){at} with the static loss scale {scale:g}; "
        f"the step was skipped ({skipped} skipped so far). A static scale never lowers itself: "
        "set fp16.loss_scale to a smaller value, or to 0 for dynamic loss scaling, if this repeats",
        RuntimeWarning,
        stacklevel=3,
    )


def build_loss_scaler(fp16_enabled: bool, fp16_section: FP16Config | None) -> LossScaler:
    """The scaler the config asks for: dynamic when ``fp16.loss_scale`` is 0, else static."""
    if not fp16_enabled:
        return LossScaler(1.0)
    get = (lambda k, d: getattr(fp16_section, k, d)) if fp16_section is not None else (lambda k, d: d)
    static = float(get("loss_scale", 0) or 0)
    if static > 0:
        return LossScaler(static, check_overflow=True)
    return DynamicLossScaler(
        init_scale=2.0 ** int(get("initial_scale_power", 16)),
        scale_window=int(get("loss_scale_window", 1000)),
        hysteresis=int(get("hysteresis", 2)),
        min_scale=float(get("min_loss_scale", 1) or 1),
        consecutive_hysteresis=bool(get("consecutive_hysteresis", False)),
    )
