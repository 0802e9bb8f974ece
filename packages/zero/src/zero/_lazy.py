"""Lazy re-export of names from the package of the family that owns them.

[Note: facade]
The ``zero`` distribution owns no feature. Each name it offers is resolved on first access
from the package that implements it, so ``import zero`` is cheap, a user who installed only
some packages can still use those, and touching a feature whose package is missing raises an
ImportError that names the distribution to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any

from zero_core.plugins import MissingPackageError, require

__all__ = ["MissingPackageError", "import_owner", "lazy_module"]


def import_owner(module: str, what: str) -> ModuleType:
    """Import ``module`` (a family module path) or raise zero-core's ``MissingPackageError``
    naming the distribution to install (one family map: ``zero_core.plugins.FAMILY``)."""
    return require(module, what)


def lazy_module(
    facade_name: str, target: str, names: dict[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__``/``__dir__`` that forward to ``target``.

    ``names`` maps facade names to ``"module:attr"`` for names that live elsewhere than
    ``target``; every other public name is looked up on ``target`` itself.
    """
    names = names or {}

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:  # a facade submodule (zero.zero.stage3, zero.utils.zero_to_fp32 ...)
            if importlib.util.find_spec(f"{facade_name}.{name}") is not None:
                return importlib.import_module(f"{facade_name}.{name}")
        except ModuleNotFoundError:  # facade_name is a plain module, not a package
            pass
        where = names.get(name)
        if where is not None:
            module, _, attr = where.partition(":")
            return getattr(import_owner(module, f"{facade_name}.{name}"), attr)
        mod = import_owner(target, f"{facade_name}.{name}")
        try:
            return getattr(mod, name)
        except AttributeError:
            raise AttributeError(f"module '{facade_name}' has no attribute '{name}'") from None

    def __dir__() -> list[str]:
        listed = set(names)
        try:
            listed |= {n for n in dir(importlib.import_module(target)) if not n.startswith("_")}
        except ImportError:
            pass
        return sorted(listed)

    return __getattr__, __dir__
