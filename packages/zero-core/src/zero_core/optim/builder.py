"""Build the optimizer named by the config's ``optimizer`` section.

Type names are matched case-insensitively as DeepSpeed does. DeepSpeed's ``Adam`` applies
decoupled weight decay unless ``adam_w_mode`` is false (its default is true), so ``Adam``
here builds ``torch.optim.AdamW`` by default and ``torch.optim.Adam`` with
``"adam_w_mode": false``; ``torch_adam`` is accepted and has no effect on the math.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero_core.plugins import require


def _adam(params: Iterable[Any], **kw: Any) -> torch.optim.Optimizer:
    adam_w_mode = kw.pop("adam_w_mode", True)
    kw.pop("torch_adam", None)
    kw.pop("fused", None)
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kw)


def _adamw(params: Iterable[Any], **kw: Any) -> torch.optim.Optimizer:
    kw.pop("adam_w_mode", None)
    kw.pop("torch_adam", None)
    return torch.optim.AdamW(params, **kw)


def _lamb(params: Iterable[Any], **kw: Any) -> torch.optim.Optimizer:
    from zero_core.optim.lamb import Lamb

    return Lamb(params, **kw)


def _cpu_adam(params: Iterable[Any], **kw: Any) -> torch.optim.Optimizer:
    adam = require("zero_ops.adam", "optimizer type CPUAdam")
    kw.pop("torch_adam", None)
    return adam.CPUAdam(params, **kw)


OPTIMIZER_TYPES: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": _adam,
    "adamw": _adamw,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "lamb": _lamb,
    "cpuadam": _cpu_adam,
    "deepspeedcpuadam": _cpu_adam,
}


def build_optimizer(
    params: Iterable[Any], opt_type: str, opt_params: dict[str, Any] | None
) -> torch.optim.Optimizer:
    """The optimizer of type ``opt_type`` (e.g. ``"AdamW"``) over ``params``."""
    key = str(opt_type).replace("_", "").lower()
    factory = OPTIMIZER_TYPES.get(key)
    if factory is None:
        known = "Adam, AdamW, SGD, Adagrad, Lamb, CPUAdam"
        raise ValueError(f"optimizer.type: '{opt_type}' is not supported; use one of {known}")
    kw = dict(opt_params or {})
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    try:
        return factory(params, **kw)
    except TypeError as e:
        target = factory if not inspect.isfunction(factory) else opt_type
        raise ValueError(f"optimizer.params for {opt_type}: {e} (given: {sorted(kw)}; target {target})") from e
