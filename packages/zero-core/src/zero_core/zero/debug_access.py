"""``zero.utils.safe_get_*`` / ``safe_set_*``: full views of partitioned fp32 state, for debugging.

[Note: safe_get owner protocol]
With ZeRO a parameter's fp32 master value, reduced gradient and optimizer states are split
over the ranks, so reading them needs a collective. The stage that partitions a parameter
registers an owner for it (a weak reference on the parameter, see [Note: parameter owners] in
``zero/param_owners.py``), an object with the methods

    full_fp32_param(p) -> Tensor            full_grad(p) -> Tensor
    full_optimizer_state(p, key) -> Tensor  set_full_fp32_param(p, value) -> None
    set_full_optimizer_state(p, value, key) -> None

and, for the ``safe_*_local_*`` family, ``local_fp32_param(p)``, ``local_grad(p)``,
``local_optimizer_state(p, key)``, ``set_local_fp32_param(p, value)`` and
``set_local_optimizer_state(p, value, key)`` (stages 1-2: ``PartitionedOptimizerStrategy``;
stage 3 implements them in ``zero/stage3``). There is one public function per name here and
it dispatches to the owner, whatever the stage.

The ``full`` getters are collective: every rank of the parameter's partition group must call
them with the same parameter, in the same order. The ``full`` setters take the full value on
every rank and each rank writes only its own part (no communication). The ``local`` functions
touch only this rank's partition of the parameter (a 1-D tensor; what "local" covers is the
owner's layout) and never communicate. Gradients are returned unscaled: with fp16 the owner
divides by the current loss scale. A parameter with no owner (stage 0, frozen parameters) is
read from / written to the module directly; its "local" part is the whole parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.zero.param_owners import owner_of
from zero_core.zero.stage3.param_records import full_shape

_ABSENT = object()
# what _owner_method returns for a getter on a frozen parameter: the getter returns None
_FROZEN = object()


def _owner_method(where: str, param: Any, *, local: bool, value: Any = _ABSENT, key: Any = _ABSENT) -> Any:
    """Checks the arguments of the public function ``where`` and returns the bound method of the
    parameter's owner that implements it (named ``where`` without ``safe_`` / ``safe_get_``; see
    [Note: safe_get owner protocol]), or None for a parameter no ZeRO stage owns.

    Checks, in order: ``param`` is a tensor; a ``local`` function is implemented by the owner;
    ``value`` (when given) is a tensor, of the parameter's full shape unless ``local``; ``key``
    (when given, an optimizer-state function) is a non-empty string and the parameter has an
    owner (optimizer state of an unowned parameter lives in ``engine.optimizer.state``).
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"{where}: param must be a model parameter (torch.nn.Parameter), got {type(param).__name__}"
        )
    if where.startswith("safe_get_") and not param.requires_grad:
        return _FROZEN
    owner = owner_of(param)
    name = where.replace("safe_get_", "").replace("safe_", "")
    if local and owner is not None and not hasattr(owner, name):
        raise NotImplementedError(f"{where}: the ZeRO stage owning this parameter does not implement it")
    if value is not _ABSENT:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: value must be a torch.Tensor, got {type(value).__name__}")
        if not local:
            # a stage-3 parameter's .shape is empty while released: its record has the real one
            shape = full_shape(param)
            if tuple(value.shape) != shape:
                raise ValueError(f"{where}: value has shape {tuple(value.shape)}, the parameter has {shape}")
    if key is not _ABSENT:
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"{where}: optim_state_key must be a non-empty string such as 'exp_avg', got {key!r}"
            )
        if owner is None:
            verb = "write" if where.startswith("safe_set_") else "read"
            raise ValueError(
                f"{where}: this parameter is not partitioned by ZeRO (stage 0 or frozen); "
                f"{verb} engine.optimizer.state directly"
            )
    return None if owner is None else getattr(owner, name)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 (master) value of ``param``, assembled from every rank's partition. Collective."""
    method = _owner_method("safe_get_full_fp32_param", param, local=False)
    if method is _FROZEN:
        return None
    if method is None:
        return param.detach().float().clone()
    return method(param)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full reduced (averaged over ranks) gradient of ``param``. Collective.

    Valid between the backward of an accumulation boundary and ``engine.step()``; with fp16 it
    is divided by the current loss scale, so it is the gradient of the unscaled loss.
    """
    method = _owner_method("safe_get_full_grad", param, local=False)
    if method is _FROZEN:
        return None
    if method is None:
        return None if param.grad is None else param.grad.detach().float().clone()
    return method(param)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``. Collective."""
    method = _owner_method("safe_get_full_optimizer_state", param, local=False, key=optim_state_key)
    if method is _FROZEN:
        return None
    return method(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the full fp32 value of ``param`` (master and module copy). Every rank passes the same value."""
    method = _owner_method("safe_set_full_fp32_param", param, local=False, value=value)
    if method is None:
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        return
    method(param, value)


def safe_set_full_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set the full optimizer state ``optim_state_key`` of ``param``. Every rank passes the same value."""
    method = _owner_method(
        "safe_set_full_optimizer_state", param, local=False, value=value, key=optim_state_key
    )
    method(param, value, optim_state_key)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's partition of the fp32 (master) value of ``param``, flat. Not collective."""
    method = _owner_method("safe_get_local_fp32_param", param, local=True)
    if method is _FROZEN:
        return None
    if method is None:
        return param.detach().float().reshape(-1).clone()
    return method(param)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's partition of the reduced, unscaled gradient of ``param``, flat. Not collective.

    Valid between the backward of an accumulation boundary and ``engine.step()``.
    """
    method = _owner_method("safe_get_local_grad", param, local=True)
    if method is _FROZEN:
        return None
    if method is None:
        return None if param.grad is None else param.grad.detach().float().reshape(-1).clone()
    return method(param)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's partition of optimizer state ``optim_state_key`` of ``param``. Not collective."""
    method = _owner_method("safe_get_local_optimizer_state", param, local=True, key=optim_state_key)
    if method is _FROZEN:
        return None
    return method(param, optim_state_key)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's partition of the fp32 value of ``param`` (same numel as the local getter's)."""
    method = _owner_method("safe_set_local_fp32_param", param, local=True, value=value)
    if method is None:
        if value.numel() != param.numel():
            raise ValueError(
                f"safe_set_local_fp32_param: value has {value.numel()} elements, the parameter {param.numel()}"
            )
        with torch.no_grad():
            param.copy_(value.detach().reshape(param.shape).to(param.dtype))
        return
    method(param, value)


def safe_set_local_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's partition of optimizer state ``optim_state_key`` of ``param``."""
    method = _owner_method(
        "safe_set_local_optimizer_state", param, local=True, value=value, key=optim_state_key
    )
    method(param, value, optim_state_key)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the full reduced gradient of ``param`` (every rank passes the same value; each
    writes its own part). Between the backward of a boundary and ``engine.step()``; ``value``
    is on the scale ``safe_get_full_grad`` returns."""
    method = _owner_method("safe_set_full_grad", param, local=False, value=value)
    if method is None:
        param.grad = value.detach().to(param.dtype).clone()
        return
    method(param, value)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's partition of the reduced gradient of ``param`` (the layout of
    ``safe_get_local_grad``). Not collective."""
    method = _owner_method("safe_set_local_grad", param, local=True, value=value)
    if method is None:
        if value.numel() != param.numel():
            raise ValueError(
                f"safe_set_local_grad: value has {value.numel()} elements, the parameter {param.numel()}"
            )
        param.grad = value.detach().reshape(param.shape).to(param.dtype).clone()
        return
    method(param, value)


__all__ = [
    "safe_set_full_grad",
    "safe_set_local_grad",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
]
