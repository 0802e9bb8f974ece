"""One sequential pass over a tensor file: its bytes go into place and into its checksum together.

[Note: single-pass load]
An engine load used to checksum every rank tensor file completely and only then copy the
ranges it needs out of the page cache: on a cold load (files not cached) that is the disk
time plus the copy time, in series. Now a load makes one pass per tensor file it touches:

* The strategy's loader runs first in planning mode (``CheckpointReader.begin_single_pass``):
  every ``read_into`` whose destination is a contiguous CPU tensor of the stored dtype (the
  live weights, masters and optimizer states, see [Note: loading into the live state] in
  ``inplace.py``) is recorded as a request ``(file offset, destination bytes)`` instead of
  being read.
* ``CheckpointReader.finish_single_pass`` then reads each touched file sequentially from its
  first byte to its last (:func:`read_file_once`): a requested range is read with ``preadv``
  straight into its destination, every other byte (headers, ranges this rank does not own,
  e.g. the parts of another rank's file a resharded load skips) into a reused scratch
  buffer, and every byte is folded into the file's incremental checksum as it is read
  (``FileChecksum`` in ``integrity.py``; ``sum64`` and CRC32 give the whole-file value for
  any split). So each file this rank touches is fully verified, and the disk, the copy into
  place and the checksum all work on the same 256 KiB piece while the kernel reads ahead.
* Reads that cannot wait (values a loader uses at once: per-parameter scalars, dtype
  conversions, offloaded states handed to their store) are read immediately from the
  unverified file; that file is still checksummed in the pass, before the load returns.
* Ranks visit their files starting at their own (rank ``i`` of ``M`` at file ``i * N // M``)
  so that the other ranks' files they touch are usually already in the page cache: the
  disk is read once.

What this changes in the safety contract: the JSON metadata and the size of every rank file
are still checked before anything is touched, but a corrupted tensor file is detected only
after some of its bytes were copied into the live state. ``finish_single_pass`` all-reduces
the lowest bad file over the load's group, so every rank raises an error naming it, and
``loader.load_checkpoint`` marks the engine's state invalid: forward, backward, step and
save_checkpoint then refuse to run (naming the load that failed and why) until a later load
succeeds. Training therefore never continues on a mix of old and loaded state, and the
checkpoint on disk is never written. Readers used outside an engine load (``inspect``, the
inference loaders) keep verifying each file before reading it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from zero_core import comm
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.integrity import FileChecksum, Readahead

# Bytes per read: the piece stays in the CPU's L2 cache (2 MiB per core here) between the copy into
# place and the checksum. One thread, 256 MiB file in the page cache, into place and checksummed:
# 128 KiB 3.63, 256 KiB 3.55, 512 KiB 3.45, 1 MiB 3.21, 4 MiB 2.94 GB/s (median of 7, load average 2.5).
_PIECE = 2**18


def _pread_full(fd: int, dest: memoryview, offset: int, path: str) -> None:
    while len(dest):
        k = os.preadv(fd, [dest], offset)
        if k <= 0:
            raise CheckpointError(
                f"checkpoint file {path} ended at byte {offset} while being read (truncated while loading?)"
            )
        dest = dest[k:]
        offset += k


def read_file_once(
    path: str, record: dict[str, int | str], requests: Iterable[tuple[int, memoryview]]
) -> None:
    """Read the file at ``path`` once, front to back, filling each request and verifying it against ``record``.

    ``requests`` are ``(offset, destination)`` pairs: the bytes at ``[offset, offset + len(destination))``
    of the file go into ``destination`` (a writable byte memoryview). Ranges may overlap. Raises
    :class:`CheckpointError` naming the file if its size or checksum differ from ``record``
    (the destinations may then hold some of its bytes). See [Note: single-pass load].
    """
    checksum = FileChecksum(path, record)
    reqs = sorted(((int(off), memoryview(dest).cast("B")) for off, dest in requests), key=lambda r: r[0])
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != record.get("bytes"):
            checksum.nbytes = size
            checksum.check()  # raises the size error
        ahead = Readahead(fd, size)
        scratch = memoryview(bytearray(_PIECE))
        pos = 0

        def stream(dest: memoryview) -> None:
            nonlocal pos
            for lo in range(0, len(dest), _PIECE):
                piece = dest[lo : lo + _PIECE]
                ahead.advance(pos)
                _pread_full(fd, piece, pos, path)
                checksum.update(piece)
                pos += len(piece)

        def skip_to(target: int) -> None:
            while pos < target:
                stream(scratch[: min(_PIECE, target - pos)])

        for off, dest in reqs:
            end = off + len(dest)
            if off < 0 or end > size:
                raise CheckpointError(
                    f"checkpoint file {path}: bytes [{off}, {end}) requested, the file has {size} bytes"
                )
            skip_to(off)
            if off < pos:  # overlaps bytes already read and checksummed: read that part again
                done = min(end, pos) - off
                _pread_full(fd, dest[:done], off, path)
                dest = dest[done:]
            stream(dest)
        skip_to(size)
    finally:
        os.close(fd)
    checksum.check()


def read_files_once(
    tag_dir: str,
    tables: list[dict[str, Any]],
    plan: dict[int, list[tuple[int, memoryview]]],
    verified: set[int],
    group: Any = None,
) -> None:
    """Run :func:`read_file_once` on every rank file of ``plan`` not in ``verified``; collective over ``group``.

    Files are visited from this rank's own (``rank * N // M``) onwards, so the other ranks'
    files are usually in the page cache by the time it reads them. Each file that passes is
    added to ``verified`` and its requests are cleared. The lowest-numbered bad file is
    all-reduced: every rank raises a :class:`CheckpointError` naming it (the rank that read it
    with the details). See [Note: single-pass load].
    """
    on = comm.is_initialized() and comm.get_world_size(group) > 1
    rank, world = (comm.get_rank(group), comm.get_world_size(group)) if on else (0, 1)
    n = len(tables)
    first = rank * n // world
    bad, error = n, None
    for r in sorted((r for r in plan if r not in verified), key=lambda r: (r - first) % n):
        table = tables[r]
        try:
            read_file_once(os.path.join(tag_dir, table["file"]), table["file_record"], plan[r])
        except CheckpointError as e:
            bad, error = r, e  # stop: this rank's state is invalid anyway
            break
        verified.add(r)
        plan[r] = []
    mine = bad
    if on:
        flag = torch.tensor([bad], dtype=torch.int64)
        comm.all_reduce(flag, op=comm.ReduceOp.MIN, group=group)
        bad = int(flag.item())
    if bad < n:
        if error is not None and bad == mine:
            raise error
        path = os.path.join(tag_dir, tables[bad]["file"])
        raise CheckpointError(
            f"checkpoint file {path} failed verification on another rank (truncated, corrupted or modified; "
            "that rank raised the details)"
        )
