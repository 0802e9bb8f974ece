"""Finding the optional packages of the zero family.

zero-core imports none of its sibling packages at module level: dependencies point one way
(every package may use zero-core, never the reverse). When a feature that lives in another
package is asked for (``offload_optimizer``, a ``PipelineModule``, CPUAdam ...), zero-core
looks the package up here, and a missing one is a clear error naming the distribution to
install.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

# import name -> distribution name, for every optional member of the family.
FAMILY: dict[str, str] = {
    "zero_offload": "zero-offload",
    "zero_pipe": "zero-pipe",
    "zero_moe": "zero-moe",
    "zero_inference": "zero-inference",
    "zero_profiler": "zero-profiler",
    "zero_ops": "zero-ops",
}


class MissingPackageError(ImportError):
    """A feature was asked for whose package of the zero family is not installed."""


def is_available(module: str) -> bool:
    """Whether the family member with import name ``module`` is installed."""
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a family member, or one of its submodules) for ``feature``.

    Raises :class:`MissingPackageError` naming the distribution to install when the
    package is absent. Errors raised while importing an installed package propagate
    unchanged, so a broken install is not reported as a missing one.
    """
    top = module.split(".", 1)[0]
    if importlib.util.find_spec(top) is None:
        dist = FAMILY.get(top, top.replace("_", "-"))
        raise MissingPackageError(
            f"{feature} needs the '{dist}' package, which is not installed: pip install {dist}"
        )
    return importlib.import_module(module)


def installed_family() -> dict[str, str | None]:
    """Distribution name -> installed version (None when not installed), zero-core included."""
    out: dict[str, str | None] = {}
    for dist in ["zero-core", *FAMILY.values(), "zero"]:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out
