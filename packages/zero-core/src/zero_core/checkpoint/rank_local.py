"""Optimizer state that belongs to one rank only (the 1-bit optimizers' error feedback).

[Note: rank-local optimizer state]
Most optimizer state is a function of the parameter and is identical on every data-parallel
rank, so rank 0 writes it once. An optimizer with ``rank_local_state()`` (see [Note:
communication-compressed optimizers] in zero-ops' ``zero_ops/onebit/base.py``) also holds
tensors only one rank has; each rank writes them into its own file as ``rank_local`` fragments
named ``rank<r>.<key>`` (whole tensors, not element-wise: they are no parameter's shape). On a
load at the saved world size each rank reads back its own; at another world size the optimizer
is told to reset them (``load_rank_local_state(None, reason)``), which it announces with a warning.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.checkpoint.fragments import CheckpointReader, Fragment

RANK_LOCAL = "rank_local"


def rank_local_fragments(optimizer: Any, rank: int) -> list[Fragment]:
    """This rank's ``rank_local`` fragments (none for optimizers without rank-local state)."""
    get = getattr(optimizer, "rank_local_state", None)
    if get is None:
        return []
    out = []
    for key, tensor in get().items():
        flat = tensor.detach().reshape(-1)
        out.append(
            Fragment(
                f"rank{rank}.{key}", RANK_LOCAL, (flat.numel(),), 0, flat.numel(), flat, elementwise=False
            )
        )
    return out


def read_rank_local(
    reader: CheckpointReader, rank: int, world_size: int
) -> tuple[dict[str, torch.Tensor] | None, str]:
    """This rank's saved rank-local state, or ``(None, why)`` when saved at another world size."""
    if reader.world_size != world_size:
        return (
            None,
            f"checkpoint saved with {reader.world_size} data-parallel ranks, loaded with {world_size}",
        )
    prefix = f"rank{rank}."
    names = [n for n in reader.names(RANK_LOCAL) if n.startswith(prefix)]
    return {n[len(prefix) :]: reader.read(n, RANK_LOCAL).clone() for n in names}, ""
