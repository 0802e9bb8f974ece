"""Measure the tensor storages alive in a process, for memory tests.

A breakdown (``engine.memory_breakdown()``) is only worth something if it matches the memory
really held. These helpers find that memory without asking the engine: every tensor object the
garbage collector knows (PyTorch keeps a tensor's Python object alive as long as the tensor
lives, including tensors saved by autograd), reduced to distinct storages, minus the storages
that existed before the engine was built and those the test holds itself. Activations saved for
backward are found with ``torch.autograd.graph.saved_tensors_hooks`` so a forward-phase check
can set them apart from model states.

[Note: collective buffers outlive wait()]
A finished collective's tensors can stay alive for a moment after ``work.wait()`` returns, even
when nothing of ours refers to them any more: the process group's worker thread marks the work
complete (which releases ``wait()``) and only then drops its own reference to the work, whose
tensors go with it (gloo; NCCL's watchdog holds finished work similarly). Measured with gloo on
2 ranks, after ``all_gather_into_tensor(...).wait()`` and deleting the work and both tensors,
the output tensor was still alive in 115 and 136 of 300 tries, and gone in all of them 10 ms
later. The garbage collector then finds stage 3's all-gather send/recv buffers, the 32/64-byte
headers of its agreement check or a stage-1/2 reduce bucket, which no breakdown should report
(the engine does not hold them). :func:`measure_until_equal` therefore compares again after
short pauses: these storages go within milliseconds, memory really kept alive stays and still
fails the comparison.

[Note: the baseline freezes what it saw]
Every measurement walks the garbage collector's objects, and a test process holds hundreds of
thousands of them before any engine exists (torch, its test modules; ~350,000 with transformers
imported, ~0.5 s of CPU per walk, two dozen walks per rank in a memory test). None of those can
be a tensor the measurement counts: every tensor alive at the baseline is held by it, and its
storage is in the baseline's keys, which are left out. So :class:`StorageBaseline` moves every
object alive at that moment to the collector's permanent generation (``gc.freeze()``), which
``gc.collect()`` and ``gc.get_objects()`` skip: a measurement walks only what was created after
the baseline, and finds the same storages a full walk would. The freeze is process-wide and
belongs to the newest baseline: a measurement against any other baseline (or none) unfreezes
first and walks everything; ``release()`` unfreezes too.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


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


#: the baseline whose objects ``gc.freeze()`` set aside (See [Note: the baseline freezes what it saw])
_frozen_by: StorageBaseline | None = None


def _unfreeze() -> None:
    global _frozen_by
    gc.unfreeze()
    _frozen_by = None


class StorageBaseline:
    """The storages alive now, kept alive so that a later allocation cannot reuse their
    addresses (a freed address reused by a new storage would be mistaken for an old one).
    Freezes the objects alive now: See [Note: the baseline freezes what it saw]."""

    def __init__(self) -> None:
        global _frozen_by
        _unfreeze()
        self._held = _live_tensors()
        self.keys = {k for t in self._held if (k := _key(t)) is not None}
        gc.freeze()
        _frozen_by = self

    def release(self) -> None:
        if _frozen_by is self:
            _unfreeze()
        self._held = []


def live_storages(
    exclude: Iterable[torch.Tensor] = (), baseline: StorageBaseline | None = None
) -> dict[tuple[str, int], int]:
    """``{(device, data_ptr): nbytes}`` of every distinct storage behind a live tensor object,
    leaving out the storages of ``exclude`` and those alive at ``baseline``."""
    skip = {k for t in exclude if (k := _key(t)) is not None}
    if baseline is None or baseline is not _frozen_by:
        _unfreeze()  # objects frozen for another baseline may hold storages this one counts
    if baseline is not None:
        skip |= baseline.keys
    out: dict[tuple[str, int], int] = {}
    for obj in _live_tensors():
        key = _key(obj)
        if key is not None and key not in skip:
            out[key] = obj.untyped_storage().nbytes()
    return out


def measure_until_equal(
    measure: Callable[[], tuple[int, int, T]], timeout: float = 2.0, pause: float = 0.01
) -> tuple[int, int, T]:
    """Call ``measure() -> (live, reported, detail)`` until ``live == reported`` or ``timeout``
    seconds have passed; returns the last measurement. See [Note: collective buffers outlive
    wait()] for why a first mismatch is not yet a failure."""
    deadline = time.monotonic() + timeout
    while True:
        result = measure()
        if result[0] == result[1] or time.monotonic() > deadline:
            return result
        time.sleep(pause)


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
