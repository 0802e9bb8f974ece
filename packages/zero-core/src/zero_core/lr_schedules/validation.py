"""Argument checks shared by the schedules: ints, finite floats, "float or list" per-group values, the
warmup type and the optimizer's ``param_groups``; each error names the schedule that rejected the value."""

from __future__ import annotations

import math

from zero_core.lr_schedules.constants import VALID_WARMUP_TYPES


def _check_int(name: str, value: object, owner: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: '{name}' must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: '{name}' must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: object, owner: str, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{owner}: '{name}' must be a finite number, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: '{name}' must be >= {minimum}, got {value}")
    return float(value)


def _per_group(
    name: str, value: object, n_groups: int, owner: str, minimum: float | None = None
) -> list[float]:
    """Expand a "float or list" argument to one float per param group."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{owner}: '{name}' has {len(value)} values but the optimizer has {n_groups} param groups"
            )
        return [_check_float(f"{name}[{i}]", v, owner, minimum) for i, v in enumerate(value)]
    return [_check_float(name, value, owner, minimum)] * n_groups


def _check_warmup_type(value: object, owner: str) -> str:
    if value not in VALID_WARMUP_TYPES:
        raise ValueError(f"{owner}: 'warmup_type' must be one of {list(VALID_WARMUP_TYPES)}, got {value!r}")
    return value


def _param_groups(optimizer: object, owner: str) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise TypeError(
            f"{owner}: 'optimizer' must be a torch optimizer (an object with a non-empty list "
            f"'param_groups' of dicts), got {type(optimizer).__name__}"
        )
    return groups
