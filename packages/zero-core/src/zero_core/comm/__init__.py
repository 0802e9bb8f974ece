"""``zero_core.comm``: every collective of the project goes through here.

Functions mirror ``torch.distributed`` names and arguments (so code reads like plain torch),
validate their inputs, work around backend gaps (see [Note: backend workarounds] in
``collectives.py``) and report to ``comms_logger`` (see [Note: what the comms logger counts]
in ``logger.py``). Asynchronous calls return a ``zero_core.comm.Work``.

This module satisfies ``zero_core.protocols.CommBackend``.
"""

from __future__ import annotations

from zero_core.comm import watchdog
from zero_core.comm.collectives import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    monitored_barrier,
    reduce,
    reduce_scatter_tensor,
)
from zero_core.comm.compressed import compressed_all_reduce, padded_numel
from zero_core.comm.device_check import CommDeviceError, device_check_enabled, set_device_check
from zero_core.comm.groups import (
    ProcessGroup,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_rank,
    get_world_size,
    group_ranks,
    is_initialized,
    new_group,
)
from zero_core.comm.logger import OP_NAMES, CommsLogger, Stats, comms_logger
from zero_core.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from zero_core.comm.watchdog import CollectiveTimeoutError, CollectiveWatchdog, PeerFailedError
from zero_core.comm.work import Work


def log_summary(print_fn=print) -> None:  # noqa: ANN001 (mirrors deepspeed.comm.log_summary)
    """Print the comms logger's table (DeepSpeed's ``comm.log_summary()``)."""
    comms_logger.log_summary(print_fn)


__all__ = [
    "CommDeviceError",
    "device_check_enabled",
    "set_device_check",
    "CollectiveTimeoutError",
    "CollectiveWatchdog",
    "OP_NAMES",
    "CommsLogger",
    "P2POp",
    "PeerFailedError",
    "ProcessGroup",
    "ReduceOp",
    "Stats",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "comms_logger",
    "compressed_all_reduce",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_rank",
    "get_world_size",
    "group_ranks",
    "irecv",
    "isend",
    "is_initialized",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "padded_numel",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "send",
    "watchdog",
]
