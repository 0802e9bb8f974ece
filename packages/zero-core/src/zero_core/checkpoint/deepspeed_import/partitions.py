"""DeepSpeed's flat ZeRO partitions (stages 1-3) as zero checkpoint fragments.

[Note: DeepSpeed flat partitions]
Stages 1 and 2 (and the bf16 optimizer used for stage 1 with fp32 gradient accumulation)
flatten each param group in the order of the model-states file's ``param_shapes[g]``: a
parameter, then its alignment padding (``param_alignment_paddings[g][i]``, absent before
DeepSpeed added it: zeros), the next parameter... The flat group, padded at its end to a
multiple of the partition count times the alignment, is cut into equal partitions; rank ``r``
owns ``[r * P, (r + 1) * P)`` and ``group_paddings[g]`` says how many of its elements are that
end padding (only the last ranks have any). ZeRO-1/2 files store the fp32 partition *without*
that padding (``P - padding`` elements, and the optimizer states with or without it), the bf16
optimizer with it. So rank ``r``'s data covers flat elements ``[r * P, r * P + P - padding)``.

Stage 3 partitions every parameter on its own: rank ``r`` holds elements
``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of an ``n``-element parameter (the last shards
padded), and its fp32 flat group per sub-group is those shards back to back in the order of
``param_shapes[s]`` (one entry per sub-group).

Each covered range becomes one fragment per kind (``fp32`` and every elementwise optimizer
state); zero's reader then gives any strategy at any world size its own ranges.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from zero_core.checkpoint.deepspeed_import.states import elementwise_keys, group_states, scalar_fragments
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.fragments import FP32, OPTIM_PREFIX, Fragment


def shape_groups(param_shapes: Any, where: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``param_shapes`` (a list of ``{name: torch.Size}``) as ``[[(name, shape), ...], ...]``."""
    if not isinstance(param_shapes, list) or not all(isinstance(g, dict) for g in param_shapes):
        raise CheckpointError(f"{where}: param_shapes is not a list of {{name: shape}} per param group")
    return [[(str(n), tuple(int(d) for d in s)) for n, s in g.items()] for g in param_shapes]


def _range_fragments(
    name: str,
    shape: tuple[int, ...],
    po: int,
    n: int,
    so: int,
    fp32: torch.Tensor,
    state: dict[str, Any],
    keys: list[str],
) -> list[Fragment]:
    """Elements ``[po, po + n)`` of ``name``: ``fp32[so:so + n]`` and the same slice of each state."""
    out = [Fragment(name, FP32, shape, po, po + n, fp32[so : so + n])]
    for key in keys:
        flat = state[key].detach().reshape(-1)
        out.append(Fragment(name, OPTIM_PREFIX + key, shape, po, po + n, flat[so : so + n]))
    return out


def _flat_layout(
    shapes: list[tuple[str, tuple[int, ...]]], paddings: list[int] | None, where: str
) -> Iterator[tuple[str, tuple[int, ...], int, int]]:
    """``(name, shape, offset in the flat group, numel)`` of each parameter of a stage 1/2 group."""
    if paddings is not None and len(paddings) != len(shapes):
        raise CheckpointError(
            f"{where}: {len(paddings)} parameter alignment paddings for a group of {len(shapes)} parameters"
        )
    offset = 0
    for i, (name, shape) in enumerate(shapes):
        numel = math.prod(shape)
        yield name, shape, offset, numel
        offset += numel + (int(paddings[i]) if paddings is not None else 0)


def _check_partition_count(osd: dict[str, Any], world: int, where: str) -> None:
    counts = osd.get("partition_count", world)
    counts = counts if isinstance(counts, list) else [counts]
    if any(int(c) != world for c in counts):
        raise CheckpointError(
            f"{where}: partitioned over {counts} ranks but the checkpoint has {world} rank files (expert groups, "
            "MiCS or hpZ shard groups); importing those is not supported"
        )


