"""AsyncIOHandle: asynchronous tensor <-> file transfers for NVMe offload (DeepSpeed's aio handle).

Its arguments are the ``aio`` section of the DeepSpeed config. Transfers run on the native
engine (csrc/aio_engine.cpp), whose workers either drive Linux kernel AIO queues (``libaio``,
when the build found <libaio.h> and io_setup works here) or do pread/pwrite themselves
(``threads``), with O_DIRECT for aligned blocks where the file system supports it; without the
compiled extension, a Python thread pool does the same. See [Note: aio backends] in
csrc/aio_engine.h for what queue_depth, single_submit and overlap_events mean on each.
Failures (missing file, disk full, short read) raise OSError naming the path, at submit time when
they can be detected early and from wait() otherwise.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from zero_ops import _native
from zero_ops.aio._threadpool import ThreadPoolEngine
from zero_ops.aio.buffers import ALIGNMENT, is_locked, locked_empty

_R = TypeVar("_R")

# [Note: aio engines across fork]
# A fork() copies a native engine but not its worker threads, and may copy its mutex and
# condition variables while a worker waits on them: destroying that copy in the child blocks
# forever (pthread_cond_destroy waits for waiters that exist only in the parent). Forked
# children (multi-rank test harnesses, DataLoader workers) therefore never destroy an engine
# they inherited: the after-fork hook below keeps every inherited native engine alive for the
# child's lifetime. The parent is unaffected; the child leaks only the small engine objects.
_live_native: weakref.WeakSet[Any] = weakref.WeakSet()
_inherited: list[Any] = []


class _EngineRef:
    """A weak-referenceable holder of a native engine (pybind objects are not)."""

    __slots__ = ("engine", "__weakref__")

    def __init__(self, engine: object) -> None:
        self.engine = engine


def _keep_inherited_engines_alive() -> None:
    _inherited.extend(list(_live_native))


os.register_at_fork(after_in_child=_keep_inherited_engines_alive)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AsyncIOHandle: {name} must be an int >= 1, got {value!r}")
    return value


# [Note: aio keyword names]
# DeepSpeed's aio handle is a pybind11 class whose arguments carry names: ``buffer``,
# ``filename``, ``validate``, ``async``, ``file_offset`` (``fd`` for the descriptor overload of
# ``async_pwrite``), and users and DeepSpeed's own tests call it by keyword
# (``h.sync_pwrite(buffer=t, filename=f, file_offset=o)``). Our methods take those names. Two
# kinds of keywords are translated before the call: ``async`` (a Python keyword, so it cannot
# be a parameter name: it arrives through ``**{"async": ...}`` and becomes ``async_op``), and
# the names zero's handle used before (``tensor``, ``path``, ``offset``), kept working.
_RENAMED = {"async": "async_op", "tensor": "buffer", "path": "filename", "offset": "file_offset"}


def _keywords(where: str) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """Decorator translating the keywords of [Note: aio keyword names] for method ``where``."""

    def wrap(method: Callable[..., _R]) -> Callable[..., _R]:
        @functools.wraps(method)
        def call(self: object, *args: object, **kwargs: object) -> _R:
            for old, new in _RENAMED.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{where}: got both {old!r} and {new!r} (the same argument)")
                    kwargs[new] = kwargs.pop(old)
            return method(self, *args, **kwargs)

        return call

    return wrap


def _write_target(filename: str | os.PathLike | int | None, fd: int | None) -> str | os.PathLike:
    """The path ``async_pwrite`` writes to: ``filename``, or the file behind descriptor ``fd``."""
    if fd is None and isinstance(filename, int) and not isinstance(filename, bool):
        fd = filename  # DeepSpeed's overload async_pwrite(buffer, fd, file_offset), by position
    elif fd is not None and filename is not None:
        raise TypeError("async_pwrite: give filename or fd, not both")
    if fd is None:
        if filename is None:
            raise TypeError("async_pwrite: missing the target: filename (a path) or fd (an open descriptor)")
        return filename
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise ValueError(f"async_pwrite: fd must be an open file descriptor (int >= 0), got {fd!r}")
    proc = f"/proc/self/fd/{fd}"
    if not os.path.exists(proc):
        raise OSError(
            f"async_pwrite: fd {fd} is not an open file descriptor of this process (or /proc is missing)"
        )
    return proc  # the same open file, reopened by the engine's workers (Linux)


class AsyncIOHandle:
    """Queue of asynchronous reads/writes between CPU tensors and files.

    Args:
        block_size: bytes per I/O call; a request is split into blocks that the threads move
            in parallel.
        queue_depth: libaio: O_DIRECT blocks each worker keeps in flight in the kernel. Up to
            this many consecutive blocks that share a descriptor are moved with one pread/pwrite
            (threads: O_DIRECT blocks and buffered reads; libaio: buffered reads; buffered writes
            stay one block per call), see [Note: runs of blocks] in csrc/aio_engine.h.
        single_submit: libaio: one io_submit call per block instead of one per batch; threads:
            one block per pread/pwrite.
        overlap_events: libaio: refill each completed slot at once (sliding window) instead of
            submitting a batch of queue_depth and waiting for all of it; no effect on threads.
        thread_count: worker threads (each with its own kernel AIO queue on libaio); DeepSpeed's
            ``intra_op_parallelism`` (the same fifth argument, also accepted by that name).
        o_direct: use O_DIRECT for blocks whose buffer address, file offset and length are
            4096-byte aligned (see :meth:`new_cpu_locked_tensor`), where the file system allows it.
        engine: ``"auto"`` (libaio when available, else threads), ``"libaio"`` (raise OSError
            if kernel AIO is not compiled in or not allowed here) or ``"threads"``.

    Tensors handed to ``async_*`` calls must stay untouched until :meth:`wait` returns; the handle
    keeps them alive until then. ``bytes_read`` / ``bytes_written`` count the bytes of every
    request submitted so far (zero-offload's swap throughput counters add them up).
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        *,
        o_direct: bool = True,
        engine: str = "auto",
        intra_op_parallelism: int | None = None,
    ) -> None:
        if intra_op_parallelism is not None:
            if thread_count != 1 and thread_count != intra_op_parallelism:
                raise ValueError(
                    f"AsyncIOHandle: thread_count={thread_count} and intra_op_parallelism={intra_op_parallelism} "
                    "are the same setting (DeepSpeed's name and ours): give one"
                )
            thread_count = intra_op_parallelism
        self._block_size = _positive_int("block_size", block_size)
        self._queue_depth = _positive_int("queue_depth", queue_depth)
        self._thread_count = _positive_int("thread_count", thread_count)
        for name, flag in (
            ("single_submit", single_submit),
            ("overlap_events", overlap_events),
            ("o_direct", o_direct),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"AsyncIOHandle: {name} must be a bool, got {flag!r}")
        if engine not in ("auto", "libaio", "threads"):
            raise ValueError(f"AsyncIOHandle: engine must be 'auto', 'libaio' or 'threads', got {engine!r}")
        self._single_submit = single_submit
        self._overlap_events = overlap_events
        C = _native.native()
        args = (block_size, queue_depth, single_submit, overlap_events, thread_count, o_direct)
        if C is None:
            if engine == "libaio":
                raise OSError(
                    f"AsyncIOHandle: engine='libaio' needs the compiled extension ({_native.fallback_reason()})"
                )
            _native.warn_fallback("AsyncIOHandle")
            self._engine: Any = ThreadPoolEngine(*args)
        else:
            self._engine = C.AioEngine(*args, engine)
            self._engine_ref = _EngineRef(self._engine)
            _live_native.add(self._engine_ref)
        self._inflight: list[torch.Tensor] = []
        # bytes submitted for reading / writing since construction (swap throughput counters)
        self.bytes_read = 0
        self.bytes_written = 0

    # -- DeepSpeed-style getters ---------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_thread_count(self) -> int:
        return self._thread_count

    def get_intra_op_parallelism(self) -> int:
        """DeepSpeed's name of :meth:`get_thread_count`."""
        return self._thread_count

    def get_engine(self) -> str:
        """The backend in use: ``"libaio"``, ``"threads"`` (native) or ``"python-threads"`` (fallback)."""
        return self._engine.backend()

    # -- transfers -----------------------------------------------------------------------
    # Parameter names are DeepSpeed's (``buffer``, ``filename``, ``file_offset``, ``validate``,
    # ``async``, ``fd``), so its keyword calls work: See [Note: aio keyword names].
    @_keywords("async_pread")
    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        """Starts reading ``buffer.nbytes`` bytes at ``file_offset`` of ``filename`` into ``buffer``. Returns 0."""
        return self._submit(False, buffer, filename, file_offset, "async_pread")

    @_keywords("async_pwrite")
    def async_pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
    ) -> int:
        """Starts writing ``buffer`` to ``filename`` at ``file_offset`` (the file is created if
        missing). Returns 0. As DeepSpeed's second overload, the target may instead be an open file
        descriptor (``fd=``, or an int in place of the name; Linux): it must stay open until
        :meth:`wait` returns."""
        target = _write_target(filename, fd)
        return self._submit(True, buffer, target, file_offset, "async_pwrite")

    def wait(self) -> int:
        """Waits for every submitted request; returns how many completed. Raises OSError on failure."""
        try:
            return self._engine.wait()
        finally:
            self._inflight.clear()

    @_keywords("sync_pread")
    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        """Reads like async_pread and waits (also for requests submitted earlier). Returns the number
        of requests completed (1 when none was pending), as DeepSpeed's handle."""
        self._submit(False, buffer, filename, file_offset, "sync_pread")
        return self.wait()

    @_keywords("sync_pwrite")
    def sync_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        """Writes like async_pwrite and waits (also for requests submitted earlier). Returns the
        number of requests completed, as DeepSpeed's handle."""
        self._submit(True, buffer, filename, file_offset, "sync_pwrite")
        return self.wait()

    @_keywords("pread")
    def pread(
        self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False, async_op: bool = False,
        file_offset: int = 0,
    ) -> int:  # fmt: skip
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset)`` (``async`` is a
        Python keyword: pass it by position, as ``async_op=``, or as ``**{"async": ...}``): async
        returns 0 (then :meth:`wait`), sync returns the completed count; ``validate`` re-reads the
        file with plain Python afterwards and raises OSError if the bytes differ (sync only)."""
        if async_op:
            if validate:
                raise ValueError("pread: validate needs a synchronous read (async_op=False)")
            return self.async_pread(buffer, filename, file_offset)
        done = self.sync_pread(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset, "pread")
        return done

    @_keywords("pwrite")
    def pwrite(
        self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False, async_op: bool = False,
        file_offset: int = 0,
    ) -> int:  # fmt: skip
        """DeepSpeed's ``pwrite(buffer, filename, validate, async, file_offset)``; see :meth:`pread`."""
        if async_op:
            if validate:
                raise ValueError("pwrite: validate needs a synchronous write (async_op=False)")
            return self.async_pwrite(buffer, filename, file_offset)
        done = self.sync_pwrite(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset, "pwrite")
        return done

    @_keywords("read")
    def read(
        self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False, file_offset: int = 0
    ) -> int:
        """DeepSpeed's ``read(buffer, filename, validate, file_offset)``: a synchronous read."""
        return self.pread(buffer, filename, validate, False, file_offset)

    @_keywords("write")
    def write(
        self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool = False, file_offset: int = 0
    ) -> int:
        """DeepSpeed's ``write(buffer, filename, validate, file_offset)``: a synchronous write."""
        return self.pwrite(buffer, filename, validate, False, file_offset)

    def pending(self) -> int:
        """Requests submitted and not yet collected by :meth:`wait`."""
        return self._engine.pending()

    def direct_bytes(self) -> int:
        """Bytes moved through O_DIRECT so far (0 on the fallback engine)."""
        return self._engine.direct_bytes()

    # -- buffers -------------------------------------------------------------------------
    def new_cpu_locked_tensor(
        self,
        num_elem: int,
        example_tensor: torch.dtype | torch.Tensor = torch.float32,
        **deepspeed_names: object,
    ) -> torch.Tensor:
        """A page-aligned CPU tensor (so transfers can use O_DIRECT), page-locked where allowed.

        DeepSpeed's signature ``new_cpu_locked_tensor(num_elem, example_tensor)`` works (a tensor
        gives the dtype; DeepSpeed spells the keyword ``example_tenosr``, accepted too), and so
        does a dtype in its place.

        Locked with torch's pinned allocator when CUDA is present, with mlock(2) otherwise; when
        RLIMIT_MEMLOCK (or the sandbox) refuses, the buffer stays unlocked and one warning says
        why. See [Note: locked buffers] in zero_ops.aio.buffers; ``is_locked(t)`` tells.
        """
        for name in ("example_tenosr", "dtype"):
            if name in deepspeed_names:
                example_tensor = deepspeed_names.pop(name)
        if deepspeed_names:
            raise TypeError(
                f"new_cpu_locked_tensor: unexpected keyword arguments {sorted(deepspeed_names)} "
                "(allowed: num_elem, example_tensor / example_tenosr / dtype)"
            )
        if isinstance(num_elem, torch.Tensor):  # an example tensor in place of the count
            num_elem = num_elem.numel()
        dtype = example_tensor.dtype if isinstance(example_tensor, torch.Tensor) else example_tensor
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                "new_cpu_locked_tensor: the second argument must be a dtype or an example tensor, "
                f"got {example_tensor!r}"
            )
        return locked_empty(num_elem, dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        """Releases a buffer from :meth:`new_cpu_locked_tensor` (memory is freed with its last reference)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("free_cpu_locked_tensor: expected a tensor")

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """DeepSpeed's check: whether ``buffer`` is page-locked (torch-pinned or locked by
        :meth:`new_cpu_locked_tensor`). Transfers accept any contiguous CPU tensor either way."""
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"is_pinned: buffer must be a torch.Tensor, got {type(buffer).__name__}")
        return bool(buffer.is_pinned() or is_locked(buffer))

    def get_alignment(self) -> int:
        """Byte alignment of buffer address, file offset and length for O_DIRECT transfers."""
        return ALIGNMENT

    def _submit(
        self, is_write: bool, tensor: torch.Tensor, path: str | os.PathLike, offset: int, where: str
    ) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{where}: buffer must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{where}: buffer must be on the CPU, got {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{where}: buffer must be contiguous")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{where}: filename must be a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{where}: file_offset must be an int >= 0, got {offset!r}")
        nbytes = tensor.numel() * tensor.element_size()
        self._engine.submit(is_write, path, tensor.data_ptr(), nbytes, offset)
        self._inflight.append(tensor)
        if is_write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes
        return 0


def _validate(tensor: torch.Tensor, path: str | os.PathLike, offset: int, where: str) -> None:
    """Compare ``tensor``'s bytes with the file's, read with plain Python (the ``validate`` flag)."""
    nbytes = tensor.numel() * tensor.element_size()
    with open(path, "rb") as f:
        f.seek(offset)
        on_disk = f.read(nbytes)
    mine = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if nbytes else b""
    if on_disk != mine:
        raise OSError(
            f"{where}: validation failed: the bytes of {os.fspath(path)} at {offset} differ from the tensor"
        )


# DeepSpeed's name (``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``).
aio_handle = AsyncIOHandle
