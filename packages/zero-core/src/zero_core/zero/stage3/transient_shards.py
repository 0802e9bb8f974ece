"""``TransientShards``: what the shard stores that keep values off ``st.shard`` share.

zero-offload's ``ParamOffload`` ([Note: parameter offload]) and the int8 store of frozen weights
([Note: quantized frozen shards]) are transient :class:`~zero_core.protocols.shard_store.ShardStore`
implementations (See [Note: shard store seam]): ``st.shard`` keeps its tensor object, dtype and
device, but its storage holds memory only between :meth:`TransientShards.fetch` and
:meth:`TransientShards.release`. This base owns that life cycle, once; a store says where the
values come from (:meth:`TransientShards._fill`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zero_core.accelerator import get_accelerator

if TYPE_CHECKING:
    from zero_core.zero.stage3.partitioned_param import PartitionState


class TransientShards:
    """Base of the transient shard stores; see the module docstring."""

    transient = True
    coordinator: Any = None

    def follow(self, coordinator: Any) -> None:
        """Remember the coordinator whose recorded module order a store may read ahead in."""
        self.coordinator = coordinator

    @torch.no_grad()
    def fetch(self, st: PartitionState) -> None:
        """Allocate ``st.shard``'s storage and fill it with the values (before a gather packs it)."""
        if st.shard.untyped_storage().nbytes() > 0:
            return
        st.shard.untyped_storage().resize_(st.shard_numel * st.shard.element_size())
        self._fill(st)

    def fetch_bucket(self, states: list[PartitionState]) -> None:
        """:meth:`fetch` each shard of a gather's bucket (stores that read ahead override it)."""
        for st in states:
            self.fetch(st)

    def release(self, st: PartitionState) -> None:
        """Drop the device copy (the store holds the values)."""
        # The stream that packs it may still read it: the block is not reused before that work
        # is done (no host wait; See [Note: stage-3 streams]).
        acc = get_accelerator()
        acc.record_stream(st.shard, acc.current_stream())
        st.shard.untyped_storage().resize_(0)

    def _fill(self, st: PartitionState) -> None:
        """Write the shard's values into ``st.shard`` (its storage is allocated)."""
        raise NotImplementedError(f"{type(self).__name__} must say where a fetched shard's values come from")
