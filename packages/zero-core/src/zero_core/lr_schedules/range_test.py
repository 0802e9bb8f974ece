"""The LRRangeTest schedule: a learning rate growing linearly (or in stairs) from ``min_lr``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from zero_core.lr_schedules.base import _Schedule
from zero_core.lr_schedules.validation import _check_float, _check_int, _per_group


class LRRangeTest(_Schedule):
    """Learning-rate range test: ``lr = min_lr * (1 + step_rate * interval)`` where ``interval`` is
    ``(last_batch_iteration + 1) / step_size``, floored when ``lr_range_test_staircase`` is set."""

    _state_keys = ("min_lr", "step_size", "step_rate", "staircase")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(
            "lr_range_test_min_lr", lr_range_test_min_lr, len(self._groups), self._owner, 0
        )
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, self._owner, 1)
        self.step_rate = _check_float("lr_range_test_step_rate", lr_range_test_step_rate, self._owner, 0)
        if not isinstance(lr_range_test_staircase, bool):
            raise TypeError(
                f"LRRangeTest: 'lr_range_test_staircase' must be a bool, got {lr_range_test_staircase!r}"
            )
        self.staircase = lr_range_test_staircase
        self._apply()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1.0 + self.step_rate * interval
        return [lr * increase for lr in self.min_lr]
