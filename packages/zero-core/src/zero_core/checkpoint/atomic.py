"""Crash-safe file writes: temporary name, fsync, rename, directory fsync.

A reader never sees a half-written file under its final name: the bytes go to
``<name>.tmp.<pid>``, are fsynced, and the file is renamed over the final name (atomic on
POSIX); the directory is then fsynced so the rename itself survives a power loss. See
[Note: checkpoint format] for how tags and ``latest`` build on this.

``ZERO_CHECKPOINT_KILL_AFTER_BYTES`` (a test hook, read on every write) makes the writing
process SIGKILL itself once that many bytes went to temporary files, to prove the claim.
"""

from __future__ import annotations

import os
import signal
import zlib
from types import TracebackType

_KILL_ENV = "ZERO_CHECKPOINT_KILL_AFTER_BYTES"
_written_total = 0


def _account(n: int) -> None:
    global _written_total
    _written_total += n


def _maybe_die_midway(f: object, view: memoryview) -> None:
    """Test hook: SIGKILL this process partway through ``view`` once the byte budget is spent."""
    limit = os.environ.get(_KILL_ENV)
    if limit is None:
        return
    cut = int(limit) - _written_total
    if cut < len(view):
        f.write(view[: max(cut, 0)])  # type: ignore[attr-defined]
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str) -> None:
    """fsync a directory so renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicWriter:
    """A binary file that appears under ``path`` only when closed without error.

    Tracks the byte count and CRC32 of what was written (see ``integrity.py``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self._f = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 (closed in commit/abort)
        self.nbytes = 0
        self.crc32 = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        _maybe_die_midway(self._f, view)
        while view:
            k = self._f.write(view)
            view = view[k:]
        self.crc32 = zlib.crc32(data, self.crc32)
        self.nbytes += n
        _account(n)

    def commit(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def atomic_write_bytes(path: str, data: bytes, *, sync_dir: bool = True) -> tuple[int, int]:
    """Write ``data`` to ``path`` atomically; returns (bytes, crc32)."""
    with AtomicWriter(path) as w:
        w.write(data)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return w.nbytes, w.crc32
