"""``NvmeOffloadBackend``: an ``OffloadBackend`` storing tensors in files through zero-ops' async I/O.

[Note: NVMe offload backend]
ZeRO-Inference with ``offload_param: {device: nvme, nvme_path: DIR}`` keeps each layer's
weight partition in a file under ``DIR`` and reads it back just before the layer runs. This
class implements the ``zero_core.protocols.OffloadBackend`` contract (``swap_out``,
``swap_in``, ``wait``, ``remove``, ``contains``, ``close``) on ``zero_ops.aio.AsyncIOHandle``:
one file per key (``<DIR>/zero_inference_rank<R>/<n>.swp``, ``n`` a counter, so keys need no
escaping and ranks sharing ``DIR`` never collide). Asynchronous calls are submitted to the
handle and completed by ``wait()``; a ``swap_in`` into a tensor the handle cannot fill directly
(not a contiguous CPU tensor) goes through a staging buffer copied in ``wait()``. zero-offload,
when it provides an NVMe store, is the intended long-term home of this; the protocol makes the
two interchangeable.

Fork safety is zero-ops' business: see [Note: aio engines across fork] in zero_ops.aio.
``close()`` drops the handle in the process that created it.
"""

from __future__ import annotations

import os
import shutil

import torch
from zero_core.plugins import require


class NvmeOffloadBackend:
    """Swap tensors to and from files under ``path``. See [Note: NVMe offload backend]."""

    def __init__(self, path: str | os.PathLike, rank: int = 0) -> None:
        require("zero_ops", "ZeRO-Inference NVMe offload (offload_param.device=nvme)")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"NvmeOffloadBackend: path must be a str or os.PathLike, got {type(path).__name__}"
            )
        self.dir = os.path.join(os.fspath(path), f"zero_inference_rank{rank}")
        os.makedirs(self.dir, exist_ok=True)
        from zero_ops.aio import AsyncIOHandle

        self._handle = AsyncIOHandle()
        self._files: dict[str, tuple[str, torch.Size, torch.dtype]] = {}
        self._pending_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._counter = 0
        self._closed = False

    def _check(self, key: object, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeOffloadBackend.{where}: the backend is closed")
        if not isinstance(key, str) or not key:
            raise ValueError(f"NvmeOffloadBackend.{where}: key must be a non-empty str, got {key!r}")

    def swap_out(self, key: str, tensor: torch.Tensor, *, async_op: bool = False) -> None:
        """Write ``tensor``'s current values to ``key``'s file (replacing an earlier value)."""
        self._check(key, "swap_out")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"NvmeOffloadBackend.swap_out: tensor must be a torch.Tensor, got {type(tensor).__name__}"
            )
        src = tensor.detach()
        if src.device.type != "cpu" or not src.is_contiguous():
            src = src.to("cpu").contiguous()
        if key in self._files:
            path = self._files[key][0]
        else:
            path = os.path.join(self.dir, f"{self._counter}.swp")
            self._counter += 1
        self._files[key] = (path, tensor.shape, tensor.dtype)
        self._handle.async_pwrite(src, path)
        if not async_op:
            self._handle.wait()

    def swap_in(self, key: str, out: torch.Tensor, *, async_op: bool = False) -> None:
        """Read ``key``'s values into ``out`` (same shape and dtype)."""
        self._check(key, "swap_in")
        if key not in self._files:
            raise KeyError(f"NvmeOffloadBackend.swap_in: nothing is stored under key {key!r}")
        path, shape, dtype = self._files[key]
        if out.shape != shape or out.dtype != dtype:
            raise ValueError(
                f"NvmeOffloadBackend.swap_in: key {key!r} holds {tuple(shape)} {dtype}, "
                f"but out is {tuple(out.shape)} {out.dtype}"
            )
        if out.device.type == "cpu" and out.is_contiguous():
            self._handle.async_pread(out, path)
        else:
            staging = torch.empty(shape, dtype=dtype)
            self._handle.async_pread(staging, path)
            self._pending_copies.append((staging, out))
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Complete every outstanding read and write."""
        self._handle.wait()
        for staging, out in self._pending_copies:
            out.copy_(staging)
        self._pending_copies.clear()

    def remove(self, key: str) -> None:
        self._check(key, "remove")
        entry = self._files.pop(key, None)
        if entry is not None:
            self.wait()
            os.remove(entry[0])

    def contains(self, key: str) -> bool:
        return key in self._files

    def close(self) -> None:
        if self._closed:
            return
        self.wait()
        self._files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._closed = True
        self._handle = None  # its I/O threads stop here, in the process that started them
