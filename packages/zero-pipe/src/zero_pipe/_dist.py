"""The one place zero-pipe reaches the communication layer.

Every collective and point-to-point op of the project goes through ``zero_core.comm`` (so the
comms logger sees it); this module re-exports the names zero-pipe uses, so tests and tools can
see at a glance which ops the pipeline needs.
"""

from __future__ import annotations

from zero_core.comm import (
    ReduceOp,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    get_global_rank,
    get_rank,
    get_world_size,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    send,
)

__all__ = [
    "ReduceOp",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "get_global_rank",
    "get_rank",
    "get_world_size",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "send",
]
