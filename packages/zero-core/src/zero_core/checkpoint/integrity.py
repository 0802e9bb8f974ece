"""Per-file checksums: computed while writing, verified before a file is trusted on load.

Every file of a checkpoint is recorded as ``{"bytes": n, "crc32c": [c_0, c_1, ...],
"crc32c_chunk": 67108864}``: the CRC-32C of each 64 MiB piece of the file (see
[Note: checkpoint checksum]). Files of older checkpoints carry ``sum64`` (format 2, rank
tensor files) or ``crc32`` (format 1, and the JSON files of format 2); they still verify with
the checksum they were saved with (see the Note for what that does and does not catch).

[Note: checkpoint checksum]
What is required: every error of up to 3 bits anywhere in a file is detected, at disk speed.
* The hand-rolled ``sum64`` of format 2 (a Fletcher-style pair of 64-bit sums, kept below only
  to verify old checkpoints) fails that: two sign-bit flips in words of the same parity cancel
  in both sums, and a crafted 3-word change does too.
* A CRC with generator polynomial ``g`` detects every error pattern of weight ``w`` in a
  message shorter than the length up to which ``g`` has Hamming distance ``HD > w``.
  Koopman's CRC tables (Koopman, "32-Bit Cyclic Redundancy Codes for Internet Applications",
  DSN 2002, and his published CRC polynomial zoo) give, for data words of up to:
  CRC-32 (IEEE 802.3, ``zlib.crc32``): HD 4 up to 91,607 bits (11 KiB), HD 3 up to
  2^32 - 33 bits; CRC-32C (Castagnoli, iSCSI RFC 3720): HD 6 up to 5,243 bits, HD 4 up to
  2^31 - 33 bits (256 MiB), then HD 2 (a 2-bit error 2^31 - 1 bits apart is missed). So
  neither CRC alone covers a multi-GB tensor file, and ``zlib.crc32`` misses 3-bit errors in
  files over 11 KiB.
* Hence one CRC-32C per 64 MiB piece (``CRC_CHUNK``; 2^29 bits, within the HD-4 length):
  an error of up to 3 bits puts at most 3 bit errors into each piece it touches, and each
  touched piece's CRC detects them, so the file's list of CRCs differs. A burst of up to 32
  bits within a piece is detected too (any CRC-32). A hash from a library (xxHash's XXH3-64)
  was ~1.4x faster here but misses any error with probability 2^-64: no guarantee for any
  weight; the per-piece CRC list grows by 4 bytes of JSON per 64 MiB.
* Speed (``tools/bench/bench_checksum.py``, results in ``tools/bench/results/bench_checksum.md``;
  one core of a shared 2-core machine at load average 15, so ratios matter): CRC-32C (the
  ``crc32c`` package, SSE4.2 instruction) 2.5-3.4 GB/s in memory vs ``sum64`` 1.8-2.1 GB/s,
  ``zlib.crc32`` 0.8-1.0 GB/s, XXH3-64 4.4 GB/s; verifying a page-cached file 1.83x faster
  than with ``sum64`` and faster than ``dd`` reading it; a save with the checksum overlapped
  (see [Note: checksum overlapped with writing] in ``atomic.py``) at ``dd conv=fsync`` speed.
  The ``crc32c`` package falls back to a software CRC where the CPU lacks the instruction
  (``crc32c.hardware_based`` says which) and releases the GIL on large buffers, as the
  overlapped writer needs.
* CRC-32C's generator has the factor ``x + 1``, so every odd number of flipped bits is
  detected at any length; the piece size is what keeps 2-bit errors (missed only when
  ``2^31 - 1`` bits apart) inside the HD-4 length.
* Old checkpoints: files recorded with ``sum64`` or ``crc32`` still verify with that
  checksum (the guarantee above then does not hold; re-save to upgrade), since refusing them
  would strand every checkpoint saved before. A record with none of the three is an error.
The standalone ``zero_to_fp32.py`` carries its own copy of the verification (it needs the
``crc32c`` package too, and says so if it is missing).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import crc32c as _crc32c
import numpy as np

from zero_core.checkpoint.format import CheckpointError

CHECKSUM_ALGORITHM = "crc32c per 64 MiB piece (every file)"
CRC_CHUNK = (
    64 * 2**20
)  # bytes per CRC-32C: 2^29 bits, within its HD-4 length (see [Note: checkpoint checksum])
_MAX_CRC_CHUNK = 2**28  # the largest piece a record may name: 2^31 bits is CRC-32C's HD-4 limit
_CHUNK = 2**20  # bytes per read while verifying (see [Note: verification reads ahead])
_WINDOW = 32 * 2**20  # bytes queued for readahead beyond the read position
_MASK = 2**64 - 1
_WORDS = 2**17  # words per chunk: 1 MiB, stays in cache between the sum and the dot


def file_record(
    nbytes: int, crc32: int | None = None, sum64: str | None = None, crc32c: list[int] | None = None
) -> dict[str, Any]:
    """The integrity record of a file: its size and its checksum(s)."""
    if crc32 is None and sum64 is None and crc32c is None:
        raise ValueError("file_record needs a crc32c, crc32 or sum64")
    rec: dict[str, Any] = {"bytes": int(nbytes)}
    if crc32c is not None:
        rec["crc32c"] = [int(c) for c in crc32c]
        rec["crc32c_chunk"] = CRC_CHUNK
    if crc32 is not None:
        rec["crc32"] = int(crc32)
    if sum64 is not None:
        rec["sum64"] = sum64
    return rec


class Crc32cChunks:
    """CRC-32C of each ``chunk``-byte piece of a byte sequence fed in pieces of any size.

    See [Note: checkpoint checksum]. ``digest()`` is the list of the pieces' CRCs in file order
    (one CRC, of zero bytes, for an empty file).
    """

    def __init__(self, chunk: int = CRC_CHUNK) -> None:
        self.chunk = chunk
        self._done: list[int] = []
        self._crc = 0
        self._fill = 0  # bytes of the current piece folded in so far

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk - self._fill)
            self._crc = _crc32c.crc32c(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.chunk:
                self._done.append(self._crc)
                self._crc, self._fill = 0, 0

    def digest(self) -> list[int]:
        return self._done + [self._crc] if self._fill or not self._done else list(self._done)


def crc32c_reference(data: bytes, chunk: int = CRC_CHUNK) -> list[int]:
    """The per-piece CRC-32C list of ``data`` computed in one call per piece (for tests)."""
    return [_crc32c.crc32c(data[i : i + chunk]) for i in range(0, len(data), chunk)] or [0]


class Sum64:
    """Streaming ``sum64`` (format-2 checkpoints only; see [Note: checkpoint checksum]) of a byte sequence fed in pieces of any size and alignment."""

    _weights = np.arange(1, _WORDS + 1, dtype=np.uint64)

    def __init__(self) -> None:
        self._a = 0
        self._b = 0
        self._words = 0  # words folded in so far
        self._carry = b""  # < 8 bytes waiting for the rest of their word

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._carry:
            need = 8 - len(self._carry)
            self._carry += bytes(view[:need])
            view = view[need:]
            if len(self._carry) < 8:
                return
            self._fold(np.frombuffer(self._carry, dtype="<u8"))
            self._carry = b""
        whole = len(view) - len(view) % 8
        if whole:
            self._fold(np.frombuffer(view[:whole], dtype="<u8"))
        self._carry = bytes(view[whole:])

    def _fold(self, words: np.ndarray) -> None:
        for lo in range(0, words.size, _WORDS):
            chunk = words[lo : lo + _WORDS]
            n = chunk.size
            a = int(chunk.sum(dtype=np.uint64))
            b = int(np.dot(chunk, self._weights[:n]))
            # sum((o + j + 1) * w_j) = sum((j + 1) * w_j) + o * sum(w_j), o = words before this chunk
            self._b = (self._b + b + self._words * a) & _MASK
            self._a = (self._a + a) & _MASK
            self._words += n

    def hexdigest(self) -> str:
        a, b = self._a, self._b
        if self._carry:
            w = int.from_bytes(self._carry.ljust(8, b"\0"), "little")
            a = (a + w) & _MASK
            b = (b + (self._words + 1) * w) & _MASK
        return f"{a:016x}{b:016x}"


def sum64_reference(data: bytes) -> str:
    """The definition of ``sum64`` in plain Python (slow; for tests)."""
    data = data + b"\0" * (-len(data) % 8)
    a = b = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        a = (a + w) & _MASK
        b = (b + (i + 1) * w) & _MASK
    return f"{a:016x}{b:016x}"


def _stream(path: str, fold: Callable[[memoryview], None]) -> int:
    """Feed the bytes of the file at ``path`` to ``fold`` in order, in chunks; returns the byte count.

    [Note: verification reads ahead]
    Verifying a checkpoint reads every byte of its tensor files once, before anything is
    loaded: when the files are not in the page cache (a restart on another node, or after the
    cache was dropped) this pass is the one that reads them from the disk, and the load's
    later reads are page-cache copies. A loop of ``read`` then checksum leaves the disk idle
    while it checksums. Here the kernel is asked to read ahead (``POSIX_FADV_SEQUENTIAL``,
    and ``POSIX_FADV_WILLNEED`` on a window of ``_WINDOW`` bytes beyond the read position,
    which only queues the I/O), so the disk streams while this thread copies and checksums
    ``_CHUNK``-sized pieces; a 1 MiB piece stays in the CPU cache between the copy and the
    checksum. Measured on this machine (shared and noisy), two 600 MiB files verified
    concurrently with the page cache dropped: 0.82-0.90 s, the disk's own pace (plain 1 MiB
    reads of the same files took 0.65-1.15 s, ``dd bs=16M`` 0.62-1.74 s in the same runs).
    Verification is therefore disk-bound on a cold load. An engine load no longer verifies
    before copying: it reads each file once, into place and into its checksum together, with
    the same readahead (:class:`Readahead`; see [Note: single-pass load] in ``single_pass.py``);
    this whole-file pass remains for ``verify_file`` (inspection, conversion, inference loads).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead = Readahead.whole_file(fd, os.fstat(fd).st_size)
        view = memoryview(bytearray(_CHUNK))
        total = 0
        while True:
            ahead.advance(total)
            k = os.preadv(fd, [view], total)
            if k <= 0:
                return total
            fold(view[:k])
            total += k
    finally:
        os.close(fd)


