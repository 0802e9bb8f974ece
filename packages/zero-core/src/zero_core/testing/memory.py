"""Measure the tensor storages alive in a process, for memory tests.

A breakdown (``engine.memory_breakdown()``) is only worth something if it matches the memory
really held. These helpers find that memory without asking the engine: every tensor object the
garbage collector knows (PyTorch keeps a tensor's Python object alive as long as the tensor
lives, including tensors saved by autograd), reduced to distinct storages, minus the storages
that existed before the engine was built and those the test holds itself. Activations saved for
backward are found with ``torch.autograd.graph.saved_tensors_hooks`` so a forward-phase check
can set them apart from model states.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


def _key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr())


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


class StorageBaseline:
    """The storages alive now, kept alive so that a later allocation cannot reuse their
    addresses (a freed address reused by a new storage would be mistaken for an old one)."""

    def __init__(self) -> None:
        self._held = _live_tensors()
        self.keys = {k for t in self._held if (k := _key(t)) is not None}

    def release(self) -> None:
        self._held = []


def live_storages(
    exclude: Iterable[torch.Tensor] = (), baseline: StorageBaseline | None = None
) -> dict[tuple[str, int], int]:
    """``{(device, data_ptr): nbytes}`` of every distinct storage behind a live tensor object,
    leaving out the storages of ``exclude`` and those alive at ``baseline``."""
    skip = {k for t in exclude if (k := _key(t)) is not None}
    if baseline is not None:
        skip |= baseline.keys
    out: dict[tuple[str, int], int] = {}
    for obj in _live_tensors():
        key = _key(obj)
        if key is not None and key not in skip:
            out[key] = obj.untyped_storage().nbytes()
    return out


class SavedForBackward:
    """Records the storages autograd saves for backward inside :meth:`recording`."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, int]] = set()

    @contextmanager
    def recording(self) -> Iterator[None]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _key(t)
            if key is not None:
                self.keys.add(key)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
