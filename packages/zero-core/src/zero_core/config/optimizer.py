"""``optimizer`` and ``scheduler`` sections: a ``type`` and its ``params``.

Optimizer types are DeepSpeed's own names (matched case-insensitively, as DeepSpeed does) or the
name of a ``torch.optim`` class. Optimizer params are passed to the optimizer's constructor, so
only the hyper-parameters common to them all are type-checked here. Scheduler params are checked
against the documented signature of each of the five DeepSpeed schedulers: an unknown param is an
error with a suggestion, and a param without default must be given.

``"auto"`` (HuggingFace Trainer) in optimizer params is dropped, so the optimizer's default applies;
in scheduler params it resolves to the documented default, and is an error for a param that has
no default (nothing here can derive it: the HF Trainer fills those in before passing the config).
A warning names the "auto" params that fell back to defaults, since outside the Trainer nothing
fills them in and the defaults (lr 1e-3, 1000 warmup steps) are rarely what the config meant.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from zero_core.config.base import AUTO_VALUE, ConfigModel, show
from zero_core.config.errors import join_path, suggest

#: DeepSpeed optimizer names (lower case) -> canonical spelling.
DEEPSPEED_OPTIMIZERS = {
    name.lower(): name
    for name in (
        "Adam",
        "AdamW",
        "Adagrad",
        "Lamb",
        "Lion",
        "SGD",
        "OneBitAdam",
        "ZeroOneAdam",
        "OneBitLamb",
        "MuAdam",
        "MuAdamW",
        "MuSGD",
        "FusedAdam",
        "CPUAdam",
        "DeepSpeedCPUAdam",
    )
}

_REQUIRED = object()  # marks a scheduler param without default


def _warn_auto(section: str, keys: list[str], what: str) -> None:
    """Say which ``"auto"`` params fall back to defaults: outside the HF Trainer nothing fills them in."""
    if keys:
        warnings.warn(
            f'{section}.params: {", ".join(keys)} {"is" if len(keys) == 1 else "are"} "auto" (a value the '
            f"HuggingFace Trainer fills in from its own arguments); used as given here, {what} apply",
            UserWarning,
            stacklevel=4,
        )


#: scheduler type -> param -> (python type(s), default or _REQUIRED). From the documented signatures.
SCHEDULER_PARAMS: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    "LRRangeTest": {
        "lr_range_test_min_lr": ((float, list), 0.001),
        "lr_range_test_step_size": ((int,), 2000),
        "lr_range_test_step_rate": ((float,), 1.0),
        "lr_range_test_staircase": ((bool,), False),
        "last_batch_iteration": ((int,), -1),
    },
    "OneCycle": {
        "cycle_min_lr": ((float, list), _REQUIRED),
        "cycle_max_lr": ((float, list), _REQUIRED),
        "decay_lr_rate": ((float,), 0.0),
        "cycle_first_step_size": ((int,), 2000),
        "cycle_second_step_size": ((int, type(None)), None),
        "cycle_first_stair_count": ((int,), 0),
        "cycle_second_stair_count": ((int, type(None)), None),
        "decay_step_size": ((int,), 0),
        "cycle_momentum": ((bool,), True),
        "cycle_min_mom": ((float, list), 0.8),
        "cycle_max_mom": ((float, list), 0.9),
        "decay_mom_rate": ((float,), 0.0),
        "last_batch_iteration": ((int,), -1),
    },
    "WarmupLR": {
        "warmup_min_lr": ((float, list), 0.0),
        "warmup_max_lr": ((float, list), 0.001),
        "warmup_num_steps": ((int,), 1000),
        "warmup_type": ((str,), "log"),
        "last_batch_iteration": ((int,), -1),
    },
    "WarmupDecayLR": {
        "total_num_steps": ((int,), _REQUIRED),
        "warmup_min_lr": ((float, list), 0.0),
        "warmup_max_lr": ((float, list), 0.001),
        "warmup_num_steps": ((int,), 1000),
        "warmup_type": ((str,), "log"),
        "last_batch_iteration": ((int,), -1),
    },
    "WarmupCosineLR": {
        "total_num_steps": ((int,), _REQUIRED),
        "warmup_min_ratio": ((float, list), 0.0),
        "warmup_num_steps": ((int,), 1000),
        "cos_min_ratio": ((float,), 0.0001),
        "warmup_type": ((str,), "log"),
        "last_batch_iteration": ((int,), -1),
    },
}
_WARMUP_TYPES = ("log", "linear")
_KIND_NAMES = {
    float: "a number",
    int: "an integer",
    bool: "a boolean",
    list: "a list",
    str: "a string",
    type(None): "null",
}


def _matches(value: object, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    if kind is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, kind)


def _torch_optimizer_names() -> dict[str, str]:
    import torch.optim

    return {
        name.lower(): name
        for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type)
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    }


class OptimizerConfig(ConfigModel):
    """``optimizer``: ``{"type": "AdamW", "params": {"lr": ..., ...}}``."""

    config_path: ClassVar[str] = "optimizer"

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value.lower() in DEEPSPEED_OPTIMIZERS:
            return DEEPSPEED_OPTIMIZERS[value.lower()]
        torch_names = _torch_optimizer_names()
        if value.lower() in torch_names:
            return torch_names[value.lower()]
        known = sorted({*DEEPSPEED_OPTIMIZERS.values(), *torch_names.values()})
        hint = suggest(value, known).replace("unknown key", "unknown optimizer")
        raise ValueError(f"{show(value)}: {hint} (DeepSpeed optimizers and torch.optim classes are accepted)")

    @field_validator("params")
    @classmethod
    def _check_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        _warn_auto("optimizer", [k for k, v in params.items() if v == AUTO_VALUE], "the optimizer's defaults")
        params = {k: v for k, v in params.items() if v != AUTO_VALUE}
        problems = []

        def number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for key in ("lr", "weight_decay"):
            if key in params and not (number(params[key]) and params[key] >= 0):
                problems.append(f"optimizer.params.{key}: {show(params[key])} must be a number >= 0")
        if "eps" in params and not (number(params["eps"]) and params["eps"] >= 0):
            problems.append(f"optimizer.params.eps: {show(params['eps'])} must be a number >= 0")
        if "betas" in params:
            betas = params["betas"]
            if not (
                isinstance(betas, (list, tuple))
                and len(betas) == 2
                and all(number(b) and 0.0 <= b < 1.0 for b in betas)
            ):
                problems.append(f"optimizer.params.betas: {show(betas)} must be two numbers in [0, 1)")
            else:
                params["betas"] = [float(b) for b in betas]
        if problems:
            raise ValueError("\n".join(problems))
        return params

    @property
    def name(self) -> str:
        """The canonical optimizer name (``"AdamW"``)."""
        return self.type


class SchedulerConfig(ConfigModel):
    """``scheduler``: one of LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR."""

    config_path: ClassVar[str] = "scheduler"

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        by_lower = {name.lower(): name for name in SCHEDULER_PARAMS}
        if value.lower() in by_lower:
            return by_lower[value.lower()]
        hint = suggest(value, SCHEDULER_PARAMS).replace("unknown key", "unknown scheduler")
        raise ValueError(f"{show(value)}: {hint}")

    @model_validator(mode="after")
    def _check_params(self, info: ValidationInfo) -> SchedulerConfig:
        spec = SCHEDULER_PARAMS[self.type]
        policy = (info.context or {}).get("unknown_keys", "error")
        problems, params = [], {}
        autos = [
            k for k, v in self.params.items() if v == AUTO_VALUE and k in spec and spec[k][1] is not _REQUIRED
        ]
        _warn_auto("scheduler", autos, f"the documented defaults of {self.type}")
        for key, value in self.params.items():
            path = join_path("scheduler", "params", key)
            if key not in spec:
                message = f"{path}: {suggest(key, spec)} (params of {self.type})"
                if policy == "warn":
                    warnings.warn(message + "; ignored", UserWarning, stacklevel=2)
                else:
                    problems.append(message)
                continue
            types, default = spec[key]
            if value == AUTO_VALUE:
                if default is _REQUIRED:
                    problems.append(
                        f'{path}: "auto" cannot be resolved here, {key} has no default: give a value'
                    )
                continue
            ok = any(_matches(value, t) for t in types)
            if ok and int in types and isinstance(value, float):
                value = int(value)  # 1e3 written for an integer
            if key == "warmup_type" and ok and value not in _WARMUP_TYPES:
                problems.append(f'{path}: {show(value)} is not one of "log", "linear"')
            elif not ok:
                names = " or ".join(_KIND_NAMES[t] for t in types)
                problems.append(f"{path}: {show(value)} is not {names}")
            else:
                params[key] = value
        for key, (_, default) in spec.items():
            if default is _REQUIRED and key not in self.params:
                problems.append(f"scheduler.params.{key}: required key is missing (needed by {self.type})")
        if problems:
            raise ValueError("\n".join(problems))
        object.__setattr__(self, "params", params)
        return self

    def resolved_params(self) -> dict[str, Any]:
        """Every param of the scheduler: the given ones over the documented defaults."""
        spec = SCHEDULER_PARAMS[self.type]
        return {
            k: self.params.get(k, d) for k, (_, d) in spec.items() if d is not _REQUIRED or k in self.params
        }
