"""The five learning-rate schedules of DeepSpeed: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR and
WarmupCosineLR, and ``build_lr_scheduler`` that builds one from the config's ``scheduler`` section.

[Note: scheduler state is a function of last_batch_iteration]
Every schedule here is a closed-form function of ``last_batch_iteration`` (the index of the last batch
trained, ``-1`` before the first ``step()``). ``step(last_batch_iteration=None)`` advances it by one (or sets
it) and writes the resulting learning rate (and, for OneCycle, momentum) into every optimizer param group.
The constructor writes the value for the ``last_batch_iteration`` it is given, so a fresh scheduler puts the
optimizer at the schedule's starting point and a resumed one at the point where training stopped.
``state_dict()`` returns plain JSON-compatible data (ints, floats, lists, strings) holding the iteration and
every hyper-parameter, and ``load_state_dict`` restores them, so ``json.loads(json.dumps(sd))`` round-trips.

The schedulers work with any object that has ``param_groups`` (a ``torch.optim.Optimizer`` or a wrapper
exposing the wrapped optimizer's groups), and every "float or list" argument takes one value for all groups
or a list with one value per group.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
VALID_WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


# --------------------------------------------------------------------------------------------- validation
def _check_int(name: str, value: Any, owner: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: '{name}' must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: '{name}' must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: Any, owner: str, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{owner}: '{name}' must be a finite number, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: '{name}' must be >= {minimum}, got {value}")
    return float(value)


def _per_group(name: str, value: Any, n_groups: int, owner: str, minimum: float | None = None) -> list[float]:
    """Expand a "float or list" argument to one float per param group."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{owner}: '{name}' has {len(value)} values but the optimizer has {n_groups} param groups"
            )
        return [_check_float(f"{name}[{i}]", v, owner, minimum) for i, v in enumerate(value)]
    return [_check_float(name, value, owner, minimum)] * n_groups


def _check_warmup_type(value: Any, owner: str) -> str:
    if value not in VALID_WARMUP_TYPES:
        raise ValueError(f"{owner}: 'warmup_type' must be one of {list(VALID_WARMUP_TYPES)}, got {value!r}")
    return value


def _param_groups(optimizer: Any, owner: str) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise TypeError(
            f"{owner}: 'optimizer' must be a torch optimizer (an object with a non-empty list "
            f"'param_groups' of dicts), got {type(optimizer).__name__}"
        )
    return groups


# --------------------------------------------------------------------------------------------- base class
class _Schedule:
    """Shared step/state logic. See [Note: scheduler state is a function of last_batch_iteration]."""

    # Attribute names saved by state_dict() (besides last_batch_iteration); plain JSON data only.
    _state_keys: tuple[str, ...] = ()

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self._owner = type(self).__name__
        self.optimizer = optimizer
        self._groups = _param_groups(optimizer, self._owner)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, self._owner, -1)
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        """Learning rate of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def _apply(self) -> None:
        for group, lr in zip(self._groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self._groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next batch (or jump to ``last_batch_iteration``) and update the optimizer."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, self._owner, -1)
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer."""
        if not self._last_lr:
            raise RuntimeError(f"{self._owner}: get_last_lr() called before the scheduler set any rate")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        state = {key: _plain(getattr(self, key)) for key in self._state_keys}
        return {"type": self._owner, "last_batch_iteration": self.last_batch_iteration, **state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "last_batch_iteration" not in state_dict:
            raise ValueError(f"{self._owner}.load_state_dict: expected a dict with 'last_batch_iteration'")
        kind = state_dict.get("type", self._owner)
        if kind != self._owner:
            raise ValueError(f"{self._owner}.load_state_dict: the state is of a {kind} scheduler")
        for key in self._state_keys:
            if key in state_dict:
                value = state_dict[key]
                current = getattr(self, key)
                if isinstance(current, list) and len(value) != len(current):
                    raise ValueError(
                        f"{self._owner}.load_state_dict: '{key}' has {len(value)} entries, "
                        f"the optimizer has {len(current)} param groups"
                    )
                setattr(self, key, _restore(value, current))
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", state_dict["last_batch_iteration"], self._owner, -1
        )
        self._apply()


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _restore(value: Any, like: Any) -> Any:
    """Give JSON-decoded lists back the tuple shape of the attribute they replace (momentum pairs)."""
    if isinstance(like, list) and like and isinstance(like[0], tuple):
        return [tuple(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------- LRRangeTest
class LRRangeTest(_Schedule):
    """Learning-rate range test: ``lr = min_lr * (1 + step_rate * interval)`` where ``interval`` is
    ``(last_batch_iteration + 1) / step_size``, floored when ``lr_range_test_staircase`` is set."""

    _state_keys = ("min_lr", "step_size", "step_rate", "staircase")

    def __init__(
        self,
        optimizer: Any,
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


# --------------------------------------------------------------------------------------------- OneCycle
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
        optimizer: Any,
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

    def get_mom(self) -> list[float] | None:
        """Momentum (``betas[0]`` or ``momentum``) of every param group, or None when not cycled."""
        if not self.cycle_momentum:
            return None
        return self._cycled(self.max_moms, self.min_moms, self.decay_mom_rate, lambda hi, d: hi * (1.0 + d))

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        if moms is None:
            return
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


# --------------------------------------------------------------------------------------------- warmups
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
        optimizer: Any,
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
        optimizer: Any,
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
        optimizer: Any,
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


# --------------------------------------------------------------------------------------------- factory
_SCHEDULES: dict[str, type[_Schedule]] = {
    LR_RANGE_TEST: LRRangeTest,
    ONE_CYCLE: OneCycle,
    WARMUP_LR: WarmupLR,
    WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}


def build_lr_scheduler(optimizer: Any, scheduler_config: Any) -> _Schedule:
    """Build the scheduler described by the config's ``scheduler`` section,
    ``{"type": "WarmupLR", "params": {...}}`` (``params`` optional), for ``optimizer``.

    A pydantic model or any object with ``type`` and ``params`` attributes is accepted as well as a dict.
    """
    if not isinstance(scheduler_config, dict):
        if hasattr(scheduler_config, "type"):
            scheduler_config = {
                "type": scheduler_config.type,
                "params": getattr(scheduler_config, "params", None),
            }
        else:
            raise TypeError(
                "build_lr_scheduler: 'scheduler_config' must be a dict like "
                f"{{'type': ..., 'params': {{...}}}}, got {type(scheduler_config).__name__}"
            )
    unknown = set(scheduler_config) - {"type", "params"}
    if unknown:
        raise ValueError(f"scheduler config: unknown keys {sorted(unknown)}; allowed: ['params', 'type']")
    kind = scheduler_config.get("type")
    if kind not in _SCHEDULES:
        raise ValueError(
            f"scheduler config: unknown scheduler type {kind!r}; valid types: {VALID_LR_SCHEDULES}"
        )
    params = scheduler_config.get("params") or {}
    if not isinstance(params, dict):
        raise TypeError(f"scheduler config: 'params' of {kind} must be a dict, got {type(params).__name__}")
    cls = _SCHEDULES[kind]
    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    bad = sorted(set(params) - set(accepted))
    if bad:
        raise ValueError(f"scheduler config: unknown params {bad} for {kind}; valid params: {accepted}")
    missing = [
        name
        for name in accepted
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise ValueError(f"scheduler config: {kind} requires params {missing}")
    return cls(optimizer, **params)
