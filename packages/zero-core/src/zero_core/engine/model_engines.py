"""Engines for model kinds that other packages own (a ``PipelineModule`` of zero-pipe).

[Note: model engine hooks]
``initialize`` builds its data-parallel engine for any ``nn.Module``, but some model classes
need another engine: a zero-pipe ``PipelineModule`` (and every subclass of it, as DeepSpeed's
``isinstance(model, PipelineModule)`` accepts) trains with zero-pipe's ``PipelineEngine``.
zero-core cannot import zero-pipe (dependencies point one way), so the package registers a hook
under the entry point group ``zero.model_engines``: an object with

* ``accepts(model) -> bool`` - an ``isinstance`` check against the package's own class,
* ``data_parallel_world_size(model, world_size) -> int`` - the data-parallel degree the
  config's batch sizes are resolved for (a pipeline of ``s`` stages: ``world_size // s``),
* ``initialize(model=..., optimizer=..., model_parameters=..., training_data=...,
  lr_scheduler=..., config=..., collate_fn=...)`` - the 4-tuple of ``zero.initialize``.

An object of a package's class can only exist once that package is imported, so a hook whose
top-level package is not in ``sys.modules`` is not even loaded: plain models never import the
other packages.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any, Protocol

ENTRY_POINT_GROUP = "zero.model_engines"


class ModelEngineHook(Protocol):
    """What a package registers under ``zero.model_engines``. See [Note: model engine hooks]."""

    def accepts(self, model: object) -> bool: ...

    def data_parallel_world_size(self, model: Any, world_size: int) -> int: ...

    def initialize(self, **kwargs: Any) -> tuple[Any, Any, Any, Any]: ...


def find_model_engine(model: object) -> ModelEngineHook | None:
    """The registered hook that accepts ``model``, or None for a plain module."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        top = ep.value.split(":", 1)[0].split(".", 1)[0]
        if top not in sys.modules:
            continue  # See [Note: model engine hooks]: no object of that package can exist yet
        try:
            hook = ep.load()
        except Exception as exc:  # a broken install must not look like a plain model
            raise ImportError(
                f"model engine {ep.name!r}: loading entry point {ep.value!r} (group {ENTRY_POINT_GROUP}) "
                f"failed: {exc}"
            ) from exc
        if hook.accepts(model):
            return hook
    return None