def file_checksum(path: str) -> tuple[int, int]:
    """(size, crc32) of the file at ``path``, streamed in fixed-size chunks."""
    crc = 0

    def fold(v: memoryview) -> None:
        nonlocal crc
        crc = zlib.crc32(v, crc)

    return _stream(path, fold), crc


def file_crc32c(path: str) -> tuple[int, list[int]]:
    """(size, per-piece CRC-32C list) of the file at ``path`` (see [Note: checkpoint checksum])."""
    c = Crc32cChunks()
    return _stream(path, c.update), c.digest()


def file_sum64(path: str) -> tuple[int, str]:
    """(size, sum64) of the file at ``path`` (see [Note: checkpoint checksum])."""
    s = Sum64()
    return _stream(path, s.update), s.hexdigest()


class Readahead:
    """Keeps the byte spans of ``fd`` that will be read queued for readahead, ``_WINDOW`` bytes ahead.

    See [Note: verification reads ahead]; call ``advance(pos)`` before each read at ``pos``.
    ``spans`` are sorted, disjoint ``[lo, hi)`` ranges: only bytes that will be read are asked
    for, so the skipped parts of a file cost no I/O (``read_ranges`` in ``single_pass.py``);
    :meth:`whole_file` covers a file read front to back.
    """

    def __init__(self, fd: int, spans: list[tuple[int, int]]) -> None:
        self._fd = fd
        self._spans = spans
        self._i = 0  # the first span not completely queued
        self._queued = 0  # file offset up to which the spans are queued (WILLNEED)
        self._on = hasattr(os, "posix_fadvise")

    @classmethod
    def whole_file(cls, fd: int, size: int) -> Readahead:
        """Readahead over all ``size`` bytes of ``fd``, which is also marked sequential."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return cls(fd, [(0, size)] if size else [])

    def advance(self, pos: int) -> None:
        if not self._on:
            return
        limit = pos + _WINDOW
        while self._i < len(self._spans):
            lo, hi = self._spans[self._i]
            start = max(self._queued, lo)
            if start >= limit:
                return
            stop = min(hi, start + _WINDOW // 4)  # queued in quarters of the window
            os.posix_fadvise(self._fd, start, stop - start, os.POSIX_FADV_WILLNEED)
            self._queued = stop
            if stop >= hi:
                self._i += 1


class FileChecksum:
    """The checksum a file's integrity record names, computed incrementally over its bytes in file order.

    The per-piece CRC-32C (:class:`Crc32cChunks`), ``sum64`` (:class:`Sum64`) and CRC32
    (``zlib.crc32`` continued from the running value) all give the whole-file value for any
    split into pieces, so a load folds in each piece as it reads it (see [Note: single-pass
    load] in ``single_pass.py``). ``check`` raises the errors of :func:`verify_file`.
    """

    def __init__(self, path: str, record: dict[str, Any]) -> None:
        self.path = path
        self.record = record
        self.nbytes = 0
        self._crc32c = Crc32cChunks(_record_chunk(path, record)) if "crc32c" in record else None
        if self._crc32c is None and "sum64" not in record and "crc32" not in record:
            raise CheckpointError(f"the record of checkpoint file {path} has no checksum: {record!r}")
        self._sum64 = Sum64() if self._crc32c is None and "sum64" in record else None
        self._crc = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Fold in the next bytes of the file."""
        if self._crc32c is not None:
            self._crc32c.update(data)
        elif self._sum64 is not None:
            self._sum64.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
        self.nbytes += memoryview(data).nbytes

    def check(self) -> None:
        """Raise :class:`CheckpointError` naming the file unless the bytes folded in match the record."""
        _check_size(self.path, self.nbytes, self.record)
        if self._crc32c is not None:
            _check_crc32c(self.path, self._crc32c.digest(), self.record)
        elif self._sum64 is not None:
            _check_sum64(self.path, self._sum64.hexdigest(), self.record)
        else:
            _check_crc32(self.path, self._crc, self.record)


