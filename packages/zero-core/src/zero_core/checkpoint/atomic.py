"""Crash-safe file writes: temporary name, fsync, rename, directory fsync.

A reader never sees a half-written file under its final name: the bytes go to
``<name>.tmp.<pid>``, are fsynced, and the file is renamed over the final name (atomic on
POSIX); the directory is then fsynced so the rename itself survives a power loss. See
[Note: checkpoint format] for how tags and ``latest`` build on this.

``ZERO_CHECKPOINT_KILL_AFTER_BYTES`` (a test hook, read on every write) makes the writing
process SIGKILL itself once that many bytes went to temporary files, to prove the claim.

[Note: checksum overlapped with writing]
Checksumming costs CPU time comparable to the write itself (CRC-32C ~3 GB/s on one core here,
see [Note: checkpoint checksum]), so computed inline it adds to every save. But the CPU is mostly idle while
a save waits on the disk: inside ``write`` once the kernel throttles dirty pages, or inside
``fsync`` otherwise. A writer built with ``defer_checksum=True`` hands each buffer written
with ``stable=True`` (by reference, no copy) to a helper thread that checksums it while this
thread goes on writing and then fsyncs; ``crc32c.crc32c``, ``zlib.crc32``, numpy's reductions, ``write`` and
``fsync`` all release the GIL on large buffers. A buffer may be passed as stable only if it
stays valid and unmodified until commit: the saver's views of the live training state
qualify; a streaming writer that drops each tensor after writing it (``zero_to_fp32``) must
not, or it would keep them all alive. An unstable buffer first waits for the helper to catch
up (checksums are order dependent), then is checksummed inline.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import threading
import zlib
from types import TracebackType
from typing import Any

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


class _Checksums:
    """Per-piece CRC-32C, CRC32 and/or ``sum64`` (see ``integrity.py``) of the bytes fed in order."""

    def __init__(self, crc32: bool, sum64: bool, crc32c: bool = False) -> None:
        self._crc32 = 0 if crc32 else None
        self._crc32c = None
        if crc32c:
            from zero_core.checkpoint.integrity import Crc32cChunks

            self._crc32c = Crc32cChunks()
        self._sum64 = None
        if sum64:
            from zero_core.checkpoint.integrity import Sum64  # numpy: only writers of sum64 need it

            self._sum64 = Sum64()

    def update(self, view: memoryview) -> None:
        if self._crc32c is not None:
            self._crc32c.update(view)
        if self._crc32 is not None:
            self._crc32 = zlib.crc32(view, self._crc32)
        if self._sum64 is not None:
            self._sum64.update(view)

    def crc32(self) -> int | None:
        return self._crc32

    def crc32c(self) -> list[int] | None:
        return None if self._crc32c is None else self._crc32c.digest()

    def sum64(self) -> str | None:
        return None if self._sum64 is None else self._sum64.hexdigest()


class _BackgroundChecksums:
    """Feeds buffers to a :class:`_Checksums` in order, on a helper thread."""

    def __init__(self, sums: _Checksums) -> None:
        self.sums = sums
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zero-checkpoint-checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (view := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self.sums.update(view)
            except BaseException as e:  # re-raised by wait(), in the writing thread
                self._error = e
            del view
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()

    def submit(self, view: memoryview) -> None:
        with self._idle:
            self._outstanding += 1
        self._queue.put(view)

    def wait(self) -> None:
        """Block until every submitted buffer is folded in."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class AtomicWriter:
    """A binary file that appears under ``path`` only when closed without error.

    Tracks the byte count and the per-piece CRC-32C (with ``crc32c=True``, what checkpoints
    record), the CRC32 (unless ``crc32=False``) and ``sum64`` (with ``sum64=True``) of what was
    written (see ``integrity.py``), final once the writer is committed; a checksum not asked
    for is None. An ``OSError`` while writing (a full disk) is re-raised naming the file, after
    the temporary file is removed. With
    ``defer_checksum`` buffers written with ``stable=True`` are checksummed by a helper thread,
    overlapped with the writes and the ``fsync`` (see [Note: checksum overlapped with writing]).
    """

    def __init__(
        self,
        path: str,
        *,
        defer_checksum: bool = False,
        crc32: bool = True,
        sum64: bool = False,
        crc32c: bool = False,
    ) -> None:
        self.path = path
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self._sums = _Checksums(crc32, sum64, crc32c)
        try:
            self._f = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 (closed in commit/abort)
        except OSError as e:
            raise _named(e, path, 0) from e
        self.nbytes = 0
        self.crc32: int | None = None
        self.sum64: str | None = None
        self.crc32c: list[int] | None = None
        self._bg = _BackgroundChecksums(self._sums) if defer_checksum else None

    def write(self, data: bytes | memoryview, *, stable: bool = False) -> None:
        """Append ``data``; ``stable`` promises it stays unmodified until commit (its checksum may lag)."""
        view = memoryview(data).cast("B")
        n = len(view)
        _maybe_die_midway(self._f, view)
        if self._bg is not None and stable:
            self._bg.submit(view)  # checksummed while this thread writes
        else:
            if self._bg is not None:
                self._bg.wait()  # checksums are order dependent: fold in what was deferred first
            self._sums.update(view)
        try:
            _write_all(self._f, view)
        except OSError as e:
            raise _named(e, self.path, self.nbytes) from e
        self.nbytes += n
        _account(n)

    def commit(self) -> None:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise _named(e, self.path, self.nbytes) from e
        finally:
            if self._bg is not None:
                bg, self._bg = self._bg, None
                try:
                    bg.wait()
                finally:
                    bg.close()
        self.crc32 = self._sums.crc32()
        self.sum64 = self._sums.sum64()
        self.crc32c = self._sums.crc32c()
        self._f.close()
        os.replace(self.tmp, self.path)

    def record(self) -> dict[str, Any]:
        """The committed file's integrity record (``integrity.file_record``)."""
        from zero_core.checkpoint.integrity import file_record

        return file_record(self.nbytes, self.crc32, self.sum64, self.crc32c)

    def abort(self) -> None:
        if self._bg is not None:
            self._bg.close()
            self._bg = None
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


def _write_all(f: Any, view: memoryview) -> None:
    """Write all of ``view`` to the unbuffered file ``f`` (tests replace it to inject a full disk)."""
    while view:
        k = f.write(view)
        view = view[k:]


def _named(e: OSError, path: str, written: int) -> OSError:
    """``e`` re-raised as the same kind of ``OSError``, naming the checkpoint file and what to do."""
    hint = " (free space or save elsewhere)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return type(e)(
        e.errno, f"{e.strerror or e} while writing checkpoint file after {written} bytes{hint}", path
    )


def atomic_write_bytes(path: str, data: bytes, *, sync_dir: bool = True) -> dict[str, Any]:
    """Write ``data`` to ``path`` atomically; returns its integrity record (bytes, crc32c)."""
    with AtomicWriter(path, crc32=False, crc32c=True) as w:
        w.write(data)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return w.record()
