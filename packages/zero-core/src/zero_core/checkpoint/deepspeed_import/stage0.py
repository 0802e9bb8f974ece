"""DeepSpeed's stage 0 optimizer (inside ``mp_rank_00_model_states.pt``) as zero fragments.

[Note: DeepSpeed stage 0 optimizer groups]
Without ZeRO, DeepSpeed saves its optimizer's ``state_dict()`` under ``optimizer``: the plain
torch optimizer (fp32), or its fp16/bf16 wrapper holding that state dict plus the fp32
masters, per parameter (``fp32_groups``) or one flat tensor per param group
(``fp32_groups_flat``, the fused wrapper). Neither records parameter *names*: the optimizer
numbers its parameters group after group. So the names of each group are

* ``param_groups`` when the caller gives them (``[[name, ...], ...]``, checked against the
  saved shapes and counts);
* else, with one param group, the module's parameters in order;
* else inferred from shapes, assuming each group keeps the module's parameter order (how
  groups are built by filtering ``named_parameters()``): walking the module's parameters,
  each must match the next expected shape of exactly one group. Where two groups (or a
  skipped, frozen parameter) would fit, the assignment is ambiguous and the import stops,
  asking for ``param_groups``, rather than guess.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zero_core.checkpoint.deepspeed_import.states import group_states, scalar_fragments
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.fragments import FP32, OPTIM_PREFIX, PARAM, Fragment

Shape = tuple[int, ...]


def _check_explicit(
    explicit: Any, shapes: dict[str, Shape], expected: list[list[Shape | None]], where: str
) -> list[list[str]]:
    if not isinstance(explicit, (list, tuple)) or not all(
        isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in explicit
    ):
        raise TypeError("from_deepspeed: param_groups must be a list of lists of parameter names")
    if [len(g) for g in explicit] != [len(g) for g in expected]:
        raise CheckpointError(
            f"{where}: param_groups has {[len(g) for g in explicit]} names per group, the optimizer "
            f"{[len(g) for g in expected]}"
        )
    for names, want in zip(explicit, expected):
        for n, s in zip(names, want):
            if n not in shapes:
                raise CheckpointError(
                    f"{where}: param_groups names {n!r}, which is not a parameter of the module"
                )
            if s is not None and s != shapes[n]:
                raise CheckpointError(
                    f"{where}: param_groups puts {n!r} {shapes[n]} where the optimizer holds {s}"
                )
    return [list(g) for g in explicit]


def assign_groups(
    shapes: dict[str, Shape], expected: list[list[Shape | None]], explicit: Any, where: str
) -> list[list[str]]:
    """The parameter names of each optimizer group; see [Note: DeepSpeed stage 0 optimizer groups].

    ``shapes`` is the module's parameters in order; ``expected[g]`` the shapes the optimizer
    holds for group ``g`` (None where it holds no state to tell).
    """
    if explicit is not None:
        return _check_explicit(explicit, shapes, expected, where)
    names = list(shapes)
    ptr = [0] * len(expected)
    out: list[list[str]] = [[] for _ in expected]
    left = sum(len(g) for g in expected)
    for i, name in enumerate(names):
        fits = [
            g
            for g, want in enumerate(expected)
            if ptr[g] < len(want) and want[ptr[g]] in (None, shapes[name])
        ]
        may_skip = len(names) - i > left  # more parameters than optimizer entries remain: frozen ones
        if not fits and not may_skip:
            raise CheckpointError(
                f"{where}: no optimizer param group holds a parameter of shape {shapes[name]} where {name!r} comes "
                "in the module's order; pass param_groups=[[names of group 0], [names of group 1], ...]"
            )
        if len(fits) + int(may_skip) > 1:
            raise CheckpointError(
                f"{where}: cannot tell which optimizer param group {name!r} belongs to (the checkpoint does not "
                f"name them, and {len(fits)} group(s){' or none (frozen)' if may_skip else ''} fit its shape "
                f"{shapes[name]}); pass param_groups=[[names of group 0], [names of group 1], ...] "
                "(tools/from_deepspeed.py --param-groups FILE.json)"
            )
        if fits:
            out[fits[0]].append(name)
            ptr[fits[0]] += 1
            left -= 1
    if left:
        raise CheckpointError(
            f"{where}: the optimizer holds {left} more parameters than the module's shapes account for"
        )
    return out


def _per_param(value: Any, what: str, where: str) -> list[list[torch.Tensor]]:
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value):
        raise CheckpointError(f"{where}: {what} is not a list of tensors per param group")
    return value


def _loss_scale_fields(opt: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "dynamic_loss_scale",
        "cur_scale",
        "cur_iter",
        "last_overflow_iter",
        "scale_factor",
        "scale_window",
    )
    return {k: opt[k] for k in keys if k in opt}


def stage0_fragments(
    module: dict[str, torch.Tensor], shapes: dict[str, Shape], opt: Any, explicit: Any, where: str
) -> tuple[list[Fragment], list[dict[str, Any]], dict[str, Any], set[str]]:
    """``(fragments, param groups, loss-scale fields, names the optimizer trains)`` of a stage 0 checkpoint."""
    frags = [
        Fragment(n, PARAM, s, 0, math.prod(s), module[n].detach().reshape(-1)) for n, s in shapes.items()
    ]
    if opt is None:
        return frags, [], {}, set()
    if not isinstance(opt, dict):
        raise CheckpointError(f"{where}: 'optimizer' is a {type(opt).__name__}, not an optimizer state_dict")
    wrapped = "optimizer_state_dict" in opt
    states, hyper = group_states(opt["optimizer_state_dict"] if wrapped else opt, where)
    flat = opt.get("fp32_groups_flat") if wrapped else None
    masters = _per_param(opt["fp32_groups"], "fp32_groups", where) if wrapped and flat is None else None
    if flat is not None:  # the fused wrapper: one flat master and state per group, no shapes
        if explicit is None and len(hyper) != 1:
            raise CheckpointError(
                f"{where}: the fp16 optimizer flattened {len(hyper)} param groups without naming their parameters; "
                "pass param_groups=[[names of group 0], [names of group 1], ...]"
            )
        counts = [len(shapes)] if explicit is None else [len(g) for g in explicit]
        names = assign_groups(shapes, [[None] * c for c in counts], explicit, where)
        frags += _flat_group_fragments(names, shapes, flat, states, where)
    else:
        expected = _expected_shapes(hyper, states, masters)
        names = assign_groups(shapes, expected, explicit, where)
        entries = [n for g in names for n in g]
        for k, name in enumerate(entries):
            g, i = _group_index(names, k)
            if masters is not None:
                frags.append(
                    Fragment(name, FP32, shapes[name], 0, math.prod(shapes[name]), masters[g][i].reshape(-1))
                )
            frags += _whole_state_fragments(name, shapes[name], states[k], where)
    trained = {n for g in names for n in g}
    return frags, hyper, _loss_scale_fields(opt) if wrapped else {}, trained


def _group_index(names: list[list[str]], k: int) -> tuple[int, int]:
    for g, group in enumerate(names):
        if k < len(group):
            return g, k
        k -= len(group)
    raise IndexError(k)


def _expected_shapes(
    hyper: list[dict[str, Any]], states: list[dict[str, Any]], masters: list[list[torch.Tensor]] | None
) -> list[list[Shape | None]]:
    out: list[list[Shape | None]] = []
    k = 0
    for g, group in enumerate(hyper):
        want: list[Shape | None] = []
        for i in range(len(group.get("params", []))):
            if masters is not None:
                want.append(tuple(masters[g][i].shape))
            else:
                tensors = [v for v in states[k].values() if torch.is_tensor(v) and v.dim() >= 1]
                want.append(tuple(tensors[0].shape) if tensors else None)
            k += 1
        out.append(want)
    return out


def _whole_state_fragments(name: str, shape: Shape, state: dict[str, Any], where: str) -> list[Fragment]:
    out = []
    numel = math.prod(shape)
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() >= 1:
            if tuple(value.shape) != shape:
                raise CheckpointError(
                    f"{where}: optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}, the parameter {shape}"
                )
            out.append(Fragment(name, OPTIM_PREFIX + key, shape, 0, numel, value.detach().reshape(-1)))
    return out + scalar_fragments(
        name, {k: v for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0}, where
    )


def _flat_group_fragments(
    names: list[list[str]], shapes: dict[str, Shape], flat: Any, states: list[dict[str, Any]], where: str
) -> list[Fragment]:
    if not isinstance(flat, list) or len(flat) != len(names) or len(states) != len(names):
        raise CheckpointError(f"{where}: fp32_groups_flat does not hold one flat tensor per param group")
    out = []
    for g, group in enumerate(names):
        master = flat[g].detach().reshape(-1)
        need = sum(math.prod(shapes[name]) for name in group)
        if need != master.numel():
            raise CheckpointError(
                f"{where}: param group {g}'s parameters need {need} elements, its flat master has {master.numel()}"
            )
        keys = [k for k, v in states[g].items() if torch.is_tensor(v) and v.dim() >= 1]
        offset = 0
        for name in group:
            numel = math.prod(shapes[name])
            out.append(Fragment(name, FP32, shapes[name], 0, numel, master[offset : offset + numel]))
            for key in keys:
                out.append(
                    Fragment(
                        name,
                        OPTIM_PREFIX + key,
                        shapes[name],
                        0,
                        numel,
                        states[g][key].reshape(-1)[offset : offset + numel],
                    )
                )
            out += scalar_fragments(name, {k: v for k, v in states[g].items() if k not in keys}, where)
            offset += numel
    return out
