"""Process-group queries: rank, world size, groups, backend (thin, validated torch.distributed)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def require_initialized(where: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"zero_core.comm.{where}: the default process group is not initialized; call "
            "zero_core.distributed.init_distributed() (or torch.distributed.init_process_group) first"
        )


def is_non_member(group: Any) -> bool:
    """Whether ``group`` is torch's marker returned by ``new_group`` to ranks outside the group."""
    return group is dist.GroupMember.NON_GROUP_MEMBER


def check_group(group: Any, where: str) -> None:
    if group is not None and not is_non_member(group) and not isinstance(group, ProcessGroup):
        raise TypeError(
            f"zero_core.comm.{where}: group must be a ProcessGroup or None, got {type(group).__name__}"
        )


def check_member_rank(rank: Any, group: Any, name: str, where: str, *, optional: bool = False) -> None:
    """Raises ValueError unless ``rank`` is the global rank of a member of ``group`` (the world
    when None); with ``optional`` a None ``rank`` is accepted."""
    if rank is None and optional:
        return
    ranks = group_ranks(group)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in ranks:
        raise ValueError(
            f"zero_core.comm.{where}: {name} must be the global rank of a group member {list(ranks)}, got {rank!r}"
        )


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the world when None); -1 if not a member."""
    require_initialized("get_rank")
    check_group(group, "get_rank")
    return dist.get_rank(group)


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the world when None)."""
    require_initialized("get_world_size")
    check_group(group, "get_world_size")
    return dist.get_world_size(group)


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s member number ``group_rank``."""
    require_initialized("get_global_rank")
    check_group(group, "get_global_rank")
    ranks = group_ranks(group)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ValueError(
            f"zero_core.comm.get_global_rank: group_rank must be an int in [0, {len(ranks)}), got {group_rank!r}"
        )
    return ranks[group_rank]


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group``'s members in group-rank order (the whole world for None)."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    if is_non_member(group):
        return ()
    return tuple(dist.get_process_group_ranks(group))


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    require_initialized("get_backend")
    check_group(group, "get_backend")
    return str(dist.get_backend(group))


def new_group(
    ranks: list[int] | None = None,
    timeout: timedelta | float | None = None,
    backend: str | None = None,
    **kwargs: Any,
) -> ProcessGroup:
    """Create a process group of the global ``ranks`` (all ranks when None).

    Like ``torch.distributed.new_group`` it must be called by *every* rank of the world, in
    the same order, members or not. ``timeout`` may be seconds or a timedelta.
    """
    require_initialized("new_group")
    world = dist.get_world_size()
    if ranks is not None:
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world]
        if bad:
            raise ValueError(
                f"zero_core.comm.new_group: ranks must be ints in [0, {world}), got invalid {bad}"
            )
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"zero_core.comm.new_group: ranks must be unique, got {ranks}")
        if not ranks:
            raise ValueError("zero_core.comm.new_group: ranks must not be empty (use None for all ranks)")
    return dist.new_group(ranks=ranks, timeout=to_timedelta(timeout, "new_group"), backend=backend, **kwargs)


#: called, in order of registration, when the default group is destroyed: the modules that cache
#: groups cut from it (``topology.py``'s node and block groups) register their reset here
_ON_DEFAULT_GROUP_DESTROYED: list[Callable[[], None]] = []


def on_default_group_destroyed(reset: Callable[[], None]) -> None:
    """Have :func:`destroy_process_group` call ``reset`` when it destroys the default group (once
    per function, however often registered)."""
    if reset not in _ON_DEFAULT_GROUP_DESTROYED:
        _ON_DEFAULT_GROUP_DESTROYED.append(reset)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or every group including the default one when None."""
    require_initialized("destroy_process_group")
    check_group(group, "destroy_process_group")
    if group is None:
        from zero_core.comm.watchdog import close_watchdog

        close_watchdog()  # its thread must not poll a store that is going away
        for reset in _ON_DEFAULT_GROUP_DESTROYED:
            reset()  # cached groups die with the default group
    dist.destroy_process_group(group)


def to_timedelta(timeout: timedelta | float | int | None, where: str) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(
            f"zero_core.comm.{where}: timeout must be a positive number of seconds or a timedelta, got {timeout!r}"
        )
    return timedelta(seconds=float(timeout))
