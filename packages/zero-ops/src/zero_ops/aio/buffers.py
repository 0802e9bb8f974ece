"""Page-aligned CPU buffers, as O_DIRECT needs (buffer address, file offset and size aligned)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import warnings
import weakref

import torch

ALIGNMENT = 4096


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32, alignment: int = ALIGNMENT) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on an ``alignment``-byte boundary.

    The tensor is a view into a slightly larger byte buffer, which it keeps alive.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty: numel must be an int >= 0, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment < 1
        or alignment & (alignment - 1)
    ):
        raise ValueError(f"aligned_empty: alignment must be a power of two, got {alignment!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + nbytes].view(dtype)


def is_aligned(t: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """Whether ``t``'s data pointer is a multiple of ``alignment``."""
    return t.data_ptr() % alignment == 0


# [Note: locked buffers]
# DeepSpeed's new_cpu_locked_tensor returns page-locked (pinned) memory: the accelerator can DMA
# from it and the kernel never swaps it out mid-transfer. Here:
#   * with CUDA present, torch's pinned allocator (cudaHostAlloc) gives exactly that;
#   * otherwise the buffer is an anonymous mmap (page-aligned, so O_DIRECT works on it) locked
#     with mlock(2). Freeing the tensor unmaps it, which also unlocks it.
# mlock fails when the process's RLIMIT_MEMLOCK (``ulimit -l``) is too small or the sandbox
# forbids it. Locking is an optimisation, not a correctness need, so the buffer is then returned
# unlocked (still page-aligned) and one RuntimeWarning per process says why and how to fix it;
# ``is_locked(t)`` tells which happened, ``lock_failure()`` gives the reason.

# id(tensor) -> how it is locked; entries leave with their tensor (tensors compare elementwise,
# so they cannot be keys of a WeakKeyDictionary).
_locked: dict[int, str] = {}
_lock_failure = ""
_warned_lock = False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mlock(address: int, nbytes: int) -> int:
    """mlock(2); returns 0 on success, else the errno."""
    if not hasattr(_libc(), "mlock"):
        return errno.ENOSYS
    rc = _libc().mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))
    return 0 if rc == 0 else ctypes.get_errno()


def _memlock_limit_text() -> str:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return "RLIMIT_MEMLOCK unknown"

    def fmt(v: int) -> str:
        return "unlimited" if v == getattr(resource, "RLIM_INFINITY", -1) else f"{v} bytes"

    return f"RLIMIT_MEMLOCK soft={fmt(soft)}, hard={fmt(hard)}"


def _remember(t: torch.Tensor, how: str) -> torch.Tensor:
    _locked[id(t)] = how
    weakref.finalize(t, _locked.pop, id(t), None)
    return t


def locked_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised, page-aligned 1-D CPU tensor, page-locked when the system allows it.

    See [Note: locked buffers]: pinned through torch when CUDA is available, mlock(2)-ed
    otherwise; if locking is refused the buffer is returned unlocked with a one-time warning.
    """
    global _lock_failure, _warned_lock
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"locked_empty: numel must be an int >= 0, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"locked_empty: dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    if torch.cuda.is_available():
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        shift = (-raw.data_ptr()) % ALIGNMENT
        out = raw[shift : shift + nbytes].view(dtype)
        return _remember(out, "pinned by torch (cudaHostAlloc)")
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, (nbytes + page - 1) // page * page)
    # frombuffer keeps `region` alive as long as the tensor (and its views) live.
    out = torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype)
    err = _mlock(out.data_ptr(), nbytes)
    if err == 0:
        return _remember(out, "mlock")
    _lock_failure = (
        f"mlock of {nbytes} bytes failed: {os.strerror(err)} (errno {err}); {_memlock_limit_text()}"
    )
    if not _warned_lock:
        _warned_lock = True
        warnings.warn(
            f"zero_ops: could not page-lock an I/O buffer ({_lock_failure}); using unlocked "
            "page-aligned memory instead (O_DIRECT still works, pages may be swapped). Raise the "
            "limit (`ulimit -l unlimited`, or `--ulimit memlock=-1` for containers) to lock.",
            RuntimeWarning,
            stacklevel=3,
        )
    return out


def is_locked(t: torch.Tensor) -> bool:
    """Whether ``t`` came from :func:`locked_empty` and is page-locked (pinned or mlock-ed)."""
    return id(t) in _locked


def lock_failure() -> str:
    """Why the last :func:`locked_empty` call could not lock its buffer ('' if none failed)."""
    return _lock_failure
