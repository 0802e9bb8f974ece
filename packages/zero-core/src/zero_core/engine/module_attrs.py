"""The engine answers for its wrapped module: ``engine.generate(...)``, ``engine.config_x``.

[Note: engine attribute forwarding]
DeepSpeed's engine forwards an attribute it does not have to the module it wraps, so scripts
call ``engine.generate(...)``, custom model methods or read ``engine.num_local_experts``
without unwrapping. Lookup order: the engine's own attributes (normal Python lookup, which
never reaches ``__getattr__``), then ``torch.nn.Module``'s registered parameters, buffers and
submodules of the engine, then the wrapped module. A name neither has gives an
``AttributeError`` naming both, so ``hasattr``/``getattr(..., default)`` keep working.
Dunder names are never forwarded (``copy``/``pickle`` probe ``__getstate__``,
``__deepcopy__`` ... on half-built objects and must see the engine's own answer), and an
instance whose ``__init__`` has not run yet (no ``_modules``) forwards nothing, which keeps
the lookup from recursing.
"""

from __future__ import annotations

from typing import Any

import torch


def forward_to_module(engine: torch.nn.Module, name: str) -> Any:
    """``engine.__getattr__``: the engine's registered parts, then the wrapped module's attribute.

    :class:`~zero_core.engine.engine.ZeroEngine` defines ``__getattr__`` as a call of this
    function (composition, not a mixin). See [Note: engine attribute forwarding].
    """
    try:
        return torch.nn.Module.__getattr__(engine, name)
    except AttributeError:
        pass
    modules = engine.__dict__.get("_modules")
    wrapped = modules.get("module") if modules is not None else None
    if wrapped is None or (name.startswith("__") and name.endswith("__")):
        raise AttributeError(f"'{type(engine).__name__}' object has no attribute '{name}'")
    try:
        return getattr(wrapped, name)
    except AttributeError:
        raise AttributeError(
            f"'{type(engine).__name__}' object has no attribute '{name}', and neither has the "
            f"module it wraps ('{type(wrapped).__name__}')"
        ) from None
