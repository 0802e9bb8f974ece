"""Crash-safe file writes: temporary name, fsync, rename, directory fsync.

A reader never sees a half-written file under its final name: the bytes go to
``<name>.tmp.<pid>``, are fsynced, and the file is renamed over the final name (atomic on
POSIX); the directory is then fsynced so the rename itself survives a power loss. See
[Note: checkpoint format] for how tags and ``latest`` build on this.

[Note: one atomic writer]
Every file the family writes for a reader to find later (checkpoints, 16-bit model files,
tensor-parallel inference checkpoints, the autotuner's results) is written through this
module, so that the temporary name, the fsyncs, the rename and the clean-up after a failure
are decided once: :class:`AtomicWriter` for streamed bytes (checksummed for checkpoints),
:func:`atomic_write_bytes`, :func:`atomic_write_text` and :func:`atomic_write_json` for whole
contents, and :func:`atomic_path` for a writer that only takes a file name (safetensors'
``save_file`` in :func:`atomic_write_safetensors`, matplotlib's ``savefig``). Three places keep
a writer of their own, each because it must run where ``zero_core`` cannot be imported:

* ``zero_to_fp32.py``: its copy inside every checkpoint runs with the standard library alone
  (see [Note: standalone conversion script]); it has one writer, ``_atomic_fd``;
* zero-profiler: it depends on torch alone (installable and usable without the rest of the
  family), and a module it shared with zero-core would have to live in a new distribution that
  every install command then has to name (pip looks local dependencies up in the index), or be
  zero-core, which it must not need; so ``zero_profiler.profiler.write_text_atomic`` is a
  second, 15-line text writer with the same steps;
* ``tools/env_prefetch.py``: it runs under hatch before any package of the family is installed.

``checkpoint/staged.py`` renames directories (publishing a complete tag), which is not a file
write. The cross-package test ``tests/test_structure.py`` fails on a rename (``os.replace``,
``os.rename``, ``shutil.move``, pathlib's ``replace``/``rename``) anywhere else in
``packages/*/src`` and ``tools/``.

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

import contextlib
import errno
import json
import os
import queue
import signal
import threading
import zlib
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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
    for is None. An ``OSError`` while writing (a full disk) is re-raised naming the file (as a
    ``what``, "checkpoint file" by default), after the temporary file is removed. With
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
        what: str = "checkpoint file",
    ) -> None:
        self.path = path
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self.what = what
        self._sums = _Checksums(crc32, sum64, crc32c)
        try:
            self._f = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 (closed in commit/abort)
        except OSError as e:
            raise _named(e, path, 0, what) from e
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
            raise _named(e, self.path, self.nbytes, self.what) from e
        self.nbytes += n
        _account(n)

    def commit(self) -> None:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise _named(e, self.path, self.nbytes, self.what) from e
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


def _named(e: OSError, path: str, written: int, what: str = "checkpoint file") -> OSError:
    """``e`` re-raised as the same kind of ``OSError``, naming the file and what to do."""
    hint = " (free space or save elsewhere)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return type(e)(e.errno, f"{e.strerror or e} while writing {what} after {written} bytes{hint}", path)


def atomic_write_bytes(path: str, data: bytes, *, sync_dir: bool = True) -> dict[str, Any]:
    """Write ``data`` to ``path`` atomically; returns its integrity record (bytes, crc32c)."""
    with AtomicWriter(path, crc32=False, crc32c=True) as w:
        w.write(data)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return w.record()


def atomic_write_text(path: str | os.PathLike, text: str, *, sync_dir: bool = True) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically. See [Note: one atomic writer]."""
    path = os.fspath(path)
    with AtomicWriter(path, crc32=False, what="file") as w:
        w.write(text.encode("utf-8"))
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str | os.PathLike, data: Any, *, sync_dir: bool = True) -> None:
    """Write ``data`` as JSON (indented, keys sorted) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True), sync_dir=sync_dir)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, sync_dir: bool = True) -> Iterator[str]:
    """A temporary name next to ``path`` for a writer that only takes a file name.

    The body writes the file under the name yielded; when it returns, the file is fsynced and
    renamed over ``path`` (then the directory fsynced); when it raises, the temporary file is
    removed. See [Note: one atomic writer].
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` as a safetensors file at ``path`` atomically (streamed by safetensors
    itself, no copy of the whole file in memory)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(dict(tensors), tmp, metadata=metadata)
