"""Data-parallel gradient averaging for models with MoE layers (without an engine).

[Note: expert gradient scaling]
Training on ``W`` data-parallel ranks should give the gradient of the mean of the per-rank
losses: ``(1/W) * sum_r dL_r/dθ``.

* A non-expert parameter is replicated on every rank and its local gradient is ``dL_r/dθ``:
  sum over the whole data-parallel group, divide by ``W``.
* An expert held by expert-parallel rank ``p`` already receives, through the backward of the
  all-to-all, the contributions of every rank of its expert-parallel group. Its replicas in the
  other expert-parallel groups hold the contributions of those groups. Summing over the
  expert-data-parallel group therefore covers all ``W`` ranks, and the divisor is again ``W``,
  not the size of the expert-data-parallel group (``W / ep``). Dividing by the latter would
  scale expert gradients up by ``ep`` relative to single-process training.

Missing gradients (a parameter unused on this rank) take part as zeros, so every rank issues the
same collectives in the same order.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from zero_core import comm

from zero_moe import groups
from zero_moe.utils import is_moe_param


def _flat_all_reduce(params: list[nn.Parameter], group: object, divisor: float) -> None:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype[p.grad.dtype].append(p)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        bucket = by_dtype[dtype]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        if comm.is_initialized() and comm.get_world_size(group) > 1:
            comm.all_reduce(flat, group=group)
        flat.div_(divisor)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def reduce_moe_gradients(model: nn.Module) -> None:
    """Average ``model``'s gradients over the data-parallel world, experts over their own groups.

    Call after ``backward`` and before ``optimizer.step()``. See [Note: expert gradient scaling].
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"reduce_moe_gradients: model must be a torch.nn.Module, got {type(model).__name__}")
    world = comm.get_world_size() if comm.is_initialized() else 1
    dense: list[nn.Parameter] = []
    experts: dict[str, list[nn.Parameter]] = defaultdict(list)
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if is_moe_param(p):
            experts[p.group_name].append(p)
        else:
            dense.append(p)
    if dense:
        _flat_all_reduce(dense, None, float(world))
    for name in sorted(experts):
        _flat_all_reduce(experts[name], groups.get_expert_data_parallel_group(name), float(world))
