"""One parameter's optimizer state from DeepSpeed, as zero checkpoint fragments.

DeepSpeed keeps the base optimizer's state per flat group (stages 1-3) or per parameter
(stage 0), in the torch optimizer's own ``state_dict`` layout; a few optimizers keep the step
count elsewhere (DeepSpeed's FusedAdam in the param group, its CPU Adam as a Python int). The
zero side always gets Adam's ``step`` as a 0-dim float32 tensor, as torch's optimizers hold
it, so the optimizer zero builds continues from the same count.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.fragments import OPTIM_PREFIX, Fragment

STEP = "step"


def group_states(base: Any, where: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(state of each optimizer entry in order, hyper-parameters of each param group)``.

    ``base`` is a torch optimizer ``state_dict`` (``{"state": {i: ...}, "param_groups": [...]}``),
    or the list of per-group states DeepSpeed's elastic checkpoints store instead.
    """
    if isinstance(base, list):  # elastic checkpoint: lean states, no param groups
        return [dict(s) for s in base], []
    if not isinstance(base, dict) or "state" not in base or "param_groups" not in base:
        raise CheckpointError(f"{where}: the optimizer state is not a torch optimizer state_dict")
    groups = base["param_groups"]
    ids = [i for g in groups for i in g.get("params", [])]
    states = [dict(base["state"].get(i, {})) for i in ids]
    for g in groups:  # FusedAdam keeps the step count in the group, not the per-tensor state
        if STEP in g:
            for i in g.get("params", []):
                states[ids.index(i)].setdefault(STEP, g[STEP])
    return states, groups


def _step_tensor(value: Any, where: str) -> torch.Tensor:
    if torch.is_tensor(value) and value.numel() == 1:
        return value.detach().reshape(()).to(torch.float32)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    raise CheckpointError(f"{where}: optimizer state 'step' is {type(value).__name__}, expected a number")


def scalar_fragments(name: str, state: dict[str, Any], where: str) -> list[Fragment]:
    """The per-parameter values of ``state`` (``step`` and any other number) for parameter ``name``."""
    out = []
    for key, value in state.items():
        kind = OPTIM_PREFIX + key
        if key == STEP:
            t = _step_tensor(value, where)
            out.append(Fragment(name, kind, (), 0, 1, t.reshape(-1), elementwise=False))
        elif torch.is_tensor(value) and value.dim() == 0:
            out.append(Fragment(name, kind, (), 0, 1, value.detach().reshape(-1), elementwise=False))
        elif isinstance(value, (bool, int, float)):
            dtype = torch.float64 if isinstance(value, float) else torch.int64
            t = torch.tensor([value], dtype=dtype)
            out.append(Fragment(name, kind, (), 0, 1, t, elementwise=False, python_scalar=True))
    return out


def elementwise_keys(state: dict[str, Any], numel: int, where: str) -> list[str]:
    """The keys of ``state`` holding one value per element of a flat tensor of at least ``numel``."""
    keys = []
    for key, value in state.items():
        if key == STEP:
            continue
        if torch.is_tensor(value) and value.dim() >= 1:
            if value.numel() < numel:
                raise CheckpointError(
                    f"{where}: optimizer state {key!r} has {value.numel()} elements, the partition {numel}"
                )
            keys.append(key)
        elif not (torch.is_tensor(value) or isinstance(value, (bool, int, float))):
            raise CheckpointError(
                f"{where}: optimizer state {key!r} is a {type(value).__name__}; only tensors and numbers are imported"
            )
    return keys


def hyperparameters(groups: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Each param group's JSON-compatible hyper-parameters (``params`` and ``step`` left out)."""
    out = []
    for i, g in enumerate(groups):
        hp: dict[str, Any] = {}
        for k, v in g.items():
            if k in ("params", STEP):
                continue
            if isinstance(v, tuple):
                v = list(v)
            if torch.is_tensor(v) and v.numel() == 1:
                v = v.item()
            if (
                v is None
                or isinstance(v, (bool, int, float, str))
                or (isinstance(v, list) and all(isinstance(x, (bool, int, float)) for x in v))
            ):
                hp[k] = v
            else:
                raise CheckpointError(
                    f"{where}: param group {i} holds {k!r} = {type(v).__name__}, which a zero checkpoint cannot record"
                )
        out.append(hp)
    return out
