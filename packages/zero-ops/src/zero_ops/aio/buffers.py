"""Page-aligned CPU buffers, as O_DIRECT needs (buffer address, file offset and size aligned)."""

from __future__ import annotations

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
