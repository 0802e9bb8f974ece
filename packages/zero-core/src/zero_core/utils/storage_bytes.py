"""Count the bytes behind tensors by storage, each storage once.

[Note: memory breakdown counts storages]
``memory_breakdown()`` reports what a rank holds, by category (parameters, gradients, master
weights, optimizer states, buffers). The same memory is often reachable through several
tensors: stage 0's gradients are views into its bucket buffers, stage 1/2's gradients views into
a flat gradient buffer, an fp32 master shard may be the parameter's own storage, a stage-3
shard a view into a flat group buffer. Summing ``numel * element_size`` per tensor counts such
memory twice (a view and its base) or misses padding (views that do not cover the whole base).

So every breakdown goes through one :class:`StorageLedger`: a storage counts with its full
``nbytes()`` once, in the first category that reaches it, and categories are visited in a fixed
order (parameters, gradients, masters, optimizer states, buffers). The sum of a breakdown is then
the bytes of distinct storages alive on the rank, which is what tests compare against the
storages found alive by the garbage collector and what benchmarks compare against DDP/FSDP2.
Storages with no memory (meta tensors, storages resized to 0 after a release, offloaded shards)
count 0. Peaks are not storages alive and are reported apart (``memory_peaks()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def _key(t: torch.Tensor) -> tuple[str, int] | None:
    storage = t.untyped_storage()
    if storage.nbytes() == 0 or t.device.type == "meta":
        return None
    return (str(t.device), storage.data_ptr())


class StorageLedger:
    """Adds up storage bytes by category, counting each storage once across all categories."""

    def __init__(self, exclude: Iterable[torch.Tensor | None] = ()) -> None:
        self._seen: set[tuple[str, int]] = set()
        self.categories: dict[str, int] = {}
        self.count(exclude)  # storages reported elsewhere (e.g. host pools of an offload)

    def count(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Bytes of the storages behind ``tensors`` not counted before (and marks them counted)."""
        total = 0
        for t in tensors:
            if t is None:
                continue
            key = _key(t)
            if key is None or key in self._seen:
                continue
            self._seen.add(key)
            total += t.untyped_storage().nbytes()
        return total

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> int:
        """Count ``tensors`` under ``category`` (added to what the category holds already)."""
        n = self.count(tensors)
        self.categories[category] = self.categories.get(category, 0) + n
        return n


def state_tensors(
    optimizer: torch.optim.Optimizer, owned: Callable[[torch.Tensor], bool]
) -> list[torch.Tensor]:
    """The tensors in ``optimizer.state`` of the parameters for which ``owned(param)`` holds."""
    return [t for p, s in optimizer.state.items() if owned(p) for t in s.values() if torch.is_tensor(t)]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return StorageLedger().count(tensors)
