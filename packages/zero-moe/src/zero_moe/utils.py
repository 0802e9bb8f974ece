"""Telling expert parameters apart, and splitting optimizer parameter groups by expert group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# DeepSpeed's default cap on the elements of one MoE parameter group (about 178.9M).
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (tagged ``allreduce = False`` by the MoE layer)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(model: nn.Module) -> bool:
    """Whether ``model`` contains an MoE layer."""
    from zero_moe.layer import MoE

    return any(isinstance(m, MoE) for m in model.modules())


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_moe_and_non_moe_params(
    model: nn.Module,
) -> tuple[list[nn.Parameter], dict[str, list[nn.Parameter]]]:
    """(non-expert params, expert params keyed by their group name), in ``model.parameters()`` order."""
    dense: list[nn.Parameter] = []
    experts: dict[str, list[nn.Parameter]] = {}
    for p in model.parameters():
        if is_moe_param(p):
            experts.setdefault(p.group_name, []).append(p)
        else:
            dense.append(p)
    return dense, experts


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | Iterable[dict[str, Any]], max_group_size: int = DEFAULT_MAX_GROUP_SIZE
) -> list[dict[str, Any]]:
    """Move expert parameters out of each optimizer group into groups of their own.

    Every input group keeps its non-expert parameters; for each expert group name found in it,
    new groups are added with the same hyper-parameters plus ``"moe": True`` and
    ``"name": <group_name>``, each holding at most ``max_group_size`` elements (a single larger
    parameter gets a group of its own). An engine reduces the gradients of a ``moe`` group over
    that group's expert-data-parallel group.
    """
    if isinstance(param_groups, dict):
        groups_in = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups_in = list(param_groups)
    else:
        raise TypeError(
            "split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict or a list/tuple "
            f"of dicts (torch optimizer param groups), got {type(param_groups).__name__}"
        )
    if isinstance(max_group_size, bool) or not isinstance(max_group_size, int) or max_group_size < 1:
        raise ValueError(f"max_group_size must be an int >= 1, got {max_group_size!r}")
    out: list[dict[str, Any]] = []
    moe_groups: list[dict[str, Any]] = []
    for i, group in enumerate(groups_in):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param group {i} must be a dict with a 'params' entry, got {group!r:.80}")
        params = list(group["params"])
        dense = [p for p in params if not is_moe_param(p)]
        by_name: dict[str, list[torch.Tensor]] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        out.append({**group, "params": dense})
        for name, expert_params in by_name.items():
            chunk: list[torch.Tensor] = []
            size = 0
            for p in expert_params:
                if chunk and size + p.numel() > max_group_size:
                    moe_groups.append({**group, "params": chunk, "moe": True, "name": name})
                    chunk, size = [], 0
                chunk.append(p)
                size += p.numel()
            moe_groups.append({**group, "params": chunk, "moe": True, "name": name})
    return out + moe_groups
