"""Nested containers of tensors: one leaf helper that the engine, the strategies and the
checkpoint code share (it lives below all of them, so none imports upward to reach it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["map_tensors"]


_T = TypeVar("_T")


def map_tensors(item: _T, fn: Callable[[torch.Tensor], torch.Tensor]) -> _T:
    """``item`` with every tensor nested in its dicts, lists and tuples replaced by ``fn(tensor)``.

    Containers are rebuilt, keeping their type: a tuple keeps its type (namedtuples included),
    a dict subclass keeps its type when it can be rebuilt from a dict (OrderedDict; a defaultdict
    becomes a dict), a list becomes a list. Other values are returned as they are.
    """
    if torch.is_tensor(item):
        return fn(item)
    if isinstance(item, dict):
        mapped = {k: map_tensors(v, fn) for k, v in item.items()}
        if type(item) is dict:
            return mapped
        try:
            return type(item)(mapped)
        except TypeError:
            return mapped
    if isinstance(item, list):
        return [map_tensors(v, fn) for v in item]
    if isinstance(item, tuple):
        values = [map_tensors(v, fn) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    return item
