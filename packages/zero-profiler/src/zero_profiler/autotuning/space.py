"""The autotuner's search space and the experiment configs built from the user's config.

What is tuned is what the user left open: a key absent or ``"auto"`` is the autotuner's to fill,
a number is kept, and a list is the user's own tuning space (as in DeepSpeed's autotuner):

* ``zero_optimization.stage``: absent, ``"auto"`` or ``"all"`` -> stages 0-3; a list -> those;
* ``train_micro_batch_size_per_gpu``: absent or ``"auto"`` -> searched between the
  ``autotuning`` section's min and max (see :func:`micro_batch_candidates`); a number -> fixed;
* the stage's knobs (only with ``autotuning.fast: false``, as DeepSpeed's fast mode tunes stages
  and micro-batch sizes only): ``reduce_bucket_size`` (all stages), ``allgather_bucket_size``
  (stages 1-2), ``stage3_prefetch_bucket_size`` (stage 3), ``overlap_comm``. Absent or
  ``"auto"`` -> the default space of :data:`DEFAULT_KNOB_SPACE` (bucket sizes as fractions of
  the model, so a small model's buckets are not all "the whole model"); a list -> that list.

``train_batch_size`` / ``gradient_accumulation_steps`` given as numbers are kept (micro-batch
sizes that do not divide them are left out); ``"auto"`` ones are derived.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero_core.config.builtin_sections import AutotuningConfig

#: the knobs each stage tunes (with ``fast: false``)
STAGE_KNOBS: dict[int, tuple[str, ...]] = {
    0: ("reduce_bucket_size", "overlap_comm"),
    1: ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"),
    2: ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"),
    3: ("reduce_bucket_size", "stage3_prefetch_bucket_size", "overlap_comm"),
}

#: default values of each knob: bucket sizes as fractions of the parameter count (1/8 of the model
#: per bucket, or one bucket holding it all), overlap on and off
DEFAULT_KNOB_SPACE: dict[str, tuple[Any, ...]] = {
    "reduce_bucket_size": (1 / 8, 1.0),
    "allgather_bucket_size": (1 / 8, 1.0),
    "stage3_prefetch_bucket_size": (1 / 8, 1.0),
    "overlap_comm": (True, False),
}

_OPEN = (None, "auto", "all")


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a stage, a micro-batch size and the stage's knob values."""

    stage: int
    mbs: int
    knobs: tuple[tuple[str, Any], ...] = ()
    offload: bool = False

    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)


@dataclass
class SearchSpace:
    """The space derived from the user's config and the ``autotuning`` section."""

    stages: list[int]
    mbs_fixed: int | None
    knob_values: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    gas: int | None = None
    train_batch_size: int | None = None

    def knob_combos(self, stage: int) -> list[tuple[tuple[str, Any], ...]]:
        values = self.knob_values.get(stage, {})
        keys = sorted(values)
        return [
            tuple(zip(keys, combo, strict=True)) for combo in itertools.product(*(values[k] for k in keys))
        ]


def _is_open(value: object) -> bool:
    return value in _OPEN


def _stages(zero_opt: dict[str, Any]) -> list[int]:
    stage = zero_opt.get("stage")
    if _is_open(stage):
        return [0, 1, 2, 3]
    values = stage if isinstance(stage, list) else [stage]
    if not values or any(isinstance(v, bool) or v not in (0, 1, 2, 3) for v in values):
        raise ValueError(
            f'zero_optimization.stage: {stage!r} is not a stage to tune (0-3, a list of them, "auto" or "all")'
        )
    return sorted(set(values))


