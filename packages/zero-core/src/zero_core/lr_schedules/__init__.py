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

Modules: ``constants.py`` (schedule and warmup-type names), ``validation.py`` (argument checks),
``base.py`` (``_Schedule``: step and state), ``range_test.py`` (LRRangeTest), ``one_cycle.py`` (OneCycle),
``warmup.py`` (WarmupLR, WarmupDecayLR, WarmupCosineLR) and ``build.py`` (``build_lr_scheduler``).
"""

from zero_core.lr_schedules.build import build_lr_scheduler
from zero_core.lr_schedules.constants import (
    LR_RANGE_TEST,
    LR_SCHEDULE,
    ONE_CYCLE,
    VALID_LR_SCHEDULES,
    VALID_WARMUP_TYPES,
    WARMUP_COSINE_LR,
    WARMUP_DECAY_LR,
    WARMUP_LINEAR_RATE,
    WARMUP_LOG_RATE,
    WARMUP_LR,
)
from zero_core.lr_schedules.one_cycle import OneCycle
from zero_core.lr_schedules.range_test import LRRangeTest
from zero_core.lr_schedules.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "LR_RANGE_TEST",
    "LR_SCHEDULE",
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "VALID_WARMUP_TYPES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_lr_scheduler",
]
