"""Whether two tensors share memory, for the collectives that may run in place.

torch documents in-place forms of the sharded collectives: an all-gather whose input is the
output's rank-th slice, a reduce-scatter whose output is the input's rank-th slice. Any other
overlap between input and output is undefined, so callers either copy or take another path.
"""

from __future__ import annotations

import torch


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share bytes of the same storage."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


def apart_or_slot(full: torch.Tensor, piece: torch.Tensor, slot: int) -> bool:
    """Whether ``piece`` shares no memory with ``full``, or is exactly ``full``'s ``slot``-th
    ``piece``-sized slice (both contiguous, one dtype): the layouts a sharded collective may be
    handed with ``full`` and ``piece`` as its two buffers."""
    if not overlaps(full, piece):
        return True
    return (
        piece.dtype == full.dtype
        and piece.is_contiguous()
        and full.is_contiguous()
        and piece.data_ptr() == full.data_ptr() + slot * piece.numel() * piece.element_size()
    )
