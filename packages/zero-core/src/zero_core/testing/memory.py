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


def live_storages(exclude: Iterable[torch.Tensor] = ()) -> dict[tuple[str, int], int]:
    """``{(device, data_ptr): nbytes}`` of every distinct storage behind a live tensor object,
    leaving out the storages of ``exclude``."""
    gc.collect()
    skip = {k for t in exclude if (k := _key(t)) is not None}
    out: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
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
