"""``zero.GatheredParameters``: full parameters for a block of code, optionally modified.

Inside the context the listed partitioned parameters hold their full values on every rank.
With ``modifier_rank=r`` the values rank r holds at exit are broadcast to every rank and
re-partitioned, so a change made by one rank (loading weights, custom init) reaches all
partitions, including the strategy's fp32 master copy. All ranks must enter the context with
the same parameters (it is collective). For an expert parameter partitioned over its
expert-data-parallel group, the value comes from the member of ``modifier_rank``'s
expert-parallel group (see :func:`~zero_core.zero.stage3.expert_partition.modifier_group_rank`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero_core import comm
from zero_core.zero.stage3.expert_partition import modifier_group_rank
from zero_core.zero.stage3.external_params import register_external_parameter
from zero_core.zero.stage3.param_records import partition_state
from zero_core.zero.stage3.partitioned_param import (
    ParamStatus,
    broadcast_full,
    gather_params,
    is_partitioned,
    release_param,
    shard_from_full,
)


def _as_list(params: Any) -> list[Any]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, Iterable):
        return list(params)
    raise TypeError(
        f"GatheredParameters: params must be a Parameter or an iterable of them, got {type(params).__name__}"
    )


class GatheredParameters:
    """Gather ``params`` on entry; with ``modifier_rank`` broadcast and re-partition on exit."""

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        items = _as_list(params)
        for i, p in enumerate(items):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"GatheredParameters: params[{i}] is a {type(p).__name__}, not a tensor")
        if modifier_rank is not None:
            if isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int):
                raise TypeError(
                    f"GatheredParameters: modifier_rank must be an int or None, got {modifier_rank!r}"
                )
            world = comm.get_world_size() if comm.is_initialized() else 1
            if not 0 <= modifier_rank < world:
                raise ValueError(f"GatheredParameters: modifier_rank {modifier_rank} is outside [0, {world})")
        if fwd_module is not None and not isinstance(fwd_module, torch.nn.Module):
            raise TypeError(
                f"GatheredParameters: fwd_module must be a torch.nn.Module, got {type(fwd_module).__name__}"
            )
        self.enabled = bool(enabled)
        self.params = [p for p in items if is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self._gathered: list[torch.nn.Parameter] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled or not self.params:
            return self
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)
        before = {id(p) for p in self.params if partition_state(p).status is ParamStatus.AVAILABLE}
        handle = gather_params(self.params, what="GatheredParameters")
        if handle is not None:
            handle.wait()
        self._gathered = [p for p in self.params if id(p) not in before]
        for p in self.params:
            partition_state(p).holds += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or not self.params:
            return
        for p in self.params:
            partition_state(p).holds -= 1
        if self.modifier_rank is not None and exc[0] is None:
            with torch.no_grad():
                for p in self.params:
                    # experts: the modifier's expert-parallel peer (See [Note: stage 3 expert parameters])
                    broadcast_full(p, modifier_group_rank(p, self.modifier_rank))
                    shard_from_full(p)
                    # the strategy training p refreshes its master (See [Note: stage 3 parameter records])
                    owner = partition_state(p).owner_of()
                    if owner is not None:
                        owner.on_shard_changed(p)
        for p in self._gathered:
            release_param(p)
        self._gathered = []
