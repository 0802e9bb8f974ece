"""One sequential pass over a tensor file: its bytes go into place and into its checksum together.

[Note: single-pass load]
An engine load used to checksum every rank tensor file completely and only then copy the
ranges it needs out of the page cache: on a cold load (files not cached) that is the disk
time plus the copy time, in series. Now a load makes one pass per tensor file:

* The strategy's loader runs first in planning mode (``CheckpointReader.begin_single_pass``):
  every ``read_into`` whose destination is a contiguous CPU tensor of the stored dtype (the
  live weights, masters and optimizer states, see [Note: loading into the live state] in
  ``inplace.py``) is recorded as a request ``(file offset, destination bytes)`` instead of
  being read.
* ``CheckpointReader.finish_single_pass`` then completes the requests (:func:`read_files_once`).
  Each tensor file has exactly one verifier among the M loading ranks: saved rank f's file is
  verified by loading rank ``f % M`` (:func:`verifier_of`), so at the saving world size each
  rank verifies its own file, with fewer ranks a rank verifies several, with more some verify
  none, and a load outside a process group (one process) verifies every file. The verifier
  reads the file sequentially from its first byte to its last (:func:`read_file_once`), whether
  or not it needs any of it: a requested range is read with ``preadv`` straight into its
  destination, every other byte (headers, ranges it does not own) into a reused scratch
  buffer, and every byte is folded into the file's incremental checksum as it is read
  (``FileChecksum`` in ``integrity.py``; the CRC-32C pieces give the whole-file value for
  any split). The disk, the copy into place and the checksum work on the same 256 KiB piece
  while the kernel reads ahead. Every other rank reads only the byte ranges it requested from
  that file, straight into place, with readahead on those ranges only and no checksum
  (:func:`read_ranges`).
* Why that is still a complete verification: every file is read whole and checksummed by its
  verifier on every load, and ``read_files_once`` ends with an all-reduce (MIN) of the lowest
  bad file over the load's group. A rank that copied unverified bytes of a bad file therefore
  raises too ("failed verification on another rank", naming the file), and the engine refuses
  to train (below). Only after that all-reduce reports no bad file does a rank count every file
  as verified. Why split the work: at stage 2 every rank loads the whole module and touches
  every file; when each rank checksummed every file it touched, each moved all the checkpoint's
  bytes through the CPU (including the other ranks' optimizer states, read only to be
  checksummed), and a cold load with two ranks on two cores was CPU-bound.
* Reads that cannot wait (values a loader uses at once: per-parameter scalars, dtype
  conversions, offloaded states handed to their store) are read immediately from the
  unverified file; that file is still checksummed by its verifier before the load returns.
* Ranks start with the files they verify (rank ``i`` of ``M`` from file ``i * N // M`` on),
  then read their ranges of the other files, which their verifiers are reading at the same
  time or have read: those ranges usually come from the page cache, so the disk is read once.

What this changes in the safety contract: the JSON metadata and the size of every rank file
are still checked by every rank before anything is touched, but a corrupted tensor file is
detected only after some of its bytes were copied into the live state. The all-reduce makes
every rank raise an error naming the bad file, and ``loader.load_checkpoint`` marks the
engine's state invalid: forward, backward, step and save_checkpoint then refuse to run (naming
the load that failed and why) until a later load succeeds. Training therefore never continues
on a mix of old and loaded state, and the checkpoint on disk is never written. Readers used
outside an engine load (``inspect``, the inference loaders) keep verifying each file before
reading it.
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
# Ranges read without checksum (read_ranges) go straight into place: no cache reason to keep pieces small.
_RANGE_PIECE = 4 * 2**20


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
        ahead = Readahead.whole_file(fd, size)
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


def verifier_of(file_rank: int, world: int) -> int:
    """The loading rank that reads and checksums saved rank ``file_rank``'s tensor file whole.

    ``file_rank % world``: at the saving world size each rank verifies its own file; with fewer
    loading ranks a rank verifies several files, with more some ranks verify none. Every file
    has exactly one verifier. See [Note: single-pass load].
    """
    if isinstance(file_rank, bool) or not isinstance(file_rank, int) or file_rank < 0:
        raise ValueError(f"verifier_of: file_rank must be an int >= 0, got {file_rank!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"verifier_of: world must be an int >= 1, got {world!r}")
    return file_rank % world


def files_verified_by(rank: int, n_files: int, world: int) -> list[int]:
    """The saved ranks whose tensor files loading rank ``rank`` of ``world`` verifies (see :func:`verifier_of`)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"files_verified_by: world must be an int >= 1, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"files_verified_by: rank must be an int in [0, {world}), got {rank!r}")
    if isinstance(n_files, bool) or not isinstance(n_files, int) or n_files < 0:
        raise ValueError(f"files_verified_by: n_files must be an int >= 0, got {n_files!r}")
    return list(range(rank, n_files, world))


