"""CRC-32C of what goes to a swap file, checked when it comes back.

[Note: swap checksums]
A swap file is the only copy of what it holds (optimizer states, fp32 masters, parameter
shards): bytes changed on disk (a cleanup job, another process writing into the folder, a bad
disk or file system) used to be trained on silently, random bytes in an optimizer state ending
in non-finite weights steps later. So every region written to a swap file (a tile of one
optimizer state, a parameter shard) is checksummed from the buffer it is written from, and the
region read back is checksummed before anything uses it; a mismatch is a ``SwapFileError``
naming the file, the byte range and both checksums. The checksum is the checkpoints' CRC-32C,
here per 4 MiB piece (every error of up to 3 bits in a piece is detected, see [Note: checkpoint
checksum]), computed on the CPU from the page-locked buffers the transfers use, the pieces of a
region on a few helper threads (the CRC releases the GIL); the records (4 bytes per 4 MiB) stay in memory for the life of the swap
files. Regions start zero-filled (``fallocate``) are recorded as zeros without being read. The
optimizer's tile pipeline checksums a written tile on a helper thread while its write is in
flight and the next tile is verified and updated (the buffer is not reused before both are
done), so only the check of what is read stands between a read and its use.

Cost, measured by ``tools/bench/bench_swap_checksum.py`` (results in
``tools/bench/results/bench_swap_checksum.md``): CPU work of one CRC pass over every byte read
and one over every byte written (4-15 GB/s per thread here, SSE4.2), which hides behind a
disk-bound swap only where cores are spare. On the development machine (2 shared cores, a
virtual disk moving 2 GB/s) it made an optimizer swap pass 16-24% slower; done inline on one
thread it was 40-90%. ``ZERO_SWAP_CHECKSUMS=0`` turns the checks off.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
from typing import Any

import crc32c as _crc32c
import torch

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


PIECE = 4 * 2**20  # bytes per CRC-32C (well within its HD-4 length: see [Note: checkpoint checksum])
_THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: list[tuple[int, concurrent.futures.ThreadPoolExecutor]] = []  # [(pid that made it, pool)]


def _bytes_of(data: torch.Tensor) -> memoryview:
    flat = data.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("swap checksums: expected a contiguous CPU tensor")
    nbytes = flat.numel() * flat.element_size()
    if not nbytes:
        return memoryview(b"")
    # The bytes in place, read through their address: ``Tensor.numpy()`` would mark the storage
    # as not resizable for good (the masters on NVMe resize theirs to zero).
    return memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")


def crc32c_of(data: torch.Tensor) -> list[int]:
    """CRC-32C per ``PIECE`` bytes of a contiguous CPU tensor's bytes (``[0]`` when empty)."""
    view = _bytes_of(data)
    return [_crc32c.crc32c(view[i : i + PIECE]) for i in range(0, len(view), PIECE)] or [0]


def _crc_pieces(data: torch.Tensor) -> list[concurrent.futures.Future]:
    """:func:`crc32c_of`, its pieces on a small thread pool (the CRC releases the GIL): futures
    in piece order. ``data`` must stay alive and unchanged until they are done."""
    if not _pool or _pool[0][0] != os.getpid():  # a forked child inherits the pool, not its threads
        _pool[:] = [
            (os.getpid(), concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="zero-swap-crc"))
        ]
    pool = _pool[0][1]
    view = _bytes_of(data)
    if not len(view):
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(0)
        return [done]
    return [pool.submit(_crc32c.crc32c, view[i : i + PIECE]) for i in range(0, len(view), PIECE)]


class SwapChecksums:
    """Checksums of the regions written to the files of one swap directory (see the Note)."""

    def __init__(self, swap_dir: Any) -> None:
        self.dir = swap_dir
        self.on = enabled()
        self._regions: dict[tuple[str, int], tuple[int, list[int]]] = {}
        self._zeros: dict[int, list[int]] = {}
        # (bytes, CRC futures, the buffer they read: kept alive until drained)
        self._pending: dict[tuple[str, int], tuple[int, list[concurrent.futures.Future], torch.Tensor]] = {}

    def record(self, name: str, offset: int, data: torch.Tensor) -> None:
        """``data`` is (being) written to swap file ``name`` at byte ``offset``."""
        if self.on:
            self._pending.pop((name, offset), None)
            self._regions[(name, offset)] = (data.numel() * data.element_size(), self._crc(data))

    def record_async(self, name: str, offset: int, data: torch.Tensor) -> None:
        """:meth:`record` on helper threads, overlapped with the caller's next work: ``data``
        must stay unchanged until :meth:`drain` (the swapper drains before reusing a buffer)."""
        if self.on:
            self._pending[(name, offset)] = (data.numel() * data.element_size(), _crc_pieces(data), data)

    def drain(self) -> None:
        """Wait for every :meth:`record_async` (its buffer may then be reused)."""
        pending, self._pending = self._pending, {}
        for key, (nbytes, pieces, _) in pending.items():
            self._regions[key] = (nbytes, [f.result() for f in pieces])

    @staticmethod
    def _crc(data: torch.Tensor) -> list[int]:
        """The CRCs of ``data``'s pieces, the pieces checksummed in parallel when there are several."""
        if data.numel() * data.element_size() <= PIECE:
            return crc32c_of(data)
        return [f.result() for f in _crc_pieces(data)]

    def record_zeros(self, name: str, offset: int, nbytes: int) -> None:
        """The region of ``nbytes`` at ``offset`` holds zeros (a preallocated file, never written)."""
        if not self.on:
            return
        if nbytes not in self._zeros:
            self._zeros[nbytes] = self._crc(torch.zeros(nbytes, dtype=torch.uint8))
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
        got = self._crc(data)
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
        """Finish pending work."""
        self.drain()
