"""Build the optimizer named by the config's ``optimizer`` section.

Type names are matched case-insensitively as DeepSpeed does. DeepSpeed's ``Adam`` applies
decoupled weight decay unless ``adam_w_mode`` is false (its default is true), so ``Adam``
here builds ``torch.optim.AdamW`` by default and ``torch.optim.Adam`` with
``"adam_w_mode": false``; ``torch_adam`` is accepted and has no effect on the math.
``FusedAdam`` is the same math as ``Adam``; ``"bias_correction": false`` (which torch's Adam cannot
express) builds zero-ops' :class:`zero_ops.adam.FusedAdam`. ``Lamb``, ``CPUAdam`` and ``Lion`` come
from zero-ops too. Any other name of a ``torch.optim`` optimizer class (e.g. ``RMSprop``) builds
that class, as the config section documents. DeepSpeed's communication-compressed optimizers
(``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``; also spelled ``OnebitAdam``/``OnebitLamb``/
``ZeroOne_Adam``, case and underscores ignored) build :mod:`zero_ops.onebit`. Every optimizer of
zero-ops is found through ``plugins.require``: without zero-ops, naming one is an error that says
how to install it. The muP variants are not provided: naming them is an error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

from zero_core import plugins


def _adam(params: ParamsT, **kw: object) -> torch.optim.Optimizer:
    adam_w_mode = kw.pop("adam_w_mode", True)
    kw.pop("torch_adam", None)
    kw.pop("fused", None)
    if not kw.pop("bias_correction", True):  # torch's Adam always corrects: DeepSpeed's FusedAdam math
        adam = plugins.require("zero_ops.adam", 'optimizer "bias_correction": false (FusedAdam)')
        return adam.FusedAdam(params, bias_correction=False, adam_w_mode=adam_w_mode, **kw)
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kw)


def _adamw(params: ParamsT, **kw: object) -> torch.optim.Optimizer:
    kw.pop("adam_w_mode", None)
    if not kw.get("bias_correction", True):
        return _adam(params, adam_w_mode=True, **kw)
    kw.pop("torch_adam", None)
    kw.pop("bias_correction", None)
    return torch.optim.AdamW(params, **kw)


def _lamb(params: ParamsT, **kw: object) -> torch.optim.Optimizer:
    lamb = plugins.require("zero_ops.lamb", "optimizer type Lamb")
    return lamb.Lamb(params, **kw)


def _cpu_adam(params: ParamsT, **kw: object) -> torch.optim.Optimizer:
    # looked up through the module so tests can stand in for an absent or present zero-ops
    adam = plugins.require("zero_ops.adam", "optimizer type CPUAdam")
    kw.pop("torch_adam", None)
    return adam.CPUAdam(params, **kw)


def _lion(params: ParamsT, **kw: object) -> torch.optim.Optimizer:
    lion = plugins.require("zero_ops.lion", "optimizer type Lion")
    return lion.CPULion(params, **kw)


def _onebit(name: str, config_name: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: ParamsT, **kw: object) -> torch.optim.Optimizer:
        onebit = plugins.require("zero_ops.onebit", f"optimizer type {config_name}")
        return getattr(onebit, name)(params, **kw)

    return build


#: DeepSpeed names the config accepts that this build does not implement.
_NOT_PROVIDED = ("muadam", "muadamw", "musgd")


def _torch_optimizer(opt_type: str) -> Callable[..., torch.optim.Optimizer] | None:
    cls = getattr(torch.optim, str(opt_type), None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
        return cls
    return None


OPTIMIZER_TYPES: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": _adam,
    "adamw": _adamw,
    "fusedadam": _adam,
    "lion": _lion,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "lamb": _lamb,
    "cpuadam": _cpu_adam,
    "deepspeedcpuadam": _cpu_adam,
    "onebitadam": _onebit("OnebitAdam", "OneBitAdam"),
    "zerooneadam": _onebit("ZeroOneAdam", "ZeroOneAdam"),
    "onebitlamb": _onebit("OnebitLamb", "OneBitLamb"),
}


_ONEBIT = ("onebitadam", "zerooneadam", "onebitlamb")


def build_optimizer(
    params: Iterable[Any], opt_type: str, opt_params: dict[str, Any] | None
) -> torch.optim.Optimizer:
    """The optimizer of type ``opt_type`` (e.g. ``"AdamW"``) over ``params``."""
    key = str(opt_type).replace("_", "").lower()
    factory = OPTIMIZER_TYPES.get(key) or _torch_optimizer(opt_type)
    if factory is None:
        known = (
            "Adam, AdamW, FusedAdam, SGD, Adagrad, Lamb, CPUAdam, Lion, OneBitAdam, ZeroOneAdam, OneBitLamb "
            "or a torch.optim class name"
        )
        why = "is not provided by this build" if key in _NOT_PROVIDED else "is not supported"
        raise ValueError(f"optimizer.type: '{opt_type}' {why}; use one of {known}")
    kw = dict(opt_params or {})
    # Old FusedAdam clipped inside the optimizer; DeepSpeed refuses it too. The 1-bit optimizers'
    # signatures carry max_grad_norm=0.0 (no clipping), which is accepted.
    if "max_grad_norm" in kw and not (key in _ONEBIT and not kw["max_grad_norm"]):
        raise ValueError(
            f"optimizer.params.max_grad_norm ({opt_type}): gradient clipping is not an optimizer setting; "
            f'use the top-level "gradient_clipping": {kw["max_grad_norm"]!r}'
        )
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    try:
        return factory(params, **kw)
    except TypeError as e:
        target = factory if not inspect.isfunction(factory) else opt_type
        raise ValueError(
            f"optimizer.params for {opt_type}: {e} (given: {sorted(kw)}; target {target})"
        ) from e
