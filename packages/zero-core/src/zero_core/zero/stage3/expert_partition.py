"""Which process group a stage-3 parameter is partitioned over: experts use their own.

[Note: stage 3 expert parameters]
Expert parameters of Mixture-of-Experts layers (zero-moe tags them ``param.allreduce = False``
and ``param.group_name``; see [Note: expert parameters] in ``utils/param_groups.py``) are
partitioned over their **expert-data-parallel group**, not over the data-parallel group. With
``ep_size > 1`` the ranks of one expert-parallel group hold *different* experts under the same
local module name, so cutting ``...zero_experts.0.weight`` over the whole data-parallel group
would mix the shards of different experts into one parameter. The ranks of one
expert-data-parallel group hold replicas of the same experts, so they can share them as one
partitioned parameter: each keeps ``1 / edp_world`` of it, the all-gather before a module runs
and the reduce-scatter of its gradient run over that group, and the gradient is divided by the
whole data-parallel world size (the loss is the mean over every data-parallel rank; the
expert's gradient already sums every token routed to it through the all-to-all).

The alternative, keeping experts whole and all-reduced like stage 0 inside the stage-3
strategy, was rejected: experts are usually most of an MoE model's parameters, and stage 3
exists to partition them. Everything else follows from per-parameter state: a
:class:`~zero_core.zero.stage3.partitioned_param.PartitionState` records its own group, rank
and ``grad_divisor``; :func:`~zero_core.zero.stage3.partitioned_param.gather_params` issues one
all-gather per group present in a bucket (in first-appearance order, which is the same on every
rank because every rank builds the same modules); the gradient reducer cuts its buckets where
the group changes (see [Note: stage 3 gradient buckets]). The gradient-norm shares of all
ranks still sum to the global norm over the data-parallel group: each element of a global
expert lives in exactly one rank's shard. Checkpoint fragments name experts by global index
(see [Note: expert fragments] in ``checkpoint/experts.py``) and each rank writes its shard
range, so every global expert is written exactly once. ``zero.Init`` partitions experts over
the same group (see [Note: stage 3 construction]) and the strategy checks that it did.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core import comm
from zero_core.plugins import require
from zero_core.utils.param_groups import is_expert_param
from zero_core.zero.stage3.param_records import partition_state


def expert_group_exists(param: torch.nn.Parameter) -> bool:
    """False for an expert parameter whose expert groups are not created yet (True otherwise).

    An MoE layer builds its experts before it creates its groups, so ``zero.Init`` leaves such a
    parameter to the enclosing ``__init__`` (see [Note: stage 3 construction]).
    """
    if not is_expert_param(param):
        return True
    groups = require("zero_moe.groups", "ZeRO stage 3 with Mixture-of-Experts parameters")
    try:
        groups.get_expert_parallel_world_size(getattr(param, "group_name", "default"))
    except KeyError:
        return False
    return True


def partition_group(param: torch.nn.Parameter, dp_group: Any) -> tuple[Any, int]:
    """``(group to partition param over, number its summed gradient is divided by)``.

    A dense parameter: the data-parallel group and its size. An expert parameter: its
    expert-data-parallel group and the data-parallel world size (see the Note above).
    """
    dp_world = comm.get_world_size(dp_group) if comm.is_initialized() else 1
    if not is_expert_param(param):
        return dp_group, dp_world
    groups = require("zero_moe.groups", "ZeRO stage 3 with Mixture-of-Experts parameters")
    name = getattr(param, "group_name", "default")
    try:
        edp_group = groups.get_expert_data_parallel_group(name)
        ep_size = groups.get_expert_parallel_world_size(name)
    except KeyError as exc:
        raise ValueError(
            f"ZeRO stage 3: an expert parameter (shape {tuple(param.shape)}) names expert group {name!r}, "
            "which does not exist; build the MoE layers after torch.distributed is initialised (or call "
            "MoE.set_zero_parallelism()) so their expert groups are created"
        ) from exc
    edp_world = comm.get_world_size(edp_group) if comm.is_initialized() else 1
    if edp_world * ep_size != dp_world:
        raise ValueError(
            f"ZeRO stage 3: expert group {name!r} has ep_size={ep_size} and an expert-data-parallel group of "
            f"{edp_world} ranks, but the data-parallel group has {dp_world} ranks (expected "
            f"ep_size * expert-data-parallel size == data-parallel size). Expert groups are built over the "
            "whole world: use the default data-parallel group with Mixture-of-Experts."
        )
    return edp_group, dp_world


def modifier_group_rank(param: torch.nn.Parameter, modifier_rank: int) -> int:
    """The rank, within the group ``param`` is partitioned over, whose value wins for ``modifier_rank``.

    ``GatheredParameters(modifier_rank=r)`` names a global rank. A dense parameter's group
    holds it. An expert-data-parallel group may not (rank r holds other experts): there the
    winner is the member of r's expert-parallel group, the ranks that together hold every expert
    of the layer, so each global expert takes the value written on r's expert-parallel group.
    With the layout of zero-moe's [Note: expert parallel groups] (expert-data-parallel group
    ``{j, j + ep, j + 2 ep, ...}``) that member is group rank ``r // ep``.
    """
    st = partition_state(param)
    if getattr(st.route, "mics", False):  # broadcast over the world: See [Note: MiCS and hpZ shard groups]
        return modifier_rank
    if st.world == 1 or st.group is None:
        return modifier_rank
    ranks = torch.distributed.get_process_group_ranks(st.group)
    if modifier_rank in ranks:
        return ranks.index(modifier_rank)
    if not is_expert_param(param):
        raise ValueError(
            f"GatheredParameters: modifier_rank {modifier_rank} is not in the data-parallel group {ranks} "
            "this parameter is partitioned over"
        )
    groups = require("zero_moe.groups", "ZeRO stage 3 with Mixture-of-Experts parameters")
    ep = groups.get_expert_parallel_world_size(getattr(param, "group_name", "default"))
    return modifier_rank // ep
