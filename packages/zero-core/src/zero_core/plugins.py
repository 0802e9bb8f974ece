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


# distribution -> the family members it depends on besides zero-core (its pyproject's dependencies)
FAMILY_DEPENDENCIES: dict[str, tuple[str, ...]] = {"zero-offload": ("zero-ops",)}


def install_hint(dist: str, extra: str | None = None) -> str:
    """The command that installs ``dist`` (with its optional ``extra``, and its missing family
    members) from a clone.

    [Note: install hints]
    The packages of the family are installed from a clone of the repository (``pip install
    packages/zero-pipe``); a bare ``pip install zero-pipe`` would look the name up in an index,
    where no such package of ours is published (and a package someone else registered under
    that name would be installed instead). pip resolves a local folder's dependencies from the
    index, so the folders of missing family members it depends on (zero-offload needs
    zero-ops) go on the same command line. A feature behind an extra of the package (zero-profiler's
    ``autotuning``) names it: ``pip install 'packages/zero-profiler[autotuning]'``.
    """
    missing = [d for d in FAMILY_DEPENDENCIES.get(dist, ()) if not is_available(d.replace("-", "_"))]
    target = f"'packages/{dist}[{extra}]'" if extra else f"packages/{dist}"
    folders = " ".join([*(f"packages/{d}" for d in missing), target])
    return f"pip install {folders} (from a clone of the zero repository)"


class MissingPackageError(ImportError):
    """A feature was asked for whose package of the zero family is not installed."""


def is_available(module: str) -> bool:
    """Whether the family member with import name ``module`` is installed."""
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str, *, extra: str | None = None) -> ModuleType:
    """Import ``module`` (a family member, or one of its submodules) for ``feature``.

    Raises :class:`MissingPackageError` naming the distribution to install (with ``extra``, the
    optional extra of it that ``feature`` belongs to) when the package is absent. Errors raised
    while importing an installed package propagate unchanged, so a broken install is not
    reported as a missing one.
    """
    top = module.split(".", 1)[0]
    if importlib.util.find_spec(top) is None:
        dist = FAMILY.get(top, top.replace("_", "-"))
        raise MissingPackageError(
            f"{feature} needs the '{dist}' package, which is not installed: {install_hint(dist, extra)}"
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
