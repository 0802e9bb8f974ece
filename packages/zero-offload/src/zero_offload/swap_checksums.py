"""CRC-32C of what goes to a swap file, checked when it comes back.

[Note: swap checksums]
A swap file is the only copy of what it holds (optimizer states, fp32 masters, parameter
shards): bytes changed on disk (a cleanup job, another process writing into the folder, a bad
disk or file system) used to be trained on silently, random bytes in an optimizer state ending
in non-finite weights steps later. So every region written to a swap file (a tile of one
optimizer state, a parameter shard) is checksummed from the buffer it is written from, and the
region read back is checksummed before anything uses it; a mismatch is a ``SwapFileError``
naming the file, the byte range and both checksums. The checksum is the checkpoints' CRC-32C
per 64 MiB piece (``zero_core.checkpoint.integrity.Crc32cChunks``: every error of up to 3 bits
is detected, see [Note: checkpoint checksum]), computed on the CPU from the page-locked buffers
the transfers use; the records (4 bytes per 64 MiB) stay in memory for the life of the swap
files. Regions start zero-filled (``fallocate``) are recorded as zeros without being read. The
optimizer's tile pipeline checksums a written tile on a helper thread while its write is in
flight and the next tile is verified and updated (the buffer is not reused before both are
done), so only the check of what is read stands between a read and its use.

Cost, measured by ``tools/bench/bench_swap_checksum.py`` (results in
``tools/bench/results/bench_swap_checksum.md``): the check is CPU work of about one pass over
the bytes swapped at the CRC's speed (several GB/s with the SSE4.2 instruction), against a swap
path bound by the disk; ``ZERO_SWAP_CHECKSUMS=0`` turns it off (for that comparison).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
from typing import Any

import torch
from zero_core.checkpoint.integrity import Crc32cChunks

from zero_offload.swap_files import SwapFileError

ENV_SWITCH = "ZERO_SWAP_CHECKSUMS"


def enabled() -> bool:
    """Whether swapped regions are checksummed (``ZERO_SWAP_CHECKSUMS``, default on)."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_SWITCH} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def crc32c_of(data: torch.Tensor) -> list[int]:
    """CRC-32C per 64 MiB piece of a contiguous CPU tensor's bytes."""
    flat = data.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("swap checksums: expected a contiguous CPU tensor")
    sums = Crc32cChunks()
    nbytes = flat.numel() * flat.element_size()
    if nbytes:
        # The bytes in place, read through their address: ``Tensor.numpy()`` would mark the
        # storage as not resizable for good (the masters on NVMe resize theirs to zero).
        sums.update(memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B"))
    return sums.digest()


class SwapChecksums:
    """Checksums of the regions written to the files of one swap directory (see the Note)."""

    def __init__(self, swap_dir: Any) -> None:
        self.dir = swap_dir
        self.on = enabled()
        self._regions: dict[tuple[str, int], tuple[int, list[int]]] = {}
        self._zeros: dict[int, list[int]] = {}
        self._pending: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    def record(self, name: str, offset: int, data: torch.Tensor) -> None:
        """``data`` is (being) written to swap file ``name`` at byte ``offset``."""
        if self.on:
            self._pending.pop((name, offset), None)
            self._regions[(name, offset)] = (data.numel() * data.element_size(), crc32c_of(data))

    def record_async(self, name: str, offset: int, data: torch.Tensor) -> None:
        """:meth:`record` on a helper thread, overlapped with the caller's next work: ``data``
        must stay unchanged until :meth:`drain` (the swapper drains before reusing a buffer)."""
        if not self.on:
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zero-swap-crc")
        nbytes = data.numel() * data.element_size()
        self._pending[(name, offset)] = self._worker.submit(lambda: (nbytes, crc32c_of(data)))

    def drain(self) -> None:
        """Wait for every :meth:`record_async` (its buffer may then be reused)."""
        pending, self._pending = self._pending, {}
        for key, future in pending.items():
            self._regions[key] = future.result()

    def record_zeros(self, name: str, offset: int, nbytes: int) -> None:
        """The region of ``nbytes`` at ``offset`` holds zeros (a preallocated file, never written)."""
        if not self.on:
            return
        if nbytes not in self._zeros:
            self._zeros[nbytes] = crc32c_of(torch.zeros(nbytes, dtype=torch.uint8))
        self._regions[(name, offset)] = (nbytes, self._zeros[nbytes])

    def verify(self, name: str, offset: int, data: torch.Tensor) -> None:
        """Raise ``SwapFileError`` unless ``data`` (read back from ``name`` at ``offset``) is what was written."""
        if (name, offset) in self._pending:
            self.drain()
        region = self._regions.get((name, offset)) if self.on else None
        if region is None:
            return
        nbytes, want = region
        got_bytes = data.numel() * data.element_size()
        if got_bytes != nbytes:
            raise ValueError(
                f"swap checksums: region at byte {offset} of {name} was written with {nbytes} bytes, read with {got_bytes}"
            )
        got = crc32c_of(data)
        if got != want:
            path = self.dir.path / name
            bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise SwapFileError(
                errno.EIO,
                f"{self.dir.what}: swap file {path}: bytes [{offset}, {offset + nbytes}) read back differ from "
                f"what was written (CRC-32C of piece {bad}: {got[bad]:#010x}, written {want[bad]:#010x}); the "
                "file was changed on disk or the disk corrupted it. Its data is lost: restart from the last "
                "checkpoint",
            )

    def forget(self, name: str) -> None:
        """Drop the records of swap file ``name`` (removed or reallocated)."""
        self.drain()
        for key in [k for k in self._regions if k[0] == name]:
            del self._regions[key]

    def close(self) -> None:
        """Finish pending work and stop the helper thread."""
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