def build_space(user: dict[str, Any], section: AutotuningConfig, num_params: int) -> SearchSpace:
    """The search space of ``user`` (the raw config dict) under the ``autotuning`` ``section``."""
    zero_opt = user.get("zero_optimization") or {}
    if not isinstance(zero_opt, dict):
        raise ValueError(f"zero_optimization: expected an object, got {zero_opt!r}")
    mbs = user.get("train_micro_batch_size_per_gpu")
    if not _is_open(mbs) and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
        raise ValueError(f'train_micro_batch_size_per_gpu: {mbs!r} is not an integer >= 1 or "auto"')
    space = SearchSpace(stages=_stages(zero_opt), mbs_fixed=None if _is_open(mbs) else int(mbs))
    for name in ("gradient_accumulation_steps", "train_batch_size"):
        value = user.get(name)
        if not _is_open(value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f'{name}: {value!r} is not an integer >= 1 or "auto"')
            setattr(space, "gas" if name.startswith("gradient") else "train_batch_size", int(value))
    for stage in space.stages:
        values: dict[str, list[Any]] = {}
        for knob in STAGE_KNOBS[stage]:
            given = zero_opt.get(knob)
            if isinstance(given, list):
                values[knob] = list(given)
            elif _is_open(given) and not section.fast:
                values[knob] = [
                    max(1, int(f * num_params)) if isinstance(f, float) else f
                    for f in DEFAULT_KNOB_SPACE[knob]
                ]
        space.knob_values[stage] = values
    return space


def micro_batch_candidates(low: int, high: int, count: int) -> list[int]:
    """``count`` micro-batch sizes from ``low`` to ``high``, geometrically spaced (1, 2, 4, 8 ...
    for a range of powers of two), always holding ``high``; fewer when the range is small."""
    if high < low:
        return []
    if count <= 1 or high == low:
        return [high]
    ratio = (high / low) ** (1.0 / (count - 1))
    values = {int(round(low * ratio**i)) for i in range(count)}
    return sorted({min(high, max(low, v)) for v in values} | {high})


def batch_fits(space: SearchSpace, mbs: int, world: int, section: AutotuningConfig) -> bool:
    """Whether micro-batch ``mbs`` gives a train batch within the section's bounds and the user's
    fixed ``train_batch_size``."""
    gas = space.gas or 1
    if space.train_batch_size is not None:
        if space.train_batch_size % (mbs * world):
            return False
        gas = space.train_batch_size // (mbs * world)
    total = mbs * gas * world
    if section.max_train_batch_size is not None and total > section.max_train_batch_size:
        return False
    return total >= section.min_train_batch_size


def experiment_config(
    user: dict[str, Any], space: SearchSpace, cand: Candidate, world: int
) -> dict[str, Any]:
    """The config the candidate runs: the user's, with the candidate filled in, without the
    ``autotuning`` section (an experiment adds its own, see ``experiment.py``; the best config
    is written without one, so running it trains normally)."""
    cfg = copy.deepcopy(user)
    zero_opt = dict(cfg.get("zero_optimization") or {})
    for key in list(zero_opt):
        if _is_open(zero_opt[key]) or isinstance(zero_opt[key], list):
            del zero_opt[key]  # open keys not tuned take the engine's defaults
    zero_opt["stage"] = cand.stage
    zero_opt.update(cand.knob_dict())
    if cand.offload and "offload_optimizer" not in zero_opt:
        zero_opt["offload_optimizer"] = {"device": "cpu"}
    cfg["zero_optimization"] = zero_opt
    cfg["train_micro_batch_size_per_gpu"] = cand.mbs
    if space.train_batch_size is not None:
        cfg["train_batch_size"] = space.train_batch_size
        cfg["gradient_accumulation_steps"] = space.train_batch_size // (cand.mbs * world)
    else:
        gas = space.gas or 1
        cfg["gradient_accumulation_steps"] = gas
        cfg["train_batch_size"] = cand.mbs * gas * world
    cfg.pop("autotuning", None)
    return cfg


def experiment_name(cand: Candidate, config: dict[str, Any]) -> str:
    """``z{stage}_mbs{mbs}`` plus a digest of the whole config: equal configs, equal names."""
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"z{cand.stage}_mbs{cand.mbs}{'_offload' if cand.offload else ''}_{digest}"


def knob_feature(value: object) -> float:
    """A knob value as a number for the cost model: 0/1 for a flag, log2 of a size."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return math.log2(max(float(value), 1.0))


def features(cand: Candidate) -> list[float]:
    """Numeric features of a candidate: log2 of the micro-batch, then every knob (in name order)
    as :func:`knob_feature` gives it."""
    return [math.log2(cand.mbs), *(knob_feature(v) for _k, v in sorted(cand.knobs))]