def read_ranges(path: str, record: dict[str, int | str], requests: Iterable[tuple[int, memoryview]]) -> None:
    """Fill each ``(offset, destination)`` request straight from the file at ``path``, reading nothing else.

    No checksum: a rank calls this for a file another loading rank verifies whole (see
    :func:`verifier_of` and [Note: single-pass load]). The file's size is checked against
    ``record``; raises :class:`CheckpointError` naming the file if it differs, if a request lies
    outside it, or if it ends early while being read.
    """
    reqs = sorted(((int(off), memoryview(dest).cast("B")) for off, dest in requests), key=lambda r: r[0])
    spans: list[tuple[int, int]] = []
    for off, dest in reqs:
        end = off + len(dest)
        if spans and off <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        elif len(dest):
            spans.append((off, end))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != record.get("bytes"):
            raise CheckpointError(
                f"checkpoint file {path} has {size} bytes, the checkpoint recorded {record.get('bytes')}: "
                "it is truncated or was modified"
            )
        ahead = Readahead(fd, spans)
        for off, dest in reqs:
            if off < 0 or off + len(dest) > size:
                raise CheckpointError(
                    f"checkpoint file {path}: bytes [{off}, {off + len(dest)}) requested, the file has {size} bytes"
                )
            for lo in range(0, len(dest), _RANGE_PIECE):
                ahead.advance(off + lo)
                _pread_full(fd, dest[lo : lo + _RANGE_PIECE], off + lo, path)
    finally:
        os.close(fd)


def read_files_once(
    tag_dir: str,
    tables: list[dict[str, Any]],
    plan: dict[int, list[tuple[int, memoryview]]],
    verified: set[int],
    group: Any = None,
) -> None:
    """Complete the single pass of one load over ``group`` (collective): verify this rank's files, fill ``plan``.

    This rank reads every rank file it verifies (:func:`files_verified_by`) whole with
    :func:`read_file_once`, touched or not, then only the requested ranges of the other files
    of ``plan`` (:func:`read_ranges`). Files already in ``verified`` are skipped (a second call
    of the same load). The lowest-numbered bad file is all-reduced: every rank raises a
    :class:`CheckpointError` naming it (the rank that found it with the details). On success
    every file has been verified by its verifier, so all are added to ``verified`` and the
    requests are cleared. See [Note: single-pass load].
    """
    on = comm.is_initialized() and comm.get_world_size(group) > 1
    rank, world = (comm.get_rank(group), comm.get_world_size(group)) if on else (0, 1)
    n = len(tables)
    first = rank * n // world

    def visit_order(r: int) -> int:  # own files first (see [Note: single-pass load])
        return (r - first) % n

    mine = sorted((r for r in files_verified_by(rank, n, world) if r not in verified), key=visit_order)
    others = sorted(
        (r for r in plan if r not in verified and verifier_of(r, world) != rank and plan[r]), key=visit_order
    )
    bad, error = n, None
    for r in mine + others:
        table = tables[r]
        path = os.path.join(tag_dir, table["file"])
        try:
            if r in mine:
                read_file_once(path, table["file_record"], plan.get(r, []))
            else:
                read_ranges(path, table["file_record"], plan[r])
        except CheckpointError as e:
            bad, error = r, e  # stop: this rank's state is invalid anyway
            break
        if r in plan:
            plan[r] = []
    here = bad
    if on:
        flag = torch.tensor([bad], dtype=torch.int64)
        comm.all_reduce(flag, op=comm.ReduceOp.MIN, group=group)
        bad = int(flag.item())
    if bad < n:
        if error is not None and bad == here:
            raise error
        path = os.path.join(tag_dir, tables[bad]["file"])
        raise CheckpointError(
            f"checkpoint file {path} failed verification on another rank (truncated, corrupted or modified; "
            "that rank raised the details)"
        )
    verified.update(range(n))  # each file passed on its verifier
    for r in plan:
        plan[r] = []
