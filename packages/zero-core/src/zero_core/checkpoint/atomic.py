"""Crash-safe file writes: temporary name, fsync, rename, directory fsync.

A reader never sees a half-written file under its final name: the bytes go to
``<name>.tmp.<pid>``, are fsynced, and the file is renamed over the final name (atomic on
POSIX); the directory is then fsynced so the rename itself survives a power loss. See
[Note: checkpoint format] for how tags and ``latest`` build on this.

``ZERO_CHECKPOINT_KILL_AFTER_BYTES`` (a test hook, read on every write) makes the writing
process SIGKILL itself once that many bytes went to temporary files, to prove the claim.

[Note: checksum overlapped with writing]
CRC32 runs at roughly the disk's speed (~1.3 GB/s here), so computed inline it nearly doubles
the time of a save. But the CPU is mostly idle while a save waits on the disk: inside
``write`` once the kernel throttles dirty pages, or inside ``fsync`` otherwise. A writer built
with ``defer_checksum=True`` hands each buffer written with ``stable=True`` (by reference, no
copy) to a helper thread that checksums it while this thread goes on writing and then
fsyncs; ``zlib.crc32``, ``write`` and ``fsync`` all release the GIL on large buffers. A
buffer may be passed as stable only if it stays valid and unmodified until commit: the saver's
views of the live training state qualify; a streaming writer that drops each tensor after
writing it (``zero_to_fp32``) must not, or it would keep them all alive. An unstable buffer
first waits for the helper to catch up (CRC32 is order dependent), then is checksummed inline.
"""

from __future__ import annotations

import os
import signal
import queue
import threading
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


class _BackgroundCrc:
    """CRC32 of a sequence of buffers, computed in order by a helper thread."""

    def __init__(self) -> None:
        self.value = 0
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._thread = threading.Thread(target=self._run, name="zero-checkpoint-crc32", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (view := self._queue.get()) is not None:
            self.value = zlib.crc32(view, self.value)
            del view
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()

    def submit(self, view: memoryview) -> None:
        with self._idle:
            self._outstanding += 1
        self._queue.put(view)

    def wait(self) -> int:
        """Block until every submitted buffer is folded in; returns the CRC so far."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)
        return self.value

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class AtomicWriter:
    """A binary file that appears under ``path`` only when closed without error.

    Tracks the byte count and CRC32 of what was written (see ``integrity.py``); ``crc32`` is
    final once the writer is committed. With ``defer_checksum`` buffers written with
    ``stable=True`` are checksummed by a helper thread, overlapped with the writes and the
    ``fsync`` (see [Note: checksum overlapped with writing]).
    """

    def __init__(self, path: str, *, defer_checksum: bool = False) -> None:
        self.path = path
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self._f = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 (closed in commit/abort)
        self.nbytes = 0
        self.crc32 = 0
        self._crc = _BackgroundCrc() if defer_checksum else None

    def write(self, data: bytes | memoryview, *, stable: bool = False) -> None:
        """Append ``data``; ``stable`` promises it stays unmodified until commit (its CRC may lag)."""
        view = memoryview(data).cast("B")
        n = len(view)
        _maybe_die_midway(self._f, view)
        if self._crc is not None and stable:
            self._crc.submit(view)  # checksummed while this thread writes
        elif self._crc is not None:
            self.crc32 = zlib.crc32(view, self._crc.wait())
            self._crc.value = self.crc32
        else:
            self.crc32 = zlib.crc32(view, self.crc32)
        rest = view
        while rest:
            k = self._f.write(rest)
            rest = rest[k:]
        self.nbytes += n
        _account(n)

    def commit(self) -> None:
        self._f.flush()
        try:
            os.fsync(self._f.fileno())
        finally:
            if self._crc is not None:
                self.crc32 = self._crc.wait()
                self._crc.close()
                self._crc = None
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._crc is not None:
            self._crc.close()
            self._crc = None
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
