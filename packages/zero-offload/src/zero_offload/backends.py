"""``NvmeOffloadBackend``: the ``OffloadBackend`` protocol (zero_core.protocols.offload) over NVMe files.

[Note: NVMe offload backend]
The one NVMe tensor store of the family: zero-offload's swappers and ZeRO-Inference's
``offload_param: {device: nvme}`` (each layer's weight partition in a file, read back just
before the layer runs) both use it. One swap file per key under the rank's swap directory
(see [Note: swap file lifecycle]: ``nvme_path/<job>/rank<rank>/``, so ranks sharing a path
never collide, removed at close, exit and SIGTERM), created with its final size on first
``swap_out``; transfers go through zero-ops' aio handle, so ``async_op=True`` overlaps them
with computation until ``wait()``. A ``swap_in`` into a tensor the handle cannot fill
directly (not a contiguous CPU tensor) reads into a staging buffer copied in ``wait()``.
Fork safety is zero-ops' business: see [Note: aio engines across fork] in zero_ops.aio.
CPU memory is zero-core's ``MemoryOffloadBackend``, re-exported here for symmetry.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from zero_core.offload_memory import MemoryOffloadBackend
from zero_ops.aio import AsyncIOHandle

from zero_offload.swap_checksums import SwapChecksums
from zero_offload.swap_files import AIO_HANDLE_KEYS, SwapDirectory, aio_handle_settings

__all__ = ["MemoryOffloadBackend", "NvmeOffloadBackend"]


class NvmeOffloadBackend:
    """Swap tensors to and from files under ``nvme_path/<job>/rank<rank>/``."""

    def __init__(
        self, nvme_path: str | os.PathLike, rank: int = 0, aio: dict[str, Any] | None = None
    ) -> None:
        self._dir = SwapDirectory(nvme_path, rank, what="NvmeOffloadBackend")
        kw = dict(aio or {})
        allowed = set(AIO_HANDLE_KEYS)
        unknown = set(kw) - allowed - {"intra_op_parallelism", "use_gds"}
        if unknown:
            raise ValueError(
                f"NvmeOffloadBackend: unknown aio settings {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        self._handle = AsyncIOHandle(**aio_handle_settings(kw))
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        # (staging buffer, destination) of reads into tensors the handle cannot fill directly
        self._pending_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._sums = SwapChecksums(self._dir)  # See [Note: swap checksums]
        self._pending_checks: list[tuple[str, torch.Tensor]] = []  # (file, tensor read into)
        self._closed = False

    @property
    def path(self) -> str:
        return str(self._dir.path)

    def _check(self, key: Any, where: str) -> str:
        if self._closed:
            raise RuntimeError(f"NvmeOffloadBackend.{where}: the backend is closed")
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(
                f"NvmeOffloadBackend.{where}: key must be a non-empty str without '/', got {key!r}"
            )
        return f"{key}.swp"

    def swap_out(self, key: str, tensor: torch.Tensor, *, async_op: bool = False) -> None:
        """Write ``tensor``'s values to ``key``'s file (do not modify ``tensor`` before ``wait()`` if async)."""
        name = self._check(key, "swap_out")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"NvmeOffloadBackend.swap_out: tensor must be a torch.Tensor, got {type(tensor).__name__}"
            )
        src = tensor.detach()
        if src.device.type != "cpu" or not src.is_contiguous():
            src = src.to("cpu").contiguous()
        nbytes = src.numel() * src.element_size()
        meta = (tuple(src.shape), src.dtype)
        if self._meta.get(key) != meta:
            self._handle.wait()
            self._dir.allocate(name, nbytes)
            self._meta[key] = meta
        self._sums.record(name, 0, src)
        self._handle.async_pwrite(src, self._dir.check(name), 0)
        if not async_op:
            self._handle.wait()

    def swap_in(self, key: str, out: torch.Tensor, *, async_op: bool = False) -> None:
        """Read ``key``'s values into ``out`` (same shape and dtype; complete after ``wait()`` if async)."""
        name = self._check(key, "swap_in")
        if key not in self._meta:
            raise KeyError(f"NvmeOffloadBackend.swap_in: nothing is stored under key {key!r}")
        shape, dtype = self._meta[key]
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(
                f"NvmeOffloadBackend.swap_in: key {key!r} holds {shape} {dtype}, but out is {tuple(out.shape)} {out.dtype}"
            )
        if out.device.type == "cpu" and out.is_contiguous():
            self._handle.async_pread(out, self._dir.check(name), 0)
            self._pending_checks.append((name, out))
        else:
            staging = torch.empty(shape, dtype=dtype)
            self._handle.async_pread(staging, self._dir.check(name), 0)
            self._pending_checks.append((name, staging))
            self._pending_copies.append((staging, out))
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Complete every outstanding read and write (reads verified: See [Note: swap checksums])."""
        self._handle.wait()
        checks, self._pending_checks = self._pending_checks, []
        for name, read in checks:
            self._sums.verify(name, 0, read)
        with torch.no_grad():
            for staging, out in self._pending_copies:
                out.copy_(staging)
        self._pending_copies.clear()

    def remove(self, key: str) -> None:
        name = self._check(key, "remove")
        self.wait()
        if self._meta.pop(key, None) is not None:
            path, _ = self._dir.files.pop(name)
            path.unlink(missing_ok=True)
            self._sums.forget(name)

    def contains(self, key: str) -> bool:
        return key in self._meta

    def close(self) -> None:
        if self._closed:
            return
        self.wait()
        self._closed = True
        self._dir.close()
