"""Which process group each parameter's gradient is reduced over.

[Note: expert parameters]
Mixture-of-Experts layers (zero-moe) mark expert parameters with ``param.allreduce = False``
and ``param.group_name`` (DeepSpeed's convention). An expert's gradient already sums the
contributions of every rank of its expert-parallel group (tokens reached it by all-to-all),
so it is reduced over the expert-data-parallel group only: the ranks holding the same
experts. It is still averaged over the whole data-parallel world size, because the loss is
the mean over all data-parallel ranks. Every other parameter is reduced over the
data-parallel group. Strategies of every stage use :func:`reduction_groups`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from zero_core.plugins import require


def is_expert_param(p: torch.nn.Parameter) -> bool:
    return getattr(p, "allreduce", True) is False


def reduction_groups(
    params: Sequence[torch.nn.Parameter], dp_group: dist.ProcessGroup | None
) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """``[(group, params)]``: the data-parallel params first, then one entry per expert group."""
    dense = [p for p in params if not is_expert_param(p)]
    experts: dict[str, list[torch.nn.Parameter]] = {}
    for p in params:
        if is_expert_param(p):
            experts.setdefault(getattr(p, "group_name", "default"), []).append(p)
    out: list[tuple[Any, list[torch.nn.Parameter]]] = [(dp_group, dense)] if dense else []
    if experts:
        groups = require("zero_moe.groups", "training Mixture-of-Experts parameters")
        for name, ps in experts.items():
            out.append((groups.get_expert_data_parallel_group(name), ps))
    return out
