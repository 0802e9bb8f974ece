"""Manual registration of external parameters (``zero.register_external_parameter``).

A parameter is *external* to a module when the module's forward uses it although another
module owns it. Stage 3 then gathers it with the module's own parameters before the module's
forward and backward. The two common patterns are detected automatically (see
[Note: stage 3 hooks]); this module is the manual route and the registry both share.
"""

from __future__ import annotations

import torch

from zero_core.zero.stage3.param_records import full_shape


def _check(module: object, parameter: object, where: str) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError(f"{where}: parameter must be a torch.nn.Parameter, got {type(parameter).__name__}")


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Have stage 3 gather ``parameter`` whenever ``module`` runs forward or backward."""
    _check(module, parameter, "register_external_parameter")
    ext = module.__dict__.setdefault("_zero_external_params", [])
    if not any(p is parameter for p in ext):
        ext.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`; raises if it was not registered."""
    _check(module, parameter, "unregister_external_parameter")
    ext = module.__dict__.get("_zero_external_params", [])
    for i, p in enumerate(ext):
        if p is parameter:
            del ext[i]
            return
    raise ValueError(
        f"unregister_external_parameter: the parameter (shape {full_shape(parameter)})"
        f" is not registered as external to this {type(module).__name__}"
    )


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered as external to ``module`` (manually or automatically)."""
    return list(module.__dict__.get("_zero_external_params", []))