def _record_chunk(path: str, record: dict[str, Any]) -> int:
    chunk = record.get("crc32c_chunk")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= _MAX_CRC_CHUNK:
        raise CheckpointError(
            f"the record of checkpoint file {path} has crc32c_chunk {chunk!r}; expected a piece size of "
            f"1 to {_MAX_CRC_CHUNK} bytes (the record is corrupted or was edited)"
        )
    return chunk


def _check_crc32c(path: str, digest: list[int], record: dict[str, Any]) -> None:
    saved = record["crc32c"]
    if digest != saved:
        bad = next((i for i, (a, b) in enumerate(zip(digest, saved)) if a != b), min(len(digest), len(saved)))
        chunk = int(record["crc32c_chunk"])
        hi = min((bad + 1) * chunk, int(record["bytes"]))
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (crc32c of bytes [{bad * chunk}, {hi}) differs "
            "from the recorded one): it is corrupted or was modified"
        )


def _check_size(path: str, size: int, record: dict[str, Any]) -> None:
    if size != record.get("bytes"):
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, the checkpoint recorded {record.get('bytes')}: "
            "it is truncated or was modified"
        )


def _check_sum64(path: str, digest: str, record: dict[str, int | str]) -> None:
    if digest != record["sum64"]:
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (sum64 {digest}, recorded {record['sum64']}): "
            "it is corrupted or was modified"
        )


def _check_crc32(path: str, crc: int, record: dict[str, int | str]) -> None:
    if crc != record["crc32"]:
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (crc32 {crc:#010x}, recorded "
            f"{int(record['crc32']):#010x}): it is corrupted or was modified"
        )


def check_file_size(path: str, record: dict[str, int | str]) -> None:
    """Raise :class:`CheckpointError` naming ``path`` if it is missing or its size differs from ``record``."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    _check_size(path, os.path.getsize(path), record)


def verify_file(path: str, record: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming ``path`` unless it matches ``record``.

    Uses the record's ``crc32c`` list; old records' ``sum64``, else ``crc32`` (see
    [Note: checkpoint checksum]).
    """
    check_file_size(path, record)
    c = FileChecksum(path, record)
    _stream(path, c.update)
    c.check()