def zero12_fragments(
    osd: dict[str, Any], groups: list[list[tuple[str, tuple[int, ...]]]], rank: int, world: int, where: str
) -> tuple[list[Fragment], list[dict[str, Any]]]:
    """Fragments of rank ``rank``'s stage 1/2 (or bf16 optimizer) file; see [Note: DeepSpeed flat partitions].

    Returns the fragments and the base optimizer's param groups (hyper-parameters).
    """
    _check_partition_count(osd, world, where)
    parts = osd.get("single_partition_of_fp32_groups")
    if not isinstance(parts, list) or len(parts) != len(groups):
        raise CheckpointError(f"{where}: expected {len(groups)} fp32 partitions (one per param group)")
    states, hyper = group_states(osd.get("base_optimizer_state"), where)
    if len(states) != len(parts):
        raise CheckpointError(f"{where}: {len(states)} optimizer states for {len(parts)} param groups")
    pads = [int(p) for p in osd.get("group_paddings") or [0] * len(parts)]
    aligns = osd.get("param_alignment_paddings")
    lean = "zero_stage" in osd  # ZeRO-1/2 drop the end padding from the saved partition
    out: list[Fragment] = []
    for g, shapes in enumerate(groups):
        part = parts[g].detach().reshape(-1)
        data_len = part.numel() if lean else part.numel() - pads[g]
        start = rank * (data_len + pads[g])
        keys = elementwise_keys(states[g], data_len, f"{where}: param group {g}")
        for name, shape, offset, numel in _flat_layout(shapes, aligns[g] if aligns else None, where):
            lo, hi = max(offset, start), min(offset + numel, start + data_len)
            if lo < hi:
                out += _range_fragments(name, shape, lo - offset, hi - lo, lo - start, part, states[g], keys)
            if rank == 0:
                out += scalar_fragments(name, states[g], where)
    return out, hyper


def zero3_fragments(
    osd: dict[str, Any], groups: list[list[tuple[str, tuple[int, ...]]]], rank: int, world: int, where: str
) -> tuple[list[Fragment], list[dict[str, Any]]]:
    """Fragments of rank ``rank``'s stage 3 file; see [Note: DeepSpeed flat partitions]."""
    _check_partition_count(osd, world, where)
    flats = osd.get("fp32_flat_groups")
    if not isinstance(flats, list) or len(flats) != len(groups):
        raise CheckpointError(f"{where}: expected {len(groups)} fp32 flat groups (one per sub-group)")
    states, hyper = group_states(osd.get("optimizer_state_dict"), where)
    if len(states) != len(flats):
        raise CheckpointError(f"{where}: {len(states)} optimizer states for {len(flats)} sub-groups")
    out: list[Fragment] = []
    for s, shapes in enumerate(groups):
        flat = flats[s].detach().reshape(-1)
        need = sum(-(-math.prod(shape) // world) for _, shape in shapes)
        if need != flat.numel():
            raise CheckpointError(
                f"{where}: sub-group {s} holds {flat.numel()} elements, its parameters' shards {need}"
            )
        keys = elementwise_keys(states[s], flat.numel(), f"{where}: sub-group {s}")
        offset = 0
        for name, shape in shapes:
            numel = math.prod(shape)
            shard = -(-numel // world)
            lo, hi = min(rank * shard, numel), min((rank + 1) * shard, numel)
            if hi > lo:
                out += _range_fragments(name, shape, lo, hi - lo, offset, flat, states[s], keys)
            if rank == 0:
                out += scalar_fragments(name, states[s], where)
            offset += shard
    return out, hyper


def frozen_shard_fragments(
    shapes: dict[str, tuple[int, ...]], shards: dict[str, torch.Tensor], rank: int, world: int, where: str
) -> list[Fragment]:
    """Stage 3's frozen parameters: rank ``rank``'s shard of each, as ``param`` fragments."""
    from zero_core.checkpoint.fragments import PARAM

    out = []
    for name, shape in shapes.items():
        if name not in shards:
            raise CheckpointError(f"{where}: no shard of the frozen parameter {name!r}")
        numel = math.prod(shape)
        shard = -(-numel // world)
        lo, hi = min(rank * shard, numel), min((rank + 1) * shard, numel)
        flat = shards[name].detach().reshape(-1)
        if hi > lo:
            out.append(Fragment(name, PARAM, shape, lo, hi, flat[: hi - lo]))
    return out
