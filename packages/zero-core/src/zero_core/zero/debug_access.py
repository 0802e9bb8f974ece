"""``zero.utils.safe_get_*`` / ``safe_set_*``: full views of partitioned fp32 state, for debugging.

[Note: safe_get owner protocol]
With ZeRO a parameter's fp32 master value, reduced gradient and optimizer states are split
over the ranks, so reading them needs a collective. The stage that partitions a parameter
marks it with ``param._zero_owner``, an object with the methods

    full_fp32_param(p) -> Tensor            full_grad(p) -> Tensor
    full_optimizer_state(p, key) -> Tensor  set_full_fp32_param(p, value) -> None
    set_full_optimizer_state(p, value, key) -> None

(stages 1-2: ``PartitionedOptimizerStrategy``; stage 3 implements the same five). The getters
are collective: every rank of the data-parallel group must call them with the same parameter,
in the same order. The setters take the full value on every rank and each rank writes only
its own part (no communication). A parameter with no owner (stage 0, frozen parameters) is
read from / written to the module directly.
"""

from __future__ import annotations

from typing import Any

import torch


def _check_param(param: Any, where: str) -> Any:
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"{where}: param must be a model parameter (torch.nn.Parameter), got {type(param).__name__}"
        )
    return getattr(param, "_zero_owner", None)


def _check_value(param: torch.Tensor, value: Any, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: value must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{where}: value has shape {tuple(value.shape)}, the parameter has {tuple(param.shape)}"
        )


def _check_key(key: Any, where: str) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"{where}: optim_state_key must be a non-empty string such as 'exp_avg', got {key!r}")


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 (master) value of ``param``, assembled from every rank's partition. Collective."""
    owner = _check_param(param, "safe_get_full_fp32_param")
    if owner is None:
        return param.detach().float().clone()
    return owner.full_fp32_param(param)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full reduced (averaged over ranks) gradient of ``param``. Collective.

    Valid between the backward of an accumulation boundary and ``engine.step()``; with fp16 it
    still carries the loss scale.
    """
    owner = _check_param(param, "safe_get_full_grad")
    if owner is None:
        return None if param.grad is None else param.grad.detach().float().clone()
    return owner.full_grad(param)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """The full optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``. Collective."""
    owner = _check_param(param, "safe_get_full_optimizer_state")
    _check_key(optim_state_key, "safe_get_full_optimizer_state")
    if owner is None:
        raise ValueError(
            "safe_get_full_optimizer_state: this parameter is not partitioned by ZeRO (stage 0 or frozen); "
            "read engine.optimizer.state directly"
        )
    return owner.full_optimizer_state(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the full fp32 value of ``param`` (master and module copy). Every rank passes the same value."""
    owner = _check_param(param, "safe_set_full_fp32_param")
    _check_value(param, value, "safe_set_full_fp32_param")
    if owner is None:
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        return
    owner.set_full_fp32_param(param, value)


def safe_set_full_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the full optimizer state ``optim_state_key`` of ``param``. Every rank passes the same value."""
    owner = _check_param(param, "safe_set_full_optimizer_state")
    _check_value(param, value, "safe_set_full_optimizer_state")
    _check_key(optim_state_key, "safe_set_full_optimizer_state")
    if owner is None:
        raise ValueError(
            "safe_set_full_optimizer_state: this parameter is not partitioned by ZeRO (stage 0 or frozen); "
            "write engine.optimizer.state directly"
        )
    owner.set_full_optimizer_state(param, value, optim_state_key)


__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]
