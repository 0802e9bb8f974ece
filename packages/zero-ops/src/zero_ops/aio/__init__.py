"""Asynchronous file I/O for NVMe offload (``zero.ops.aio``; DeepSpeed's ``async_io`` op)."""

from zero_ops.aio.buffers import aligned_empty, is_aligned, is_locked, lock_failure, locked_empty
from zero_ops.aio.handle import AsyncIOHandle, aio_handle

__all__ = [
    "AsyncIOHandle",
    "aio_handle",
    "aligned_empty",
    "is_aligned",
    "is_locked",
    "lock_failure",
    "locked_empty",
]
