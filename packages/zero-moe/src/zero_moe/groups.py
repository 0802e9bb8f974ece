"""Expert-parallel and expert-data-parallel process groups.

[Note: expert parallel groups]
With ``W`` data-parallel ranks and an expert-parallel size ``ep`` (``ep`` divides ``W``):

* the **expert-parallel** groups are the ``W // ep`` blocks of consecutive ranks
  ``[i*ep, (i+1)*ep)``; the experts of a layer are sharded over the ranks of one block, and
  tokens travel between them with all-to-all;
* the **expert-data-parallel** groups are the ``ep`` strided sets ``{j, j+ep, j+2*ep, ...}``:
  the ranks holding replicas of the same experts, over which expert gradients are reduced.

Groups are keyed by a name, ``"ep_size_<ep>"`` (DeepSpeed's naming), so layers with the same
``ep_size`` share them. ``torch.distributed.new_group`` must be called by every rank in the
same order, so :func:`create_expert_and_data_parallel` creates *all* groups of a size on every
rank and keeps the ones this rank belongs to. Every rank constructs its MoE layers in the same
order, which makes that hold.

Without an initialised process group there is one rank; only ``ep_size == 1`` is valid and the
groups are ``None`` (collectives are skipped).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from zero_core import comm

_EXPERT_PARALLEL_GROUP: dict[str, dist.ProcessGroup | None] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, dist.ProcessGroup | None] = {}
_EXPERT_PARALLEL_SIZE: dict[str, int] = {}


def group_name_for(ep_size: int) -> str:
    """The group name DeepSpeed uses for an expert-parallel size: ``"ep_size_<ep_size>"``."""
    return f"ep_size_{ep_size}"


def create_expert_and_data_parallel(ep_size: int) -> str:
    """Create (once) the expert-parallel and expert-data-parallel groups for ``ep_size``.

    Returns the group name. Idempotent: a second call with the same size reuses the groups.
    See [Note: expert parallel groups].
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"create_expert_and_data_parallel: ep_size must be an int >= 1, got {ep_size!r}")
    name = group_name_for(ep_size)
    if name in _EXPERT_PARALLEL_SIZE:
        return name
    world = comm.get_world_size() if comm.is_initialized() else 1
    if world % ep_size != 0:
        raise ValueError(
            f"create_expert_and_data_parallel: ep_size={ep_size} must divide the world size {world} "
            f"(allowed: {[d for d in range(1, world + 1) if world % d == 0]})"
        )
    if not comm.is_initialized():
        _EXPERT_PARALLEL_GROUP[name] = None
        _EXPERT_DATA_PARALLEL_GROUP[name] = None
        _EXPERT_PARALLEL_SIZE[name] = ep_size
        return name
    rank = comm.get_rank()
    for i in range(world // ep_size):
        ranks = list(range(i * ep_size, (i + 1) * ep_size))
        group = comm.new_group(ranks)
        if rank in ranks:
            _EXPERT_PARALLEL_GROUP[name] = group
    for j in range(ep_size):
        ranks = list(range(j, world, ep_size))
        group = comm.new_group(ranks)
        if rank in ranks:
            _EXPERT_DATA_PARALLEL_GROUP[name] = group
    _EXPERT_PARALLEL_SIZE[name] = ep_size
    return name


def _lookup(table: dict[str, dist.ProcessGroup | None], name: str, what: str) -> dist.ProcessGroup | None:
    if name not in _EXPERT_PARALLEL_SIZE:
        known = sorted(_EXPERT_PARALLEL_SIZE) or "none"
        raise KeyError(f"{what}: no expert groups named {name!r} (created: {known})")
    return table[name]


def get_expert_parallel_group(name: str) -> dist.ProcessGroup | None:
    """The expert-parallel process group ``name`` (``None`` when not distributed)."""
    return _lookup(_EXPERT_PARALLEL_GROUP, name, "get_expert_parallel_group")


def get_expert_data_parallel_group(name: str) -> dist.ProcessGroup | None:
    """The expert-data-parallel process group ``name`` (``None`` when not distributed)."""
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP, name, "get_expert_data_parallel_group")


def get_expert_parallel_world_size(name: str) -> int:
    return _lookup(_EXPERT_PARALLEL_SIZE, name, "get_expert_parallel_world_size")


def get_expert_parallel_rank(name: str) -> int:
    group = get_expert_parallel_group(name)
    return comm.get_rank(group) if group is not None else 0


def get_expert_data_parallel_world_size(name: str) -> int:
    group = get_expert_data_parallel_group(name)
    return comm.get_world_size(group) if group is not None else 1


def get_expert_data_parallel_rank(name: str) -> int:
    group = get_expert_data_parallel_group(name)
    return comm.get_rank(group) if group is not None else 0


def get_expert_parallel_group_dict() -> dict[str, Any]:
    return dict(_EXPERT_PARALLEL_GROUP)


def get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return dict(_EXPERT_DATA_PARALLEL_GROUP)


def get_max_expert_size() -> int:
    """The largest expert-parallel size created so far (1 when none)."""
    return max(_EXPERT_PARALLEL_SIZE.values(), default=1)


def get_data_parallel_world_size() -> int:
    """Size of the whole data-parallel group (the world: no tensor/pipeline parallelism here)."""
    return comm.get_world_size() if comm.is_initialized() else 1


def reset_groups() -> None:
    """Forget every group (for tests and for a re-initialised process group)."""
    _EXPERT_PARALLEL_GROUP.clear()
    _EXPERT_DATA_PARALLEL_GROUP.clear()
    _EXPERT_PARALLEL_SIZE.clear()
