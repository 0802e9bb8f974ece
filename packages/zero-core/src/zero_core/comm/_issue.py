"""Issuing an op through the logger and the ``Work`` wrapper (shared by collectives and p2p)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zero_core.comm.device_check import check_device
from zero_core.comm.groups import group_ranks
from zero_core.comm.logger import PendingRecord, comms_logger
from zero_core.comm.watchdog import get_watchdog
from zero_core.comm.work import Work


def check_tensor(tensor: Any, name: str, where: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"zero_core.comm.{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_device(
        tensor, name, where
    )  # debug mode only: See [Note: collective tensors live on the backend's device]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _device_sync(device: torch.device | None) -> Callable[[], None] | None:
    """A device barrier for timing, or None on CPU (where ops complete synchronously)."""
    if device is None or device.type == "cpu":
        return None
    from zero_core.accelerator import get_accelerator

    acc = get_accelerator()
    return lambda: acc.synchronize()


def links_of(op: str, ranks: tuple[int, ...], size: int, **where: Any) -> tuple[int, int]:
    """This rank's (intra-node, inter-node) bytes for the op; see [Note: bytes by link class]."""
    import torch.distributed as dist

    from zero_core.comm.link_bytes import split_by_link
    from zero_core.comm.topology import ranks_per_node

    world = dist.get_world_size()
    return split_by_link(op, ranks, dist.get_rank(), ranks_per_node(world), size, **where)


def begin(op: str, group: Any, size: int, device: torch.device | None, **where: Any) -> PendingRecord | None:
    """Record ``op`` if the logger wants it. ``where``: ``root``/``peer`` (global ranks) or
    ``send_splits`` (bytes per member), for the link split of [Note: bytes by link class]."""
    if not comms_logger.should_log(op):
        return None
    ranks = group_ranks(group)
    links = links_of(op, ranks, size, **where)
    return comms_logger.begin(op, ranks, size, _device_sync(device), links)


def issue(
    op: str,
    group: Any,
    size: int,
    device: torch.device | None,
    call: Callable[[bool], Any],
    *,
    async_op: bool,
    finalize: Callable[[], None] | None = None,
    waitable: bool = True,
    where: dict[str, Any] | None = None,
) -> Work | None:
    """Run ``call(async_op)`` (the torch op), record it, post-process on completion.

    Returns a ``Work`` for ``async_op=True``; otherwise finishes the op and returns None. Every
    op runs under the collective watchdog: a synchronous ``waitable`` op is issued
    asynchronously and waited on with the watchdog's deadline; the others are watched by its
    thread (see [Note: collective watchdog]).
    """
    record = begin(op, group, size, device, **(where or {}))
    wd = get_watchdog()
    if async_op:
        handle = call(True)
        token = wd.begin(op, group_ranks(group), handle) if wd is not None else None
        return Work(handle, finalize=finalize, record=record, watchdog=wd, token=token)
    if wd is None:
        call(False)
    elif waitable:
        token = wd.begin(op, group_ranks(group))
        handle = call(True)
        wd.wait(handle, token)
    else:
        with wd.watch(op, group_ranks(group)):
            call(False)
    if finalize is not None:
        finalize()
    if record is not None:
        record.finish()
    return None
