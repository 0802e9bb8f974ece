"""Train the same model with plain PyTorch and with a zero engine on the same data, and compare.

Import from here (``from zero_core.testing.parity import train_reference, train_engine``).

[Note: parity runs]
The reference is one process that trains on the *global* batch of every step. Each rank of the
distributed run draws the same global batch and trains on its slice: micro-batch ``m`` of the
accumulation window is rows ``[(m * world + rank) * micro, ... + micro)``, so the ranks and
micro-batches of one step together cover the global batch once. With losses that are means
over the batch, the engine's averaged gradient equals the reference's gradient, and losses
and weights agree to fp32 rounding (the engine sums in another order). ``train_engine``
reports, per step, the loss of the global batch: ``engine.last_loss`` (the mean over this
rank's micro-batches) averaged over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from zero_core.testing.models import _check_sizes

if TYPE_CHECKING:
    from zero_core.engine.engine import ZeroEngine
    from zero_core.protocols.training import LRScheduler

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _step_range(where: str, steps: int | range) -> range:
    if isinstance(steps, range):
        return steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{where}: steps must be an int >= 0 or a range, got {steps!r}")
    return range(steps)


def state_snapshot(model: torch.nn.Module, *, gathered: bool = False) -> dict[str, torch.Tensor]:
    """A detached copy of ``model.state_dict()``; with ``gathered`` the stage-3 partitioned
    parameters are gathered first (a collective: every rank of the partition must call it)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"state_snapshot: model must be a torch.nn.Module, got {type(model).__name__}")
    if not gathered:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    from zero_core.zero.stage3 import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_reference(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    steps: int | range,
    *,
    clip: float = 0.0,
    scheduler: LRScheduler | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: per step ``loss = model(*batch(step))``, backward, gradient
    clipping to ``clip`` (off at 0), ``optimizer.step()``, ``zero_grad(set_to_none=True)`` and
    ``scheduler.step()`` when given. Returns the losses and :func:`state_snapshot` of the model."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"train_reference: clip must be a number >= 0, got {clip!r}")
    losses = []
    for step in _step_range("train_reference", steps):
        loss = model(*batch(step))
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, state_snapshot(model)


def train_engine(
    engine: ZeroEngine,
    batch: Batch,
    steps: int | range,
    *,
    micro: int,
    gas: int = 1,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Train ``engine`` on this rank's slices of each step's global batch (see [Note: parity
    runs]); call ``after_step(step)`` after each step. Returns the global-batch loss per step.

    Runs inside a rank (a process group must exist): the loss average is an all-reduce.
    """
    from zero_core import comm

    _check_sizes("train_engine", micro=micro, gas=gas)
    rank, world = comm.get_rank(), comm.get_world_size()
    device = getattr(engine, "device", torch.device("cpu"))  # the batch and the all-reduce: on it
    losses = []
    for step in _step_range("train_engine", steps):
        x, y = batch(step)
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = engine(x[lo : lo + micro].to(device), y[lo : lo + micro].to(device))
            engine.backward(loss)
            engine.step()
        t = torch.tensor([engine.last_loss], device=device)
        comm.all_reduce(t)
        losses.append(t.item() / world)
        if after_step is not None:
            after_step(step)
    return losses


def _label(name: str, where: str) -> str:
    return f"{name}, {where}" if where else name


def assert_tensors_close(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
    where: str = "",
) -> None:
    """``torch.testing.assert_close`` for every key of ``want`` (a key missing from ``got`` is a
    KeyError); a failure names the key and ``where``."""
    for k, v in want.items():
        torch.testing.assert_close(
            got[k].detach(), v.detach(), rtol=rtol, atol=atol, msg=lambda m, k=k: f"{_label(k, where)}: {m}"
        )


def assert_trajectory_close(
    losses: list[float],
    state: Mapping[str, torch.Tensor],
    ref_losses: list[float],
    ref_state: Mapping[str, torch.Tensor],
    *,
    rtol: float,
    atol: float,
    where: str = "",
) -> None:
    """The losses and every tensor of ``ref_state`` agree within ``rtol``/``atol``."""
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{_label('losses', where)}: {m}",
    )
    assert_tensors_close(state, ref_state, rtol=rtol, atol=atol, where=where)


def assert_states_equal(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *, where: str = ""
) -> None:
    """Every tensor of ``want`` is bitwise equal in ``got`` (e.g. the weights of two ranks)."""
    assert_tensors_close(got, want, rtol=0, atol=0, where=where)
