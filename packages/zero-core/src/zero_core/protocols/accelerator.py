"""The ``Accelerator`` protocol: the device abstraction every package codes against.

Engine, partitioner, offload and ops never call ``torch.cuda`` directly: they ask
``zero_core.accelerator.get_accelerator()`` for the device, streams, events, memory counters,
pinned memory and RNG, so the same code runs on CPU (gloo, tests, this CI) and on CUDA (nccl).

[Note: CPU accelerator semantics]
On CPU there is one device and all work is synchronous, so streams and events are objects
that keep the *contract* of their CUDA counterparts without doing anything asynchronous: an
``Event`` can be recorded, ``query()`` is True once recorded work is done (always, on CPU),
``synchronize()`` returns, and ``elapsed_time`` measures wall-clock time between two timed
records. Memory counters report the process resident set size (RSS) because the CPU has no
caching allocator whose counters could be read; see ``CpuAccelerator.memory_stats``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Stream(Protocol):
    """An ordered queue of device work (``torch.cuda.Stream`` on CUDA)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def wait_stream(self, stream: Stream) -> None: ...

    def wait_event(self, event: Event) -> None: ...

    def record_event(self, event: Event | None = None) -> Event: ...


@runtime_checkable
class Event(Protocol):
    """A marker in a stream (``torch.cuda.Event`` on CUDA)."""

    def record(self, stream: Stream | None = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def wait(self, stream: Stream | None = None) -> None: ...

    def elapsed_time(self, end_event: Event) -> float: ...


@runtime_checkable
class Accelerator(Protocol):
    """Device, streams/events, memory, pinned memory and RNG of one accelerator kind.

    ``Stream`` and ``Event`` are the classes (constructors) of this accelerator's stream and
    event types: ``acc.Stream()``, ``acc.Event(enable_timing=True)``.
    """

    #: ``"cpu"`` or ``"cuda"``: the ``torch.device`` type of this accelerator.
    device_type: str
    Stream: type
    Event: type

    # -- devices ---------------------------------------------------------------------------
    def is_available(self) -> bool: ...

    def device_name(self, index: int | None = None) -> str: ...

    def device(self, index: int | None = None) -> torch.device: ...

    def current_device(self) -> int: ...

    def current_device_name(self) -> str: ...

    def set_device(self, index: int) -> None: ...

    def device_count(self) -> int: ...

    def communication_backend_name(self) -> str: ...

    # -- streams and events --------------------------------------------------------------
    def stream(self, stream: Stream | None) -> AbstractContextManager[Stream | None]: ...

    def current_stream(self, index: int | None = None) -> Stream: ...

    def default_stream(self, index: int | None = None) -> Stream: ...

    def synchronize(self, index: int | None = None) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None: ...

    # -- memory --------------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int: ...

    def max_memory_allocated(self, index: int | None = None) -> int: ...

    def reset_peak_memory_stats(self, index: int | None = None) -> None: ...

    def memory_stats(self, index: int | None = None) -> dict[str, int]: ...

    def empty_cache(self) -> None: ...

    # -- pinned memory -------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def is_pinned(self, tensor: torch.Tensor) -> bool: ...

    # -- RNG -----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None: ...

    def manual_seed_all(self, seed: int) -> None: ...

    def get_rng_state(self, index: int | None = None) -> torch.Tensor: ...

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None: ...

    # -- dtypes --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool: ...

    def is_fp16_supported(self) -> bool: ...
