"""The warmup schedules: WarmupLR (warm up, then hold), WarmupDecayLR (then linear decay to 0) and
WarmupCosineLR (warm up a ratio of each group's own rate, then half-cosine decay)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from zero_core.lr_schedules.base import _Schedule
from zero_core.lr_schedules.constants import WARMUP_LOG_RATE
from zero_core.lr_schedules.validation import _check_float, _check_int, _check_warmup_type, _per_group

logger = logging.getLogger(__name__)


def _warmup_gamma(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done after ``iteration``: ``log(iteration + 1) / log(num_steps)`` or
    ``iteration / num_steps``; 0 before the first step."""
    if iteration < 0:
        return 0.0
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


class WarmupLR(_Schedule):
    """Warm the learning rate up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    steps (``log`` or ``linear`` shape), then hold it: ``lr = min_lr + (max_lr - min_lr) * gamma`` with
    ``gamma`` from ``_warmup_gamma`` while ``last_batch_iteration < warmup_num_steps``, else 1.

    ``warmup_num_steps`` below 2 is raised to 2 (a log warmup over one step is undefined).
    """

    _state_keys = ("min_lrs", "max_lrs", "warmup_num_steps", "warmup_type")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner, n = self._owner, len(self._groups)
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, n, owner, 0)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, n, owner, 0)
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, owner, 0))
        self.warmup_type = _check_warmup_type(warmup_type, owner)
        self._init_extra()
        self._apply()

    def _init_extra(self) -> None:
        """Hook for subclasses to validate their own arguments before the first rate is applied."""

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``: after the warmup
    ``gamma = max(0, (total_num_steps - last_batch_iteration) / max(1, total_num_steps - warmup_num_steps))``.
    """

    _state_keys = (*WarmupLR._state_keys, "total_num_steps")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, type(self).__name__, 1)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _init_extra(self) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Scale each group's own learning rate (its ``lr`` when the scheduler is created, kept in the group as
    ``initial_lr``) by a ratio that warms up from ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` steps,
    ``ratio = min_ratio + (1 - min_ratio) * gamma``, then follows a half cosine down to ``cos_min_ratio``:
    with ``s = last_batch_iteration - warmup_num_steps + 1`` and ``S = total_num_steps - warmup_num_steps``,
    ``ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * min(s, S) / S)) / 2``. The ratio holds
    at ``cos_min_ratio`` after ``total_num_steps``.
    """

    _state_keys = (
        "org_lrs", "total_num_steps", "warmup_min_ratios", "warmup_num_steps", "cos_min_ratio", "warmup_type",
    )  # fmt: skip

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float | list[float] = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner = self._owner
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, owner, 0))
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, owner, 1)
        if self.total_num_steps <= self.warmup_num_steps:
            raise ValueError(
                f"WarmupCosineLR: 'total_num_steps' ({total_num_steps}) must be greater than "
                f"'warmup_num_steps' ({self.warmup_num_steps}) to leave room for the cosine decay"
            )
        self.warmup_min_ratios = _per_group("warmup_min_ratio", warmup_min_ratio, len(self._groups), owner, 0)
        self.cos_min_ratio = _check_float("cos_min_ratio", cos_min_ratio, owner, 0)
        self.warmup_type = _check_warmup_type(warmup_type, owner)
        # Like torch's schedulers: remember the user's lr once, so that building the scheduler again on the
        # same optimizer (or resuming) scales the original rate, not an already scheduled one.
        self.org_lrs = [float(group.setdefault("initial_lr", group["lr"])) for group in self._groups]
        self._apply()

    def get_lr_ratio(self) -> list[float]:
        """The multiplier of every group's original learning rate at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
            return [lo + (1.0 - lo) * gamma for lo in self.warmup_min_ratios]
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        span = self.total_num_steps - self.warmup_num_steps
        cosine = (1.0 + math.cos(math.pi * min(done, span) / span)) / 2.0
        ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)
        return [ratio] * len(self.org_lrs)

    def get_lr(self) -> list[float]:
        return [lr * ratio for lr, ratio in zip(self.org_lrs, self.get_lr_ratio())]
