"""The optimizer step at a gradient-accumulation boundary, shared by every engine.

[Note: optimizer boundary step]
At the end of an accumulation window an engine decides, in this order: (1) fp16 overflow:
any rank with a non-finite gradient makes every rank skip the step and lower the loss scale
(one all-reduce of one device byte, the one host read of an fp16 step); (2) the global
gradient norm: the strategy's fused local sum of squares, all-reduced over the ranks holding
distinct gradients (``strategy.norm_group()``), then over any further groups the caller
names (a pipeline's stages) after subtracting what the caller counts twice (a pipeline's tied
weights held by several stages); (3) with bf16's ``check_grad_overflow``, a non-finite norm
skips the step (bf16 has no loss scale to lower); (4) the clipping coefficient, a device
tensor (no host read), folded with the loss-scale inverse into one gradient scale; (5) the
strategy's step, the scaler update, ``zero_grad`` and the LR scheduler.

``ZeroEngine`` and zero-pipe's ``StageOptimizer`` both run this one object, so the order,
the skip rules and the host syncs cannot drift apart between data and pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zero_core import comm
from zero_core.engine.loss_scaler import LossScaler, warn_static_overflow
from zero_core.utils.grad_norm import clip_coefficient

if TYPE_CHECKING:
    from zero_core.engine.strategy import TrainingStrategy


@dataclass(frozen=True)
class BoundaryOutcome:
    """What one boundary step did: ``applied`` False when it skipped (non-finite gradients);
    ``norm`` the global gradient norm (a device tensor), ``inf`` when skipped."""

    applied: bool
    norm: float | torch.Tensor


class OptimizerBoundaryStep:
    """Overflow check, global norm, bf16 skip, clipping and step. See [Note: optimizer boundary step].

    ``skip_nonfinite``: bf16's ``check_grad_overflow`` (skip a step whose norm is inf/nan).
    ``device``: where the backend's collectives run (NCCL: the GPU).
    """

    def __init__(
        self,
        strategy: TrainingStrategy,
        loss_scaler: LossScaler,
        *,
        device: torch.device,
        skip_nonfinite: bool,
    ) -> None:
        self.strategy = strategy
        self.loss_scaler = loss_scaler
        self.device = device
        self.skip_nonfinite = bool(skip_nonfinite)

    def global_overflow(self) -> bool:
        """OR of the strategy's local overflow flag over the world: one byte, one host read."""
        t = (
            torch.as_tensor(self.strategy.local_overflow())
            .to(device=self.device, dtype=torch.uint8)
            .reshape(1)
        )
        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.all_reduce(t, op=comm.ReduceOp.MAX)
        return bool(t.item())  # the one host read of an fp16 step: skip or apply

    def global_norm(
        self, inv_scale: float, norm_sq_offset: torch.Tensor | None, extra_norm_groups: Sequence[Any]
    ) -> torch.Tensor:
        """The unscaled global gradient norm, a 0-dim device tensor (no host read)."""
        norm_sq = self.strategy.grad_norm_sq().float().to(self.device)
        group = self.strategy.norm_group()
        if group is not None:
            comm.all_reduce(norm_sq, group=group)
        if norm_sq_offset is not None:
            norm_sq = norm_sq - norm_sq_offset
        for extra in extra_norm_groups:
            comm.all_reduce(norm_sq, group=extra)
        return norm_sq.clamp(min=0.0).sqrt() * inv_scale

    def __call__(
        self,
        *,
        gradient_clipping: float,
        lr_step: Callable[[], None] | None = None,
        norm_sq_offset: torch.Tensor | None = None,
        extra_norm_groups: Sequence[Any] = (),
        step_index: int | None = None,
        skipped_before: int = 0,
    ) -> BoundaryOutcome:
        """Run one boundary step. ``step_index`` and ``skipped_before`` only word the warning of
        a static loss scale that overflows; ``lr_step`` advances the LR schedule after an applied step."""
        scaler = self.loss_scaler
        inv_scale = 1.0 / scaler.loss_scale
        if scaler.checks_overflow and self.global_overflow():
            # fp16 skips an overflowing step whatever the scaler (see [Note: loss scaling])
            scaler.update_scale(True)
            self.strategy.zero_grad()
            if not scaler.dynamic and (not comm.is_initialized() or comm.get_rank() == 0):
                warn_static_overflow(scaler.loss_scale, step_index, skipped_before + 1)
            return BoundaryOutcome(False, float("inf"))
        norm = self.global_norm(inv_scale, norm_sq_offset, extra_norm_groups)
        if self.skip_nonfinite and not bool(torch.isfinite(norm)):
            # bf16 has fp32's range, so there is no loss scale to lower: as DeepSpeed does with
            # bf16.check_grad_overflow, drop the step rather than write inf/nan into the masters.
            # The norm was reduced over every rank holding gradients, so all ranks agree.
            self.strategy.zero_grad()
            return BoundaryOutcome(False, float("inf"))
        grad_scale: float | torch.Tensor = inv_scale
        if gradient_clipping > 0:  # a device coefficient, no host read
            grad_scale = clip_coefficient(norm, gradient_clipping) * inv_scale
        self.strategy.step(grad_scale)
        scaler.update_scale(False)
        self.strategy.zero_grad()
        if lr_step is not None:
            lr_step()
        return BoundaryOutcome(True, norm)
