"""The ``ShardStore`` protocol: where a stage-3 parameter's shard lives between gathers.

[Note: shard store seam]
Each stage-3 parameter record (``PartitionState``, see [Note: stage 3 parameter layout]) names
the store that holds its shard, ``st.store``. Three stores exist:

* :class:`PlainShards` (``PLAIN_SHARDS``, every record's default): ``st.shard`` is a device
  tensor that always holds the values; fetching and releasing do nothing, reads and writes use
  the tensor itself.
* zero-offload's ``ParamOffload`` (``zero_optimization.offload_param``): the values live in CPU
  memory or on NVMe ([Note: parameter offload] there).
* ``QuantizedShardStore`` (``zero_quantized_nontrainable_weights``): frozen shards kept int8
  ([Note: quantized frozen shards]).

The last two are *transient* stores: ``st.shard``'s storage holds memory only between
:meth:`~ShardStore.fetch` (just before a gather packs it) and :meth:`~ShardStore.release`
(right after). Every other access to the values goes through :meth:`~ShardStore.read` /
:meth:`~ShardStore.write` (zero-core's ``read_shard`` / ``write_shard``). So the stage-3 code
asks the record's store and never ``if offloaded`` (as FSDP2's ``OffloadPolicy`` beside
``CPUOffloadPolicy``; the optimizer's counterpart is [Note: optimizer offload seam]). The calls
on the gather path take the record, already in hand, so a plain shard costs one no-op call
where there was an ``is None`` test.

A store takes shards over with :meth:`~ShardStore.adopt` (a shard another non-plain store holds
is left there), and hands one back as a plain tensor of another dtype with
:meth:`~ShardStore.set_dtype` (the strategy's training dtype after ``zero.Init`` placed it; a
store may re-adopt it at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from zero_core.zero.stage3.partitioned_param import PartitionState


@runtime_checkable
class ShardStore(Protocol):
    """See [Note: shard store seam]."""

    #: True when ``st.shard`` holds memory only between :meth:`fetch` and :meth:`release`
    transient: bool

    def adopt(self, params: list[torch.nn.Parameter]) -> None:
        """Take over the shards of the partitioned ``params`` that the plain store holds."""
        ...

    def follow(self, coordinator: Any) -> None:
        """Read ahead in ``coordinator``'s recorded module order (stores that read ahead)."""
        ...

    def fetch(self, st: PartitionState) -> None:
        """Make ``st.shard`` hold the values on the device (before a gather packs it)."""
        ...

    def release(self, st: PartitionState) -> None:
        """Drop what :meth:`fetch` brought (after the gather packed it)."""
        ...

    def fetch_bucket(self, states: list[PartitionState]) -> None:
        """:meth:`fetch` every shard of one gather's bucket, in order (a store that reads ahead
        starts the bucket's reads together, and the next ones once the bucket is in)."""
        ...

    def read(self, st: PartitionState) -> torch.Tensor:
        """The shard's values, padding included: the shard itself (read-only) or a new tensor."""
        ...

    def write(self, st: PartitionState, values: torch.Tensor) -> None:
        """Set the shard to ``values`` (flat, at least the shard's length; cast to its dtype)."""
        ...

    def set_dtype(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        """Before ``set_shard_dtype`` casts ``p``'s shard to ``dtype``: hand it back as a plain
        tensor (the caller casts it), or keep it, re-homed in ``dtype`` at once."""
        ...

    def memory_breakdown(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class PlainShards:
    """The :class:`ShardStore` of shards kept as they are on the device (the default store).

    See [Note: shard store seam]. It holds no state: one instance, ``PLAIN_SHARDS``, serves
    every record.
    """

    transient = False

    def adopt(self, params: list[torch.nn.Parameter]) -> None:
        pass  # every record starts here

    def follow(self, coordinator: Any) -> None:
        pass

    def fetch(self, st: PartitionState) -> None:
        pass  # the values are on the device already

    def release(self, st: PartitionState) -> None:
        pass

    def fetch_bucket(self, states: list[PartitionState]) -> None:
        pass

    def read(self, st: PartitionState) -> torch.Tensor:
        return st.shard

    @torch.no_grad()
    def write(self, st: PartitionState, values: torch.Tensor) -> None:
        st.shard.copy_(values.reshape(-1)[: st.shard.numel()])

    def set_dtype(self, p: torch.nn.Parameter, dtype: torch.dtype) -> None:
        pass  # already a plain tensor: the caller casts it

    def memory_breakdown(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


PLAIN_SHARDS = PlainShards()
