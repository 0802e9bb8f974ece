"""The OneCycle schedule: one triangular cycle of learning rate and (inverse) momentum, then decay."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from zero_core.lr_schedules.base import _Schedule
from zero_core.lr_schedules.validation import _check_float, _check_int, _per_group

logger = logging.getLogger(__name__)


class OneCycle(_Schedule):
    """1Cycle policy: one triangular cycle of the learning rate between ``cycle_min_lr`` and
    ``cycle_max_lr`` (momentum cycled inversely between ``cycle_max_mom`` and ``cycle_min_mom``), then decay.

    With ``t = last_batch_iteration + 1`` and ``total = first + second`` step sizes, the position in the
    cycle is ``x = t / total`` (``< 1`` during the cycle) and the scale is ``x / r`` on the way up and
    ``(x - 1) / (r - 1)`` on the way down (``r = first / total``); ``lr = min_lr + (max_lr - min_lr) * scale``
    and ``mom = max_mom - (max_mom - min_mom) * scale``. A stair count ``n > 0`` for a half quantises that
    half's scale to ``floor(scale * n) / n`` on the way up and ``ceil(scale * n) / n`` on the way down.
    After the cycle (``last_batch_iteration >= total``), with ``d = last_batch_iteration - total + 1``:
    ``lr = min_lr / (1 + decay_lr_rate * d / decay_step_size)`` and
    ``mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)``; ``decay_step_size = 0`` (or a zero rate)
    keeps them at ``min_lr`` / ``max_mom``.

    Momentum lives in ``betas[0]`` for Adam-like optimizers (``betas[1]`` is kept) and in ``momentum`` for
    SGD-like ones; for an optimizer with neither, momentum cycling is turned off with a warning.
    """

    _state_keys = (
        "min_lrs", "max_lrs", "decay_lr_rate", "first_step_size", "second_step_size", "first_stair_count",
        "second_stair_count", "decay_step_size", "cycle_momentum", "min_moms", "max_moms", "decay_mom_rate",
    )  # fmt: skip

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner, n = self._owner, len(self._groups)
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, n, owner, 0)
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, n, owner, 0)
        self.decay_lr_rate = _check_float("decay_lr_rate", decay_lr_rate, owner, 0)
        self.first_step_size = _check_int("cycle_first_step_size", cycle_first_step_size, owner, 1)
        if cycle_second_step_size is None:
            cycle_second_step_size = cycle_first_step_size
        self.second_step_size = _check_int("cycle_second_step_size", cycle_second_step_size, owner, 1)
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count, owner, 0)
        if cycle_second_stair_count is None:
            cycle_second_stair_count = cycle_first_stair_count
        self.second_stair_count = _check_int("cycle_second_stair_count", cycle_second_stair_count, owner, 0)
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, owner, 0)
        if not isinstance(cycle_momentum, bool):
            raise TypeError(f"OneCycle: 'cycle_momentum' must be a bool, got {cycle_momentum!r}")
        self.min_moms = _per_group("cycle_min_mom", cycle_min_mom, n, owner, 0)
        self.max_moms = _per_group("cycle_max_mom", cycle_max_mom, n, owner, 0)
        self.decay_mom_rate = _check_float("decay_mom_rate", decay_mom_rate, owner, 0)
        self._mom_key = self._momentum_key() if cycle_momentum else None
        self.cycle_momentum = self._mom_key is not None
        self._apply()

    def _momentum_key(self) -> str | None:
        group = self._groups[0]
        if "betas" in group:
            return "betas"
        if "momentum" in group:
            return "momentum"
        logger.warning(
            "OneCycle: cycle_momentum is disabled because %s has neither 'betas' nor 'momentum'",
            type(self.optimizer).__name__,
        )
        return None

    @property
    def _total_size(self) -> int:
        return self.first_step_size + self.second_step_size

    def _scale(self) -> float:
        total = self._total_size
        ratio = self.first_step_size / total
        x = (self.last_batch_iteration + 1) / total
        x -= math.floor(x)  # position inside the (single) cycle
        if x <= ratio:
            scale = x / ratio
            if self.first_stair_count > 0:
                scale = math.floor(scale * self.first_stair_count) / self.first_stair_count
        else:
            scale = (x - 1) / (ratio - 1)
            if self.second_stair_count > 0:
                scale = math.ceil(scale * self.second_stair_count) / self.second_stair_count
        return scale

    def _decay_interval(self) -> float | None:
        if self.decay_step_size == 0:
            return None
        return (self.last_batch_iteration - self._total_size + 1) / self.decay_step_size

    def _cycled(
        self,
        start: list[float],
        end: list[float],
        decay_rate: float,
        decayed: Callable[[float, float], float],
    ) -> list[float]:
        """Per group, ``start + (end - start) * scale`` during the cycle; after it
        ``decayed(start, decay_rate * interval)``, or ``start`` itself when nothing decays."""
        if self.last_batch_iteration < self._total_size:
            scale = self._scale()
            return [a + (b - a) * scale for a, b in zip(start, end)]
        interval = self._decay_interval()
        if interval is None or decay_rate == 0:
            return list(start)
        return [decayed(a, decay_rate * interval) for a in start]

    def get_lr(self) -> list[float]:
        return self._cycled(self.min_lrs, self.max_lrs, self.decay_lr_rate, lambda lo, d: lo / (1.0 + d))

    def _momenta(self) -> list[float]:
        return self._cycled(self.max_moms, self.min_moms, self.decay_mom_rate, lambda hi, d: hi * (1.0 + d))

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Per param group ``(beta1, beta2)`` as DeepSpeed's OneCycle returns it, or None when
        momentum is not cycled. ``beta1`` is the cycled momentum (``betas[0]`` or ``momentum``);
        ``beta2`` is the group's own ``betas[1]`` (kept, where DeepSpeed overwrites it with 0.99),
        or DeepSpeed's placeholder 0.99 for an SGD-like group, which has no second beta."""
        if not self.cycle_momentum:
            return None
        return [
            (mom, float(tuple(g["betas"])[1]) if "betas" in g else 0.99)
            for g, mom in zip(self._groups, self._momenta())
        ]

    def _apply(self) -> None:
        super()._apply()
        if not self.cycle_momentum:
            return
        moms = self._momenta()
        for group, mom in zip(self._groups, moms):
            if self._mom_key == "betas":
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = mom

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("cycle_momentum") and self._mom_key is None:
            raise ValueError(
                "OneCycle.load_state_dict: the state cycles momentum but this optimizer has none"
            )
        super().load_state_dict(state_dict)
