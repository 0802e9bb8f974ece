"""An engine without an optimizer, for evaluation and ZeRO-3 reference models.

[Note: engine without an optimizer]
DeepSpeed's ``initialize`` accepts a model with neither an ``optimizer`` argument nor an
``optimizer`` config section and returns an engine for inference-style use: evaluation loops,
or the frozen reference/reward models of RLHF, partitioned under ZeRO-3 so they fit. We do
the same: the strategy is built around :class:`EvalOnlyOptimizer`, a placeholder that holds
the parameter groups (the strategies need them) and owns no state.

* Stage 0, 1 and 2 build plain data parallel without fp32 master copies: with nothing to
  update, partitioning optimizer states or gradients would save nothing (DeepSpeed also skips
  its ZeRO optimizer here). With fp16/bf16 the module is cast to the training dtype.
* Stage 3 partitions the parameters exactly as for training (forward gathers them module by
  module) but creates no fp32 masters, so each rank holds 1/N of the 16-bit weights only.
  ``offload_param`` still applies; ``offload_optimizer`` has nothing to hold and is not built.
* ``initialize`` returns ``None`` as the optimizer and ``engine.optimizer`` is ``None``.
* ``engine.backward`` and ``engine.step`` raise :class:`NoOptimizerError` naming the fix:
  there is nothing to train. (Gradients of the inputs, e.g. for saliency, are still available
  with plain ``torch.autograd.grad`` through the engine's forward at stages 0-2.)
* An LR scheduler without an optimizer is refused at ``initialize``.
* ``save_checkpoint`` / ``load_checkpoint`` work at every stage (DeepSpeed's evaluation engines
  save and load too): the checkpoint holds the module (16-bit weights where there are no fp32
  masters), buffers and counters, and records its optimizer as ``{"class": null,
  "param_groups": []}`` (the placeholder's lr 0 is never saved, so no training engine loads it).
  This engine loads any checkpoint's module and skips its optimizer states; a training engine
  loads this one with ``load_optimizer_states=False``, and asking for the optimizer states it
  lacks is a ``CheckpointError`` raised before anything is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT


class NoOptimizerError(RuntimeError):
    """Training was asked of an engine built without an optimizer."""


class EvalOnlyOptimizer(torch.optim.Optimizer):
    """Placeholder optimizer of an engine built without one. See [Note: engine without an optimizer]."""

    def __init__(self, params: ParamsT) -> None:
        params = list(params)
        if not params:
            params = [torch.nn.Parameter(torch.zeros(0), requires_grad=False)]
        super().__init__(params, {"lr": 0.0})

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        raise NoOptimizerError(_MESSAGE.format(what="optimizer.step"))


_MESSAGE = (
    "{what}: this engine was built without an optimizer (no optimizer= argument to initialize and "
    "no 'optimizer' section in the config), so it can run forward passes only (evaluation, "
    "reference models). To train, pass optimizer= (an optimizer or a callable taking the "
    "parameters) or add an 'optimizer' section"
)


def is_eval_only(optimizer: object) -> bool:
    return isinstance(optimizer, EvalOnlyOptimizer)


def require_optimizer(optimizer: object, what: str) -> None:
    """Raise :class:`NoOptimizerError` when ``optimizer`` is the placeholder of an eval-only engine."""
    if is_eval_only(optimizer):
        raise NoOptimizerError(_MESSAGE.format(what=f"engine.{what}"))
