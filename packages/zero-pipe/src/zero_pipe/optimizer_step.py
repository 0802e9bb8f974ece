"""Gradients and optimizer of one pipeline stage: ZeRO strategy, precision, clipping.

[Note: pipeline gradient reduction]
A stage's parameters receive gradients from every micro-batch's backward, and (for tied
weights) from other stages. At the end of a batch the order is: (1) tied-weight gradients are
summed among the stages sharing them (``ReduceTiedGrads``), (2) the stage's gradients are
averaged over its data-parallel replicas by zero-core's strategy (``ReduceGrads``): stage 0
(``DataParallelStrategy``, bucketed all-reduce) or stage 1 (``PartitionedOptimizerStrategy``,
reduce-scatter into each replica's optimizer shard), and (3) ``OptimizerStep``: the overflow
check (fp16), the global gradient norm and clipping, and the step. Both strategies reduce from
gradient hooks only when *armed*; the pipeline arms them after the last backward, with no
backward in between, so they reduce the accumulated (and tied-summed) gradients in one pass.

The global norm sums every stage's share over the pipeline group; a tied weight is held (with
identical gradients) by several stages, so every owner but the first subtracts its share.
ZeRO stages 2 and 3 partition gradients/parameters across the data-parallel group during the
backward of each micro-batch, which the pipeline's interleaved micro-batches and tied-weight
reduction do not support (as in DeepSpeed): they are rejected with a config error.
"""

from __future__ import annotations

from typing import Any

import torch
from zero_core.engine.data_parallel import DataParallelStrategy
from zero_core.engine.grad_norm import clip_coefficient
from zero_core.engine.loss_scaler import LossScaler, warn_static_overflow
from zero_core.zero.stage_1_and_2 import PartitionedOptimizerStrategy

from zero_pipe import _dist


def _backend_device() -> torch.device:
    """The device of the backend's collectives: the accelerator's current one (NCCL: the GPU)."""
    from zero_core.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


class PipelineConfigError(ValueError):
    """The configuration cannot drive a pipeline."""


def check_zero_stage(stage: Any) -> int:
    """The ZeRO stage for a pipeline: 0 or 1; 2 and 3 are a clear error."""
    if stage not in (0, 1):
        raise PipelineConfigError(
            f"config: zero_optimization.stage={stage} is not compatible with pipeline parallelism; use 0 or 1 "
            "(stages 2 and 3 partition gradients/parameters during each micro-batch's backward, "
            "which pipelined micro-batches and tied-weight reduction do not allow)"
        )
    return int(stage)


def build_strategy(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    zero_stage: int,
    dtype: torch.dtype,
    dp_group: Any,
    zero_section: Any = None,
) -> Any:
    """The zero-core training strategy of this stage over its data-parallel group.

    Casts the module to ``dtype`` (fp32 master weights stay in the strategy).
    """
    opt = (
        (lambda name, default: getattr(zero_section, name, default) or default)
        if zero_section
        else (lambda name, default: default)
    )
    if zero_stage == 0:
        strategy = DataParallelStrategy(
            module,
            optimizer,
            group=dp_group,
            bucket_numel=int(opt("reduce_bucket_size", 500_000_000)),
            overlap_comm=False,  # See [Note: pipeline gradient reduction]: reduced once, after the backwards
            master_weights=dtype != torch.float32,
        )
        if dtype != torch.float32:
            module.to(dtype)
        return strategy
    return PartitionedOptimizerStrategy(
        module,
        optimizer,
        stage=1,
        group=dp_group,
        dtype=dtype,
        reduce_bucket_size=int(opt("reduce_bucket_size", 500_000_000)),
        allgather_bucket_size=int(opt("allgather_bucket_size", 500_000_000)),
        allgather_partitions=bool(getattr(zero_section, "allgather_partitions", True)),
        overlap_comm=False,
        reduce_scatter=bool(getattr(zero_section, "reduce_scatter", True)),
    )


