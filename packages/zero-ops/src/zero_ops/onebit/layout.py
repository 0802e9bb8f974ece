"""The flat buffer one compressed all-reduce exchanges for a parameter group.

[Note: chunk-major layout]
``compressed_all_reduce`` sends chunk ``i`` of a flat buffer to rank ``i`` (see [Note:
compressed all-reduce]). If parameters were laid end to end, one rank would own the
embedding and another the layer norms. Here every tensor is cut into ``world_size`` equal
pieces (zero-padded to ``c = ceil(numel / world_size)``) and piece ``i`` goes into chunk
``i``, at the same column offset in every chunk: the buffer is a ``(world_size, L)`` matrix
whose columns ``[off, off + c)`` hold one tensor. The server work is then spread evenly, and a
segment per tensor gives it its own scale inside each chunk. ``L`` is rounded up
to a multiple of 8 so each chunk packs into whole bytes; padding columns belong to the last
tensor's segment and are dropped when the result is copied back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from zero_core.comm.compressed import padded_numel


class ChunkLayout:
    """Where each of ``tensors`` lives in a ``(world_size, width)`` buffer; see [Note: chunk-major layout]."""

    def __init__(self, numels: Sequence[int], world_size: int, device: torch.device) -> None:
        if not numels:
            raise ValueError("ChunkLayout: no tensors to lay out")
        self.world_size = world_size
        self.numels = list(numels)
        self.chunks = [-(-n // world_size) for n in self.numels]
        self.offsets = [sum(self.chunks[:k]) for k in range(len(self.chunks))]
        self.width = padded_numel(sum(self.chunks) * world_size, world_size) // world_size
        # one segment (one scale per chunk) per tensor; the padding joins the last one
        self.segment_sizes = [*self.chunks[:-1], self.chunks[-1] + self.width - sum(self.chunks)]
        self.device = device

    @property
    def numel(self) -> int:
        """Elements of the whole flat buffer (``world_size * width``)."""
        return self.world_size * self.width

    def gather(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A new flat buffer holding ``tensors`` (zeros in the padding)."""
        buf = torch.zeros(self.world_size, self.width, dtype=dtype, device=self.device)
        for t, off, c, numel in zip(tensors, self.offsets, self.chunks, self.numels):
            flat = t.reshape(-1)
            rows, rest = divmod(numel, c)
            buf[:rows, off : off + c].copy_(flat[: rows * c].view(rows, c))
            if rest:
                buf[rows, off : off + rest].copy_(flat[rows * c :])
        return buf.view(-1)

    def scatter(self, buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the flat buffer ``buf`` back into ``tensors`` (the inverse of :meth:`gather`)."""
        grid = buf.view(self.world_size, self.width)
        for t, off, c, numel in zip(tensors, self.offsets, self.chunks, self.numels):
            piece = grid[:, off : off + c].reshape(-1)[:numel]
            t.copy_(piece.view_as(t))
