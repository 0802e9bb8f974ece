"""Layer recipes of a ``PipelineModule``: :class:`LayerSpec` and :class:`TiedLayerSpec`.

A leaf module: the pipeline module builds its layers from them, and the checkpoint code reads
them (which file holds a layer, tied layers once) without needing the module class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn


class LayerSpec:
    """A recipe ``typename(*module_args, **module_kwargs)`` built only where it is needed."""

    def __init__(self, typename: type, *module_args: object, **module_kwargs: object) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__}, args={self.module_args}, kwargs={self.module_kwargs})"

    def build(self, log: bool = False) -> nn.Module:
        """Instantiate the layer."""
        if log:
            print(f"building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer sharing its module (and so ``tied_weight_attr`` weights) with every other
    ``TiedLayerSpec`` of the same ``key``. ``forward_fn(module, x)``, when given, replaces
    ``module(x)`` at this position (e.g. an embedding reused as output projection)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: object,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: object,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec: forward_fn must be callable, got {forward_fn!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


def first_tied_index(specs: Sequence[Any]) -> dict[str, int]:
    """Tied key -> the first global layer index using it."""
    first: dict[str, int] = {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            first.setdefault(spec.key, idx)
    return first
