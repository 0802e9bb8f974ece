"""The table of stage-3 partition records: which :class:`PartitionState` belongs to a parameter.

[Note: stage 3 parameter records]
Stage 3's per-parameter state (shard, gather buffer, status, group, offload and route; see
[Note: stage 3 parameter layout]) is a typed :class:`~zero_core.zero.stage3.partitioned_param.
PartitionState` record, kept in a :class:`PartitionRecords` table and never patched onto the
``nn.Parameter`` (FSDP2 keeps its ``FSDPParam`` records in the ``FSDPParamGroup`` the same way).
The parameter keeps only the public read-only names users know: ``zero_shard``, ``zero_numel``
and ``zero_shape`` (DeepSpeed's ``ds_tensor``, ``ds_numel``, ``ds_shape``); internal code reads
the record, never those.

Owner and lifetime. Records are created by partitioning, which ``zero.Init`` does before any
engine exists, so the table belongs to the process's :class:`Stage3Context` (see
[Note: stage 3 runtime context]) and holds parameters *weakly, by identity*: an entry lives
exactly as long as its parameter, so a dropped model leaves none behind. The stage-3 strategy
that trains a parameter is its record's ``owner`` (a weak reference: a record must never keep
a model alive); it sets itself when built, replacing an earlier engine over the same
parameters, and clears itself in ``close()`` (the engine's ``destroy()``). ``GatheredParameters``
asks the owner to refresh its master after a modifier changed a shard. A parameter outliving
``destroy()`` stays partitioned (its record stays), and ``GatheredParameters`` still works on
it. Nothing reachable only from C++ may hold the strategy strongly (the parameters' gradient
hooks hold it weakly, see ``hooks._weak_grad_hook``): such a reference is invisible to the
cycle collector and kept every stage-3 model of a process alive, with its records, until exit.

Lookup cost. The table is a plain dict keyed by ``id(param)`` whose entries a weak reference's
callback removes when the parameter is freed (ids are unique among live objects, and the
callback runs before the memory, hence the id, can be reused). The hot paths (coordinator,
hooks, gathers, gradient buckets) read that dict inline, ``RECORDS_BY_ID[id(p)]``: about
60 ns, some 30 ns more than the ``p.zero_state`` attribute read it replaces, where a
``torch.utils.weak.WeakIdKeyDictionary`` lookup takes ~2 us. They take a parameter's record
once per gather bucket or module event and work on it from then on (``GatherHandle.states``),
and the strategy's step loops over ``Stage3Strategy.records``, a list built once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zero_core.zero.stage3.partitioned_param import PartitionState


class PartitionRecords:
    """Parameter -> its :class:`PartitionState`, held weakly by identity.
    See [Note: stage 3 parameter records]."""

    def __init__(self) -> None:
        self._states: dict[int, PartitionState] = {}
        self._refs: dict[int, weakref.ref] = {}  # keep the callbacks alive

    def add(self, param: torch.nn.Parameter, state: PartitionState) -> None:
        """Record ``state`` as ``param``'s partition state (until ``param`` is freed)."""
        key = id(param)
        states, refs = self._states, self._refs

        def _drop(_ref: weakref.ref, key: int = key) -> None:
            if refs.get(key) is _ref:
                del refs[key]
                states.pop(key, None)

        refs[key] = weakref.ref(param, _drop)
        states[key] = state

    def get(self, param: Any) -> PartitionState | None:
        """``param``'s record, or None when it is not a partitioned parameter."""
        return self._states.get(id(param))

    def __getitem__(self, param: Any) -> PartitionState:
        return self._states[id(param)]

    def __contains__(self, param: Any) -> bool:
        return id(param) in self._states

    def __len__(self) -> int:
        return len(self._states)

    def params(self) -> list[torch.nn.Parameter]:
        """The live partitioned parameters (for diagnostics and tests)."""
        return [p for p in (r() for r in list(self._refs.values())) if p is not None]


# The process's one table (Stage3Context.records); entries live as long as their parameters.
PARTITION_RECORDS = PartitionRecords()
# The table's dict itself, for the hot paths (per-module and per-bucket loops of the coordinator,
# hooks, gathers and gradient buckets): ``RECORDS_BY_ID[id(p)]`` / ``id(p) in RECORDS_BY_ID`` cost
# what an attribute read does, without the Python call of :func:`partition_state`. Read-only.
RECORDS_BY_ID: dict[int, PartitionState] = PARTITION_RECORDS._states


def is_partitioned(param: Any) -> bool:
    """Whether ``param`` is a parameter partitioned by ZeRO stage 3 (``zero.Init`` or an engine)."""
    return id(param) in RECORDS_BY_ID


def partition_state(param: Any) -> PartitionState:
    """The :class:`PartitionState` record of a partitioned parameter
    (See [Note: stage 3 parameter records])."""
    st = RECORDS_BY_ID.get(id(param))
    if st is None:
        raise ValueError(
            f"partition_state: the {type(param).__name__} of shape {tuple(getattr(param, 'shape', ()))} is not "
            "partitioned by ZeRO stage 3 (zero.Init or a stage-3 engine partitions parameters)"
        )
    return st


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """``param``'s full shape: its record's while partitioned (``param.shape`` is then empty)."""
    st = RECORDS_BY_ID.get(id(param))
    return tuple(param.shape if st is None else st.shape)


__all__ = [
    "PARTITION_RECORDS",
    "RECORDS_BY_ID",
    "PartitionRecords",
    "full_shape",
    "is_partitioned",
    "partition_state",
]
