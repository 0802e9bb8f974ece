"""Keep freed host memory from piling up in the C heap while training beyond memory.

[Note: host heap under NVMe offload]
PyTorch's CPU tensors come from ``malloc``. glibc serves blocks below its mmap threshold from
heaps that it gives back to the kernel only from their top, and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed: after the first freed tensor of a few MiB,
every tensor up to that size lives in a heap. Short-lived tensors of many sizes (a layer
initialised under ``zero.Init``, a shard staged for a swap file, a gradient bucket) then leave
the heap fragmented at about the size of everything that ever passed through it. Measured:
building a 200M-parameter GPT under ``zero.Init(remote_device="nvme")`` on 2 ranks left
410-460 MiB of RSS per rank (the whole fp32 model is 770 MiB, the rank's live tensors 20 MiB),
all of it freed memory that ``malloc_trim`` gives back; training then grew it further.

With NVMe offload, host memory is the very resource being saved, so zero-offload fixes the
threshold when it sets NVMe offload up (:func:`bound_host_heap`, called by ``ParamOffload`` and
``OptimizerOffload`` with ``device: nvme``): ``mallopt(M_MMAP_THRESHOLD)`` sets it and turns the
dynamic raise off. Tensors above it are mmapped and returned to the kernel when freed; smaller
ones keep the heap's fast path. The value is ``ZERO_MMAP_THRESHOLD`` (bytes) or 128 KiB (glibc's
own starting value, kept from then on); ``0`` leaves malloc alone. Measured on a 50M-parameter
GPT in bf16 (2 ranks, NVMe offload of both): peak growth above the warmed-up process of one
training step 46 MiB per rank at 128 KiB, 75 MiB at 1 MiB (heap fragments); forward + backward
times of the same GPT without ZeRO differed by less than the noise of a loaded machine
between 128 KiB, 1 MiB and glibc's dynamic threshold. It is a process-wide setting (the same as glibc's ``MALLOC_MMAP_THRESHOLD_``
environment variable, which wins when set); other C libraries are left alone. The cost is a
page fault per 4 KiB the first time a large tensor is touched, small next to the computation
that fills it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_DEFAULT = 128 << 10
_applied: int | None = None


def mmap_threshold() -> int:
    """The threshold :func:`bound_host_heap` sets: ``ZERO_MMAP_THRESHOLD`` bytes, default 128 KiB."""
    raw = os.environ.get("ZERO_MMAP_THRESHOLD", "").strip()
    if not raw:
        return _DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0 or value > 2**31 - 1:
        raise ValueError(
            f"ZERO_MMAP_THRESHOLD must be a byte count from 0 (leave malloc alone) to 2147483647, got {raw!r}"
        )
    return value


def bound_host_heap() -> int | None:
    """Fix glibc's mmap threshold (See [Note: host heap under NVMe offload]); returns the value
    set, or None when nothing was done (``ZERO_MMAP_THRESHOLD=0``, ``MALLOC_MMAP_THRESHOLD_``
    already set, or not glibc). Idempotent."""
    global _applied
    value = mmap_threshold()
    if value == 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    if _applied == value:
        return value
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, value):
        return None
    _applied = value
    return value
