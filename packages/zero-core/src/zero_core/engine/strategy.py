"""The interface between the engine and the part that owns gradients and the optimizer step.

[Note: engine strategies]
The engine (``engine.py``) knows the training loop: micro-steps, accumulation boundaries,
loss scaling decisions, clipping, schedulers, monitors. What happens to parameters,
gradients and optimizer states is the business of one strategy object chosen by
``zero_optimization.stage``: data parallel (stage 0, ``data_parallel.py``), partitioned
optimizer states and gradients (stages 1-2) and partitioned parameters (stage 3). Each
implements :class:`TrainingStrategy`; the engine never branches on the stage.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class TrainingStrategy(Protocol):
    optimizer: torch.optim.Optimizer
    """The optimizer whose ``param_groups`` hold the learning rates (schedulers drive it)."""

    def before_backward(self, is_boundary: bool) -> None:
        """Prepare for a backward pass; reductions happen only when ``is_boundary``."""

    def after_backward(self, is_boundary: bool) -> None:
        """Finish this backward's gradient reductions (wait for in-flight collectives)."""

    def local_overflow(self) -> bool:
        """Whether this rank's reduced gradients contain inf or nan."""

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (already scaled by 1/loss_scale).

        The engine sums the shares with :meth:`norm_group`; strategies whose gradients are
        replicated (stage 0) return the full value and report ``norm_group() is None``.
        """

    def norm_group(self) -> dist.ProcessGroup | None:
        """Process group over which ``grad_norm_sq`` shares are summed (None: no reduction)."""

    def step(self, grad_scale: float | torch.Tensor) -> None:
        """Apply the optimizer: gradients are multiplied by ``grad_scale`` first (unscale+clip)."""

    def zero_grad(self) -> None: ...

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank, measured from live tensors, by category."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
