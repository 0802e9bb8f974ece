"""ZeRO-3 leaf modules: gathered whole at their entry instead of submodule by submodule.

[Note: z3 leaf modules]
Stage 3 gathers each module's own parameters when that module runs (See [Note: stage 3
hooks]). That needs every rank to run the same submodules in the same order; a
Mixture-of-Experts block whose experts run in data-dependent order (only the experts that
received tokens) breaks it, and many tiny submodules cost one collective each. Marking such a
block a *leaf* (DeepSpeed's ``set_z3_leaf_modules``) makes its forward pre-hook gather every
parameter of its whole subtree at once and its post-hook release them; its descendants get no
hooks of their own, so whatever order they run in costs no collective. Backward gathers the
subtree again at the leaf's entry, and its gradients are reduced as one unit whatever each rank
touched (See [Note: z3 leaf gradient units] in ``leaf_grads.py``). Mark leaves *before*
``initialize`` (hooks are installed there), as with DeepSpeed. Without the mark, ranks that
run different submodules stop at the agreement check with an error that says to mark the block.

The flag is the module attribute ``_z3_leaf`` (DeepSpeed's), so a model marked for DeepSpeed
is marked for us.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_FLAG = "_z3_leaf"


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ZeRO-3 leaf module."""
    return bool(getattr(model, _FLAG, False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a ZeRO-3 leaf module's subtree (set by :func:`set_z3_leaf_modules`)."""
    return bool(getattr(param, "zero_z3_leaf_module", False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of ``model`` (itself included) marked as a leaf."""
    _check_model("get_z3_leaf_modules", model)
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches(module: torch.nn.Module, classes: list[type | str]) -> bool:
    return any(
        (isinstance(c, str) and type(module).__name__ == c) or (isinstance(c, type) and isinstance(module, c))
        for c in classes
    )


def _check_model(where: str, model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")


def _set(
    where: str, model: torch.nn.Module, leaf_module_classes: Iterable[Any], flag: bool
) -> list[torch.nn.Module]:
    _check_model(where, model)
    if isinstance(leaf_module_classes, (str, type)):
        raise TypeError(
            f"{where}: leaf_module_classes must be a list of classes or class names, not a single one"
        )
    classes = list(leaf_module_classes)
    for c in classes:
        if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, torch.nn.Module))):
            raise TypeError(f"{where}: {c!r} is neither a torch.nn.Module subclass nor a class name")
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"{where}: no module of type {names} found in the model ({type(model).__name__})")
    for m in found:
        setattr(m, _FLAG, flag)
        for p in m.parameters():
            p.zero_z3_leaf_module = flag
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[Any]) -> list[torch.nn.Module]:
    """Mark every submodule of ``model`` whose class is in ``leaf_module_classes`` (classes or
    class names) as a ZeRO-3 leaf; returns the marked modules. See [Note: z3 leaf modules]."""
    return _set("set_z3_leaf_modules", model, leaf_module_classes, True)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: Iterable[Any]
) -> list[torch.nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for those classes; returns the modules unmarked."""
    return _set("unset_z3_leaf_modules", model, leaf_module_classes, False)


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Mark (``flag=True``) or unmark one module as a ZeRO-3 leaf."""
    _check_model("set_z3_leaf_module", model)
    setattr(model, _FLAG, bool(flag))


def leaf_descendants(root: torch.nn.Module) -> set[int]:
    """ids of the modules strictly inside a leaf's subtree (they get no hooks of their own)."""
    inside: set[int] = set()
    for m in root.modules():
        if id(m) not in inside and z3_leaf_module(m):
            inside.update(id(c) for c in m.modules() if c is not m)
    return inside
