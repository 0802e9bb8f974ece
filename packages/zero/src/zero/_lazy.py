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
from typing import Any

FAMILY_DIST = {
    "zero_core": "zero-core",
    "zero_offload": "zero-offload",
    "zero_pipe": "zero-pipe",
    "zero_moe": "zero-moe",
    "zero_inference": "zero-inference",
    "zero_profiler": "zero-profiler",
    "zero_ops": "zero-ops",
}


class MissingPackageError(ImportError):
    """The package of the family that owns a requested name is not installed."""


def _install_hint(dist: str) -> str:
    """zero-core's install command for ``dist``. See [Note: install hints] in zero_core.plugins."""
    if importlib.util.find_spec("zero_core") is None:
        return f"pip install packages/zero-core packages/{dist} (from a clone of the zero repository)"
    from zero_core.plugins import install_hint

    return install_hint(dist)


def import_owner(module: str, what: str) -> Any:
    """Import ``module`` (a family module path) or raise naming the distribution to install."""
    top = module.split(".", 1)[0]
    if importlib.util.find_spec(top) is None:
        dist = FAMILY_DIST.get(top, top)
        raise MissingPackageError(
            f"{what} is provided by the '{dist}' package, which is not installed: {_install_hint(dist)}"
        )
    return importlib.import_module(module)


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
