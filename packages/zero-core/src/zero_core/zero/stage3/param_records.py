"""Stage-3 partition records: who owns them, and how a parameter finds its own.

[Note: stage 3 parameter records]
Stage 3's per-parameter state (shard, gather buffer, status, group, offload and route; see
[Note: stage 3 parameter layout]) is a typed :class:`~zero_core.zero.stage3.partitioned_param.
PartitionState` record. There is no process-wide table of records: the object that partitions
parameters owns their records, as FSDP2's ``FSDPParamGroup`` owns its ``FSDPParam``s.

Owners. A ``Stage3Strategy`` owns the records of the parameters it trains: ``strategy.records``,
in parameter order, which the step, the checkpoints and the memory report loop over. ``zero.Init``
partitions before any engine exists, so it owns the records it made (``init.records``) until
an engine takes them: the strategy built at ``initialize`` over those parameters adopts them
(:meth:`RecordOwner.hand_over`) and the context forgets them. Each record names its current
owner with a *weak* ``record.owner`` (``record.owner_of()``): ``GatheredParameters`` asks it to
refresh its master after a modifier changed a shard, and a gather asks it how to fetch
([Note: all-reduce fetch]). A strategy built later over the same parameters becomes their owner
(the earlier one keeps its list); ``close()`` (the engine's ``destroy()``) clears the owner of
the records it still owns.

Lookup. A parameter reaches its record through the private attribute ``_zero_record`` (set by
``partition_param``; :func:`record_of`, :func:`partition_state`, :func:`is_partitioned`): the
record is the parameter's storage, as an FSDP2 sharded parameter holds its local shard, so it
lives exactly as long as the parameter, and a parameter outliving its engine's ``destroy()``
stays partitioned (``GatheredParameters`` still works on it). The hot paths (coordinator,
hooks, gathers, gradient buckets) read ``p._zero_record`` inline (an attribute read, ~50 ns),
take a parameter's record once per gather bucket or module event and work on it from then on
(``GatherHandle.states``); the strategy's step loops over ``Stage3Strategy.records``.
Besides ``_zero_record`` (and ``_zero_owner`` of [Note: parameter owners]) the parameter keeps
only the public read-only names users know: ``zero_shard``, ``zero_numel`` and ``zero_shape``
(DeepSpeed's ``ds_tensor``, ``ds_numel``, ``ds_shape``); internal code reads the record.

Lifetime. Nothing but the parameter, its owners and the gathers in flight holds a record; a
record never holds its parameter, and holds its owner weakly, so an engine and its model, once
dropped, leave nothing behind (``tests/test_stage3_two_engines.py``). Nothing reachable only from
C++ may hold the strategy strongly (the parameters' gradient hooks hold it weakly, see
``hooks._weak_grad_hook``): such a reference is invisible to the cycle collector and would
keep the model, the strategy and the records alive until exit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from zero_core.zero.stage3.partitioned_param import PartitionState


class RecordOwner(Protocol):
    """What a record's owner (``Stage3Strategy`` or ``zero.Init``) answers.
    See [Note: stage 3 parameter records]."""

    fetch_by_all_reduce: bool  # See [Note: all-reduce fetch]

    def on_shard_changed(self, param: torch.nn.Parameter) -> None:
        """``param``'s shard was rewritten outside the optimizer (a ``GatheredParameters`` modifier)."""

    def hand_over(self, records: Iterable[PartitionState]) -> None:
        """A newer owner took ``records``: stop owning them."""


def attach_record(param: torch.nn.Parameter, state: PartitionState) -> None:
    """Make ``state`` the record ``param`` reaches (See [Note: stage 3 parameter records])."""
    param._zero_record = state  # type: ignore[attr-defined]


def record_of(param: object) -> PartitionState | None:
    """``param``'s record, or None when it is not a partitioned parameter."""
    return getattr(param, "_zero_record", None)


def is_partitioned(param: object) -> bool:
    """Whether ``param`` is a parameter partitioned by ZeRO stage 3 (``zero.Init`` or an engine)."""
    return getattr(param, "_zero_record", None) is not None


def partition_state(param: object) -> PartitionState:
    """The :class:`PartitionState` record of a partitioned parameter
    (See [Note: stage 3 parameter records])."""
    st = getattr(param, "_zero_record", None)
    if st is None:
        raise ValueError(
            f"partition_state: the {type(param).__name__} of shape {tuple(getattr(param, 'shape', ()))} is not "
            "partitioned by ZeRO stage 3 (zero.Init or a stage-3 engine partitions parameters)"
        )
    return st


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """``param``'s full shape: its record's while partitioned (``param.shape`` is then empty)."""
    st = getattr(param, "_zero_record", None)
    return tuple(param.shape if st is None else st.shape)


__all__ = [
    "RecordOwner",
    "attach_record",
    "full_shape",
    "is_partitioned",
    "partition_state",
    "record_of",
]
