"""``build_lr_scheduler``: the config's ``scheduler`` section (type + params) to a schedule instance."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from zero_core.lr_schedules.base import _Schedule
from zero_core.lr_schedules.constants import (
    LR_RANGE_TEST,
    ONE_CYCLE,
    VALID_LR_SCHEDULES,
    WARMUP_COSINE_LR,
    WARMUP_DECAY_LR,
    WARMUP_LR,
)
from zero_core.lr_schedules.one_cycle import OneCycle
from zero_core.lr_schedules.range_test import LRRangeTest
from zero_core.lr_schedules.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

_SCHEDULES: dict[str, type[_Schedule]] = {
    LR_RANGE_TEST: LRRangeTest,
    ONE_CYCLE: OneCycle,
    WARMUP_LR: WarmupLR,
    WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}


def build_lr_scheduler(optimizer: torch.optim.Optimizer, scheduler_config: object) -> _Schedule:
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
