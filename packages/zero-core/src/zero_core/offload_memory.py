"""``MemoryOffloadBackend``: an ``OffloadBackend`` that keeps swapped-out tensors in CPU memory.

The simplest correct store: the reference for the protocol's contract (see
``zero_core.protocols.offload``), the backend of CPU-offload tests, and the fallback when no
NVMe store is configured. Copies happen at call time, so asynchronous calls are already
complete when they return and ``wait()`` has nothing to do; the contract (do not touch the
tensors before ``wait()``) still holds for callers, which keeps them portable to the NVMe
backend of zero-offload.
"""

from __future__ import annotations

import torch


def _check_key(key: object, where: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"MemoryOffloadBackend.{where}: key must be a non-empty str, got {key!r}")


def _check_tensor(tensor: object, name: str, where: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"MemoryOffloadBackend.{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )


class MemoryOffloadBackend:
    """Swap tensors to and from a dict of CPU tensors.

    ``pin_memory=True`` pins the stored copies (through the accelerator, so only when CUDA is
    present) to make device<->host copies asynchronous-capable.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self._store: dict[str, torch.Tensor] = {}
        self._pin = bool(pin_memory)
        self._closed = False

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"MemoryOffloadBackend.{where}: the backend is closed")

    def swap_out(self, key: str, tensor: torch.Tensor, *, async_op: bool = False) -> None:
        """Store a CPU copy of ``tensor``'s current values under ``key`` (replacing any earlier one)."""
        self._check_open("swap_out")
        _check_key(key, "swap_out")
        _check_tensor(tensor, "tensor", "swap_out")
        stored = self._store.get(key)
        if stored is not None and stored.shape == tensor.shape and stored.dtype == tensor.dtype:
            stored.copy_(tensor.detach())  # reuse the buffer: steady-state swapping allocates nothing
            return
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if self._pin:
            from zero_core.accelerator import get_accelerator

            copy = get_accelerator().pin_memory(copy)
        copy.copy_(tensor.detach())
        self._store[key] = copy

    def swap_in(self, key: str, out: torch.Tensor, *, async_op: bool = False) -> None:
        """Copy the values stored under ``key`` into ``out`` (same shape and dtype)."""
        self._check_open("swap_in")
        _check_key(key, "swap_in")
        _check_tensor(out, "out", "swap_in")
        stored = self._store.get(key)
        if stored is None:
            raise KeyError(f"MemoryOffloadBackend.swap_in: nothing is stored under key {key!r}")
        if stored.shape != out.shape or stored.dtype != out.dtype:
            raise ValueError(
                f"MemoryOffloadBackend.swap_in: key {key!r} holds {tuple(stored.shape)} {stored.dtype}, "
                f"but out is {tuple(out.shape)} {out.dtype}"
            )
        with torch.no_grad():
            out.copy_(stored)

    def wait(self) -> None:
        """Complete outstanding swaps (none: every copy finishes at call time)."""
        self._check_open("wait")

    def remove(self, key: str) -> None:
        """Free the value stored under ``key``."""
        self._check_open("remove")
        _check_key(key, "remove")
        if self._store.pop(key, None) is None:
            raise KeyError(f"MemoryOffloadBackend.remove: nothing is stored under key {key!r}")

    def contains(self, key: str) -> bool:
        self._check_open("contains")
        _check_key(key, "contains")
        return key in self._store

    def nbytes(self) -> int:
        """Bytes held in the store."""
        return sum(t.numel() * t.element_size() for t in self._store.values())

    def close(self) -> None:
        """Free everything; further calls raise. Closing twice is allowed."""
        self._store.clear()
        self._closed = True
