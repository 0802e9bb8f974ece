"""Swap files of NVMe offload: where they live, how big they are, and when they go away.

[Note: swap file lifecycle]
Every rank keeps its swap files under ``nvme_path/<job>/rank<r>/`` (``<job>`` is the
``ZERO_JOB_NAME`` environment variable, else ``job-<pid of the process>``), so ranks and
concurrent jobs sharing one NVMe never collide. Each file is created with its *final* size up
front (``posix_fallocate``: real blocks, not a sparse hole), so a full or unwritable disk is a
clear error at ``initialize`` naming the path, never a failed write in the middle of training.
Files are removed on normal exit: by ``close()`` (the engine's ``destroy()``) or, failing
that, by an ``atexit`` hook, and on SIGTERM (see [Note: cleanup on SIGTERM]). A swap file that disappears while training (deleted by a cleanup
job, a remounted disk) is reported by name before it is read, instead of reading zeros or
garbage. A process ended by SIGKILL (or ``os._exit``) can remove nothing: its ``job-<pid>``
folder (marked with the host it ran on) is removed by the next swap directory created under the
same ``nvme_path`` on that host once no process of that pid runs there.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import weakref
from pathlib import Path

from zero_core.comm.failures import process_alive
from zero_core.utils.termination import forget, on_termination

#: the ``aio`` config section's settings that an ``AsyncIOHandle`` takes (the others, such as
#: ``use_gds`` and ``intra_op_parallelism``, do not change how a swap file is read or written)
AIO_HANDLE_KEYS = ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")


def aio_handle_settings(aio: dict | None) -> dict:
    """The keyword arguments of ``AsyncIOHandle`` in an ``aio`` section (a dict)."""
    return {k: v for k, v in (aio or {}).items() if k in AIO_HANDLE_KEYS}


class SwapFileError(OSError):
    """A swap file could not be created, is missing, or has the wrong size."""


def job_name() -> str:
    """The ``<job>`` directory name (see [Note: swap file lifecycle])."""
    name = os.environ.get("ZERO_JOB_NAME", "").strip()
    if name:
        if "/" in name or name in (".", ".."):
            raise ValueError(f"ZERO_JOB_NAME must be a plain directory name, got {name!r}")
        return name
    return f"job-{os.getpid()}"


def check_free_space(folder: str | os.PathLike, nbytes: int, what: str) -> None:
    """Raise :class:`SwapFileError` naming ``folder`` unless its file system has ``nbytes`` free.

    For a run planning its disk before it starts (swap files, checkpoints): the error says how
    much is needed, for what, and how much is free. ``folder`` need not exist yet (its nearest
    existing parent's file system is asked)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"check_free_space: nbytes must be an int >= 0, got {nbytes!r}")
    probe = Path(os.fspath(folder)).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < nbytes:
        raise SwapFileError(
            28,
            f"{what}: {folder} needs {nbytes / 1e9:.2f} GB ({nbytes} bytes) free, but its file system "
            f"has {free / 1e9:.2f} GB; free some space or point the run at a larger disk",
        )


def _fallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` real blocks for ``fd`` (posix_fallocate; a write of zeros where unsupported)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as exc:
        # EINVAL / EOPNOTSUPP: the file system cannot preallocate (tmpfs on old kernels, some
        # FUSE mounts); any other errno (ENOSPC, EIO, EROFS) is a real failure.
        if exc.errno not in (22, 95):
            raise
    chunk = b"\0" * (1 << 20)
    os.lseek(fd, 0, os.SEEK_SET)
    left = nbytes
    while left > 0:
        left -= os.write(fd, chunk[: min(left, len(chunk))])
    os.fsync(fd)


_HOST_MARK = ".host"


def _claim_and_sweep(root: Path, job_dir: Path) -> None:
    """Mark ``job_dir`` with this host; remove ``job-<pid>`` folders under ``root`` left by
    processes of this host that ended without cleaning up (see [Note: swap file lifecycle])."""
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        (job_dir / _HOST_MARK).write_text(host)
    try:
        siblings = list(root.iterdir())
    except OSError:
        return
    for d in siblings:
        pid = d.name[4:]
        if d == job_dir or not d.name.startswith("job-") or not pid.isdigit():
            continue
        try:
            if (d / _HOST_MARK).read_text() != host or process_alive(host, int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)


class SwapDirectory:
    """The swap files of one rank under ``nvme_path/<job>/rank<rank>/`` (see [Note: swap file lifecycle])."""

    def __init__(self, nvme_path: str | os.PathLike, rank: int, *, what: str = "offload") -> None:
        if not isinstance(nvme_path, (str, os.PathLike)) or not os.fspath(nvme_path):
            raise ValueError(f"{what}: nvme_path must be a directory path, got {nvme_path!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{what}: rank must be an int >= 0, got {rank!r}")
        self.what = what
        self.root = Path(os.fspath(nvme_path)).expanduser()
        self.job_dir = self.root / job_name()
        self.path = self.job_dir / f"rank{rank}"
        self.files: dict[str, tuple[Path, int]] = {}
        self._closed = False
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SwapFileError(
                exc.errno,
                f"{what}: cannot create the swap directory {self.path} (nvme_path={self.root}): {exc}",
            ) from exc
        _claim_and_sweep(self.root, self.job_dir)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise SwapFileError(
                13, f"{what}: the swap directory {self.path} is not writable (nvme_path={self.root})"
            )
        # atexit holds only a weak reference: a closed or collected directory does nothing.
        ref = weakref.ref(self)
        atexit.register(lambda: (d := ref()) is not None and d.close())
        # SIGTERM runs no atexit hook: see [Note: cleanup on SIGTERM] in zero_core.utils.termination.
        self._termination_key = on_termination(self.close)

    def allocate(self, name: str, nbytes: int) -> Path:
        """Create swap file ``name`` with its final size ``nbytes`` (raises SwapFileError naming it)."""
        if self._closed:
            raise RuntimeError(f"{self.what}: the swap directory {self.path} was closed")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{self.what}: swap file name must be a plain file name, got {name!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{self.what}: swap file size must be an int >= 0, got {nbytes!r}")
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise SwapFileError(exc.errno, f"{self.what}: cannot create swap file {path}: {exc}") from exc
        try:
            if nbytes:
                _fallocate(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise SwapFileError(
                exc.errno,
                f"{self.what}: cannot reserve {nbytes} bytes for swap file {path} "
                f"({os.strerror(exc.errno) if exc.errno else exc}); nvme_path={self.root} needs that much free space",
            ) from exc
        os.close(fd)
        self.files[name] = (path, nbytes)
        return path

    def check(self, name: str) -> Path:
        """The path of swap file ``name``, after checking it still exists with its size."""
        if name not in self.files:
            raise KeyError(f"{self.what}: no swap file named {name!r} in {self.path}")
        path, nbytes = self.files[name]
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise SwapFileError(
                2,
                f"{self.what}: swap file {path} disappeared while training (was it deleted, or the disk "
                "unmounted?); its optimizer/parameter data is lost, restart from the last checkpoint",
            ) from None
        if size < nbytes:
            raise SwapFileError(
                5, f"{self.what}: swap file {path} has {size} bytes, expected {nbytes} (truncated?)"
            )
        return path

    def nbytes(self) -> int:
        """Total bytes reserved by this rank's swap files."""
        return sum(n for _, n in self.files.values())

    def close(self) -> None:
        """Remove this rank's swap files and directory (and the job directory when it is empty).

        Marked closed only once done: a SIGTERM arriving in the middle (a launcher stopping the
        job while this runs at exit) runs it again in full from its handler before the process
        ends (see [Note: cleanup on SIGTERM]); every step is idempotent."""
        if self._closed:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            if not any(p.name != _HOST_MARK for p in self.job_dir.iterdir()):
                (self.job_dir / _HOST_MARK).unlink(missing_ok=True)
            self.job_dir.rmdir()  # only succeeds once every rank of this job has cleaned up
        except OSError:
            pass
        self._closed = True
        forget(self._termination_key)
