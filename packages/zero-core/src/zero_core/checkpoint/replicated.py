"""Fragments of strategies in which every rank holds whole tensors (ZeRO stage 0).

Rank 0 of the data-parallel group writes every tensor whole (the other ranks hold copies and
write nothing); on load every rank reads whole tensors. Expert parameters of MoE layers are
the exception: each is written by the rank holding it, under its global expert name
(see [Note: expert fragments] in ``experts.py``). The module-weight helpers here are
also used by partitioned strategies whose module weights are replicated (stages 1 and 2).
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.checkpoint.experts import global_expert_names, writes_param
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.fragments import (
    FP32,
    OPTIM_PREFIX,
    PARAM,
    CheckpointReader,
    Fragment,
    optimizer_state_fragments,
)
from zero_core.checkpoint.inplace import state_buffer


def module_fragments(module: torch.nn.Module, *, exclude_frozen_parameters: bool = False) -> list[Fragment]:
    """Whole ``param`` fragments of every module parameter (frozen ones unless excluded)."""
    out = []
    for name, p in module.named_parameters():
        if exclude_frozen_parameters and not p.requires_grad:
            continue
        out.append(Fragment(name, PARAM, tuple(p.shape), 0, p.numel(), p.detach().reshape(-1)))
    return out


def checkpoint_names(module: torch.nn.Module) -> dict[str, str]:
    """``{module parameter name: name in the checkpoint}`` (differs for expert parameters only)."""
    renamed = global_expert_names(module)
    return {n: renamed.get(n, n) for n, _ in module.named_parameters()}


def check_names(reader: CheckpointReader, module: torch.nn.Module, *, strict: bool) -> None:
    """With ``strict``, the checkpoint's parameters must be exactly the module's."""
    if not strict:
        return
    names = checkpoint_names(module)
    mine = {names[n]: p for n, p in module.named_parameters()}
    saved = set(reader.names(PARAM)) | set(reader.names(FP32))
    missing = [
        n for n, p in mine.items() if n not in saved and not (reader.exclude_frozen and not p.requires_grad)
    ]
    # an expert-parallel model holds only its own experts: the others are expected in the file
    unexpected = [] if _has_experts(module) else sorted(saved - set(mine))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {reader.tag_dir} does not match the model (load_module_strict=True): "
            f"missing parameters {missing}, unexpected parameters {unexpected}"
        )


@torch.no_grad()
def load_module_params(reader: CheckpointReader, module: torch.nn.Module, *, strict: bool) -> None:
    """Copy every saved module weight into ``module`` (whole tensors, in the module's dtype)."""
    check_names(reader, module, strict=strict)
    names = checkpoint_names(module)
    for local, p in module.named_parameters():
        name = names[local]
        if reader.has(name, PARAM) or reader.has(name, FP32):
            if reader.shape(name, PARAM if reader.has(name, PARAM) else FP32) != tuple(p.shape):
                raise CheckpointError(
                    f"parameter {name!r}: checkpoint shape {reader.shape(name, PARAM)} != model shape {tuple(p.shape)}"
                )
            reader.read_module_value_into(p.detach(), name)  # See [Note: reading into place]


def replicated_fragments(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    master: dict[torch.nn.Parameter, torch.nn.Parameter],
    *,
    rank: int,
    exclude_frozen_parameters: bool = False,
) -> list[Fragment]:
    """Everything, whole, from group rank 0 (the others hold copies); expert parameters from their holders."""
    names = checkpoint_names(module)
    out = []
    for local, p in module.named_parameters():
        if (exclude_frozen_parameters and not p.requires_grad) or not writes_param(p, rank):
            continue
        name = names[local]
        out.append(Fragment(name, PARAM, tuple(p.shape), 0, p.numel(), p.detach().reshape(-1)))
        target = master.get(p, p)
        if target is not p:
            out.append(Fragment(name, FP32, tuple(p.shape), 0, p.numel(), target.detach().reshape(-1)))
        out += optimizer_state_fragments(name, tuple(p.shape), optimizer.state.get(target, {}))
    return out


@torch.no_grad()
def load_replicated(
    reader: CheckpointReader,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    master: dict[torch.nn.Parameter, torch.nn.Parameter],
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
) -> None:
    """Load whole module weights, fp32 masters and (optionally) optimizer states on every rank."""
    load_module_params(reader, module, strict=strict)
    names = checkpoint_names(module)
    for local, p in module.named_parameters():
        name = names[local]
        target = master.get(p, p)
        # Masters follow the weights even for load_module_only: a stale master would undo the load at the next step.
        if target is not p and (reader.has(name, FP32) or reader.has(name, PARAM)):
            reader.read_fp32_into(target.detach(), name)
        if not load_optimizer_states or load_module_only:
            continue
        keys = reader.optimizer_keys(name)
        if not keys:
            continue
        live = optimizer.state.get(target, {})
        state: dict[str, Any] = {}
        for key in keys:
            kind = OPTIM_PREFIX + key
            if not reader.is_elementwise(name, kind):
                state[key] = reader.read_optimizer_state(name, key)
                continue
            if reader.shape(name, kind) != tuple(p.shape):
                raise CheckpointError(
                    f"parameter {name!r}: optimizer state {key!r} has shape {reader.shape(name, kind)} in the "
                    f"checkpoint, the parameter {tuple(p.shape)}"
                )
            # See [Note: loading into the live state] in inplace.py
            buf = state_buffer(live.get(key), target.numel(), reader.dtype(name, kind), target.device)
            reader.read_into(buf, name, kind)
            state[key] = buf.view_as(target)
        optimizer.state[target] = state


def _has_experts(module: torch.nn.Module) -> bool:
    return any(getattr(p, "allreduce", True) is False for p in module.parameters())