class StageOptimizer:
    """Reduces, clips and applies the gradients of one stage. See [Note: pipeline gradient reduction]."""

    def __init__(
        self,
        strategy: Any,
        module: Any,
        grid: Any,
        *,
        loss_scaler: LossScaler,
        gradient_clipping: float,
        lr_scheduler: Any = None,
        skip_nonfinite: bool = False,
    ) -> None:
        self.strategy = strategy
        # bf16.check_grad_overflow: skip a step whose global gradient norm is inf/nan
        self.skip_nonfinite = skip_nonfinite
        self.module = module
        self.grid = grid
        self.loss_scaler = loss_scaler
        self.gradient_clipping = float(gradient_clipping)
        self.lr_scheduler = lr_scheduler
        # a device tensor until read (See [Note: scalars stay on the device in the step])
        self.global_grad_norm: float | torch.Tensor | None = None
        self.skipped_steps = 0
        self._dup_norm_sq = torch.zeros((), dtype=torch.float32, device=_backend_device())

    def before_backward(self) -> None:
        """Called before every micro-batch backward: accumulate, do not reduce yet."""
        self.strategy.before_backward(False)

    def reduce_tied(self) -> None:
        self.module.allreduce_tied_weight_gradients()
        self._dup_norm_sq = (
            self._duplicate_tied_norm_sq()
            if self.gradient_clipping > 0
            else torch.zeros((), dtype=torch.float32, device=_backend_device())
        )

    def _duplicate_tied_norm_sq(self) -> torch.Tensor:
        """Squared norm of the data-parallel-averaged tied gradients this stage holds a second copy of."""
        total = torch.zeros((), dtype=torch.float32, device=_backend_device())
        for key, stages in self.module.tied_owner_stages().items():
            if len(stages) < 2 or self.grid.stage_id == stages[0] or key not in self.module.tied_modules:
                continue
            for attr in self.module.tied_weight_attrs[key]:
                grad = self.module.tied_weight(key, attr).grad
                g = grad.detach().float().clone()
                if self.grid.data_parallel_size > 1:
                    _dist.all_reduce(g, group=self.grid.dp_group)
                    g.div_(self.grid.data_parallel_size)
                total += g.pow(2).sum().to(total.device)
        return total

    def reduce_data_parallel(self) -> None:
        """Average the accumulated gradients over the data-parallel replicas (arm, then finish)."""
        self.strategy.before_backward(True)
        self.strategy.after_backward(True)

    def _global_overflow(self) -> bool:
        # the flag stays a device tensor where the backend's collectives run (NCCL: the GPU)
        flag = torch.as_tensor(self.strategy.local_overflow())
        flag = flag.to(device=_backend_device(), dtype=torch.uint8).reshape(1)
        _dist.all_reduce(flag, op=_dist.ReduceOp.MAX)  # every rank of every stage decides alike
        return bool(flag.item())

    def _skip_step(self) -> bool:
        """Drop this step's gradients without applying them (non-finite gradients); returns False."""
        self.global_grad_norm = float("inf")
        self.skipped_steps += 1
        self.strategy.zero_grad()
        return False

    def step(self) -> bool:
        """Clip and apply the gradients; returns False when an fp16 overflow (or, with bf16's
        check_grad_overflow, a non-finite gradient norm) skipped the step."""
        inv_scale = 1.0 / self.loss_scaler.loss_scale
        if self.loss_scaler.checks_overflow and self._global_overflow():
            # fp16 skips an overflowing step whatever the scaler (see [Note: loss scaling])
            self.loss_scaler.update_scale(True)
            skipped = self._skip_step()
            if not self.loss_scaler.dynamic and _dist.get_rank() == 0:
                warn_static_overflow(self.loss_scaler.loss_scale, None, self.skipped_steps)
            return skipped
        norm_sq = self.strategy.grad_norm_sq().float().to(_backend_device())
        group = self.strategy.norm_group()
        if group is not None:
            _dist.all_reduce(norm_sq, group=group)
        norm_sq = norm_sq - self._dup_norm_sq
        if self.grid.pipe_parallel_size > 1:
            _dist.all_reduce(norm_sq, group=self.grid.pp_group)
        norm = norm_sq.clamp(min=0.0).sqrt() * inv_scale
        if self.skip_nonfinite and not bool(torch.isfinite(norm)):
            # reduced over the stages and the replicas above: every rank skips alike
            return self._skip_step()
        self.global_grad_norm = norm
        grad_scale: float | torch.Tensor = inv_scale
        if self.gradient_clipping > 0:  # a device coefficient, no host read
            grad_scale = clip_coefficient(norm, self.gradient_clipping) * inv_scale
        self.strategy.step(grad_scale)
        self.loss_scaler.update_scale(False)
        self.strategy.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    @torch.no_grad()
    def refresh_masters_from_module(self) -> None:
        """After module weights were overwritten (checkpoint load without optimizer states),
        make the fp32 master copies match them."""
        if isinstance(self.strategy, PartitionedOptimizerStrategy):
            for gg in self.strategy.groups:
                for p in gg.params:
                    self.strategy.set_full_fp32_param(p, p.detach().float())
        else:
            for p, m in self.strategy.master.items():
                m.copy_(p.detach().float())
