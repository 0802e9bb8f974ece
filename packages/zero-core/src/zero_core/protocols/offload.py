"""The ``OffloadBackend`` protocol: a keyed store that tensors are swapped out to and in from.

ZeRO-Offload/Infinity moves optimizer states and parameters out of device memory between
uses. The engine only needs a keyed store with optional asynchrony, so CPU memory
(``zero_core.offload_memory.MemoryOffloadBackend``) and NVMe files (zero-offload) are
interchangeable.

Contract:
* ``swap_out(key, tensor)`` stores the *current values* of ``tensor`` under ``key``
  (replacing an earlier value). With ``async_op=True`` the caller must not modify ``tensor``
  until ``wait()`` returns.
* ``swap_in(key, out)`` copies the stored values into ``out`` (same shape and dtype). With
  ``async_op=True`` the values are only guaranteed to be in ``out`` after ``wait()``.
* ``wait()`` completes every outstanding asynchronous swap of this backend.
* ``remove(key)`` drops a stored value; ``contains(key)`` tells whether one is stored.
* ``close()`` waits, frees everything, and makes further use an error.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class OffloadBackend(Protocol):
    def swap_out(self, key: str, tensor: torch.Tensor, *, async_op: bool = False) -> None: ...

    def swap_in(self, key: str, out: torch.Tensor, *, async_op: bool = False) -> None: ...

    def wait(self) -> None: ...

    def remove(self, key: str) -> None: ...

    def contains(self, key: str) -> bool: ...

    def close(self) -> None: ...
