"""Pure-Python I/O engine (the fallback of the native AioEngine; see [Note: native or fallback]).

Same interface and error behaviour as ``zero_ops._C.AioEngine``, with buffered pread/pwrite on a
thread pool (no O_DIRECT: Python cannot easily guarantee aligned transfers). The GIL is released
inside os.preadv/os.pwrite, so the threads do overlap.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor


class ThreadPoolEngine:
    def __init__(
        self,
        block_size: int,
        queue_depth: int,
        single_submit: bool,
        overlap_events: bool,
        thread_count: int,
        use_direct: bool,
    ) -> None:
        self._block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=thread_count, thread_name_prefix="zero_ops_aio")
        self._lock = threading.Lock()
        self._futures: list[Future] = []
        self._requests = 0

    def submit(self, is_write: bool, path: str, buffer: int, nbytes: int, offset: int) -> None:
        flags = (os.O_WRONLY | os.O_CREAT) if is_write else os.O_RDONLY
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot open '{path}' for {'writing' if is_write else 'reading'}: {exc.strerror}",
                path,
            ) from None
        if not is_write:
            size = os.fstat(fd).st_size
            if size < offset + nbytes:
                os.close(fd)
                raise OSError(
                    errno.EIO,
                    f"short read: cannot read {nbytes} bytes at offset {offset} of "
                    f"'{path}': the file has only {size} bytes",
                    path,
                )
        blocks = [(s, min(self._block_size, nbytes - s)) for s in range(0, nbytes, self._block_size)]
        remaining = [len(blocks)]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                os.close(fd)

        def run(start: int, length: int) -> None:
            try:
                view = memoryview((ctypes.c_char * length).from_address(buffer + start)).cast("B")
                moved = 0
                while moved < length:
                    if is_write:
                        n = os.pwrite(fd, view[moved:], offset + start + moved)
                    else:
                        n = os.preadv(fd, [view[moved:]], offset + start + moved)
                    if n == 0:
                        if is_write:
                            raise OSError(
                                errno.ENOSPC,
                                f"write made no progress: writing {length - moved} "
                                f"bytes at offset {offset + start + moved} of '{path}'",
                                path,
                            )
                        raise OSError(
                            errno.EIO,
                            f"short read: expected {nbytes} bytes at offset {offset} of "
                            f"'{path}', the file ended at byte {offset + start + moved}",
                            path,
                        )
                    moved += n
            except OSError as exc:
                if exc.filename is None:
                    what = "write" if is_write else "read"
                    raise OSError(
                        exc.errno,
                        f"{what} failed: {length} bytes at offset {offset + start} of "
                        f"'{path}': {exc.strerror}",
                        path,
                    ) from None
                raise
            finally:
                done()

        with self._lock:
            self._requests += 1
            if not blocks:
                os.close(fd)
            for start, length in blocks:
                self._futures.append(self._pool.submit(run, start, length))

    def wait(self) -> int:
        with self._lock:
            futures, self._futures = self._futures, []
            completed, self._requests = self._requests, 0
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            first = errors[0]
            if len(errors) > 1:
                raise OSError(
                    first.errno,
                    f"{first.strerror} (and {len(errors) - 1} more failed blocks)",
                    first.filename,
                )
            raise first
        return completed

    def pending(self) -> int:
        with self._lock:
            return self._requests

    def backend(self) -> str:
        return "python-threads"

    def direct_bytes(self) -> int:
        return 0

    def buffered_bytes(self) -> int:
        return -1  # not tracked

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
