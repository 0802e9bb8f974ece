"""zero-core: the shared protocol layer, config, distributed runtime, ZeRO partitioning and
the training engine of the zero family.

Public names are resolved lazily so that ``import zero_core`` stays cheap and optional
dependencies (tensorboard, wandb, mpi4py) are only imported when used.
"""

from __future__ import annotations

import importlib
from typing import Any

from zero_core.version import __version__

# public name -> "module:attribute" (filled in as subsystems land)
_LAZY: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'zero_core' has no attribute '{name}'")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", *_LAZY]
