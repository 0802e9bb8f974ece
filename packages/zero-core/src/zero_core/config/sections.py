"""Registry of config sections owned by other packages.

[Note: config sections]
Some top-level sections of the config belong to packages other than zero-core: ``pipeline``
(zero-pipe), ``moe`` (zero-moe), ``aio`` (zero-offload), ``flops_profiler`` (zero-profiler),
and others. zero-core cannot import those packages (dependencies point one way), so each package
hands its pydantic model for the section to zero-core, in one of two ways:

* an entry point in the group ``zero.config_sections``, named after the section, whose value is
  ``"module:Class"`` (found on the first config load, so installing the package is enough), or
* an explicit call ``register_config_section(name, model)`` (wins over the entry point).

A section nobody registered keeps its built-in model (``builtin_sections.py``), which is
permissive: it type-checks the keys DeepSpeed documents and keeps the rest, so a DeepSpeed config
runs unchanged with only zero-core installed. A registered model replaces the built-in one for
validation, defaults and attribute access (``cfg.pipeline`` is an instance of the registered
model). A registered name that is not a built-in section becomes a new top-level key, reached
with ``cfg.section(name)``. Core sections (``zero_optimization``, ``fp16``, ...) cannot be
replaced: the engine relies on their exact fields.
"""

from __future__ import annotations

import importlib.metadata
import threading

from pydantic import BaseModel

from zero_core.config.builtin_sections import BUILTIN_SECTIONS

ENTRY_POINT_GROUP = "zero.config_sections"

_lock = threading.RLock()
_registered: dict[str, type[BaseModel]] = {}
_entry_points: dict[str, type[BaseModel]] | None = None
#: names of the root model's core fields; filled by ``root.py`` (which imports this module).
CORE_KEYS: set[str] = set()


def _check(name: object, model: object, where: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{where}: section name must be an identifier string, got {name!r}")
    if name in CORE_KEYS:
        raise ValueError(
            f"{where}: {name!r} is a core config key of zero-core and cannot be replaced; "
            f"plugin sections are {', '.join(sorted(BUILTIN_SECTIONS))} or new names"
        )
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(
            f"{where}: the model for section {name!r} must be a pydantic BaseModel subclass, got {model!r}"
        )


def register_config_section(name: str, model: type[BaseModel]) -> None:
    """Validate the top-level config section ``name`` with ``model``. See [Note: config sections]."""
    _check(name, model, "register_config_section")
    with _lock:
        _registered[name] = model


def unregister_config_section(name: str) -> None:
    """Undo :func:`register_config_section` (entry points and built-ins apply again)."""
    with _lock:
        if name not in _registered:
            raise KeyError(f"unregister_config_section: no section {name!r} was registered")
        del _registered[name]


def _discover() -> dict[str, type[BaseModel]]:
    global _entry_points
    if _entry_points is None:
        found: dict[str, type[BaseModel]] = {}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                model = ep.load()
            except Exception as exc:  # a broken install must not look like a missing one
                raise ImportError(
                    f"config section {ep.name!r}: loading entry point {ep.value!r} "
                    f"(group {ENTRY_POINT_GROUP}) failed: {exc}"
                ) from exc
            _check(ep.name, model, f"entry point {ep.value!r} (group {ENTRY_POINT_GROUP})")
            found[ep.name] = model
        _entry_points = found
    return _entry_points


def refresh_entry_points() -> None:
    """Forget discovered entry points (after installing a package in a running process)."""
    global _entry_points
    with _lock:
        _entry_points = None


def config_sections() -> dict[str, type[BaseModel]]:
    """Every plugin section name -> the model that validates it now (registered > entry point > built-in)."""
    with _lock:
        return {**BUILTIN_SECTIONS, **_discover(), **_registered}


def section_model(name: str) -> type[BaseModel] | None:
    """The model validating plugin section ``name``, or None when ``name`` is no plugin section."""
    return config_sections().get(name)
