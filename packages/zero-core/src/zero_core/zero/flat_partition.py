"""The flat, padded layout of a parameter group and which part of it each rank owns.

[Note: padding]
ZeRO stages 1 and 2 (and the shard math of stage 3) view the trainable parameters of one
optimizer parameter group as a single flat vector of ``numel`` elements, in a fixed order
that every rank agrees on. The vector is cut into *chunks* of ``chunk_numel`` elements
(the gradient reduce bucket); every chunk size is rounded up to a multiple of the world
size ``N``, so only the last chunk needs padding, at its end, and the total padded length
is ``ceil(numel / N) * N``. Rank ``r`` owns the ``r``-th of the ``N`` equal pieces of every
chunk. Consequences the callers rely on:

* a reduce-scatter of one chunk's gradients hands every rank exactly its piece, and an
  all-gather of the pieces rebuilds the chunk in place, with equal sizes on every rank;
* no padding sits between two parameters, so every parameter is a contiguous view of the
  padded buffer (this is what lets the 16-bit parameters live in one flat buffer that the
  all-gather writes straight into);
* a rank's shard is the concatenation of its pieces; with a single chunk (``chunk_numel``
  None or >= numel) it is the classic range ``[r * numel_padded / N, (r + 1) * ...)``;
* padding elements have zero gradient and zero value, so element-wise optimizers (Adam,
  AdamW, SGD with momentum, weight decay) keep them at zero and they never affect a result.

This module is pure arithmetic (no tensors, no communication) so stage 3 can reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"FlatPartition: {name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ParamSlice:
    """The part of parameter ``param_index`` (flat elements ``[param_lo, param_hi)``) in a chunk,
    starting at ``chunk_lo`` within the chunk."""

    param_index: int
    param_lo: int
    param_hi: int
    chunk_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


@dataclass(frozen=True)
class Chunk:
    """One reduce bucket of a group: padded flat range ``[start, start + padded)``, ``numel`` real
    elements, ``piece = padded / N`` elements per rank, and the parameter slices it holds."""

    index: int
    start: int
    numel: int
    padded: int
    piece: int
    slices: tuple[ParamSlice, ...]

    def piece_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s elements of this chunk, as offsets into the group's padded flat buffer."""
        lo = self.start + rank * self.piece
        return lo, lo + self.piece


class FlatPartition:
    """The layout of ``numels`` (one entry per parameter, in flat order) over ``world_size`` ranks.

    See [Note: padding]. ``chunk_numel`` is the reduce bucket size in elements (None: one chunk).
    """

    def __init__(self, numels: Sequence[int], world_size: int, chunk_numel: int | None = None) -> None:
        self.world_size = _check_int(world_size, "world_size", 1)
        self.numels = [_check_int(n, f"numels[{i}]", 0) for i, n in enumerate(numels)]
        self.numel = sum(self.numels)
        n = self.world_size
        if chunk_numel is None or chunk_numel >= self.numel:
            step = max(self.numel, 1)
        else:
            step = _check_int(chunk_numel, "chunk_numel", 1)
        step = -(-step // n) * n  # every chunk but the last is a multiple of N: no inner padding
        self.offsets: list[int] = []
        off = 0
        for k in self.numels:
            self.offsets.append(off)
            off += k
        self.chunks: list[Chunk] = []
        self.shard_offsets: list[int] = []  # offset of each chunk's piece within a rank's shard
        shard = 0
        start = 0
        p = 0  # first parameter that may overlap the current chunk
        while start < self.numel:
            end = min(start + step, self.numel)
            padded = -(-(end - start) // n) * n
            slices = []
            while p < len(self.numels) and self.offsets[p] + self.numels[p] <= start:
                p += 1
            q = p
            while q < len(self.numels) and self.offsets[q] < end:
                lo = max(start, self.offsets[q])
                hi = min(end, self.offsets[q] + self.numels[q])
                if hi > lo:
                    slices.append(ParamSlice(q, lo - self.offsets[q], hi - self.offsets[q], lo - start))
                q += 1
            self.chunks.append(
                Chunk(len(self.chunks), start, end - start, padded, padded // n, tuple(slices))
            )
            self.shard_offsets.append(shard)
            shard += padded // n
            start = end
        self.shard_numel = shard
        self.padded_numel = shard * n

    def chunks_of_param(self, param_index: int) -> list[tuple[Chunk, ParamSlice]]:
        """Every chunk holding part of parameter ``param_index``, with the slice it holds."""
        out = []
        for chunk in self.chunks:
            for s in chunk.slices:
                if s.param_index == param_index:
                    out.append((chunk, s))
        return out

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank`` in the padded flat buffer; only defined for one chunk."""
        _check_int(rank, "rank", 0)
        if rank >= self.world_size:
            raise ValueError(
                f"FlatPartition.rank_range: rank {rank} is not below world_size {self.world_size}"
            )
        if len(self.chunks) > 1:
            raise ValueError("FlatPartition.rank_range: the layout has several chunks; use Chunk.piece_range")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def __repr__(self) -> str:
        return (
            f"FlatPartition(numel={self.numel}, padded={self.padded_numel}, world_size={self.world_size}, "
            f"chunks={len(self.chunks)}, shard={self.shard_numel})"
        )
