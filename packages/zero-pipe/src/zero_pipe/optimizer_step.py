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

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from zero_core.config import ZeroConfig
from zero_core.engine.boundary_step import OptimizerBoundaryStep
from zero_core.engine.loss_scaler import LossScaler
from zero_core.engine.strategy_factory import build_strategy as build_zero_strategy
from zero_core.engine.strategy_factory import compute_dtype
from zero_core.utils.param_groups import is_expert_param
from zero_core.zero.stage_1_and_2 import PartitionedOptimizerStrategy

from zero_pipe import _dist

if TYPE_CHECKING:
    from zero_core.engine.strategy import TrainingStrategy
    from zero_core.protocols.training import LRScheduler

    from zero_pipe.module import PipelineModule
    from zero_pipe.topology import PipelineParallelGrid


def _backend_device() -> torch.device:
    """The device of the backend's collectives: the accelerator's current one (NCCL: the GPU)."""
    from zero_core.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


class PipelineConfigError(ValueError):
    """The configuration cannot drive a pipeline."""


def check_zero_stage(stage: object) -> int:
    """The ZeRO stage for a pipeline: 0 or 1; 2 and 3 are a clear error."""
    if stage not in (0, 1):
        raise PipelineConfigError(
            f"config: zero_optimization.stage={stage} is not compatible with pipeline parallelism; use 0 or 1 "
            "(stages 2 and 3 partition gradients/parameters during each micro-batch's backward, "
            "which pipelined micro-batches and tied-weight reduction do not allow)"
        )
    return int(stage)


def check_no_experts_across_stages(module: torch.nn.Module, grid: PipelineParallelGrid) -> None:
    """Mixture-of-Experts layers train in a pipeline of one stage only (collective over the world).

    zero-moe creates its expert-parallel and expert-data-parallel groups over the whole world
    (every rank must create every group, and a stage without the layer never does), and reduces
    expert gradients over them; with several stages those groups would mix ranks of different
    stages. With one stage the ranks are all data-parallel and expert parallelism works as with
    ``ZeroEngine`` (checkpoints included). Every rank learns whether any stage holds experts, so
    all of them raise together rather than some hanging in the first reduction.
    """
    if grid.pipe_parallel_size == 1:
        return
    flag = torch.tensor(
        [float(any(is_expert_param(p) for p in module.parameters()))], device=_backend_device()
    )
    _dist.all_reduce(flag, op=_dist.ReduceOp.MAX)
    if flag.item() > 0:
        raise PipelineConfigError(
            f"PipelineEngine: Mixture-of-Experts layers in a pipeline of {grid.pipe_parallel_size} stages are not "
            "supported (zero-moe's expert groups span the whole world, not one stage's data-parallel ranks); "
            "use num_stages=1 (data and expert parallelism over all ranks) or train the model with ZeroEngine"
        )


def build_strategy(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig,
    dp_group: dist.ProcessGroup | None,
) -> TrainingStrategy:
    """The zero-core training strategy of this stage over its data-parallel group, from zero-core's
    one factory (See [Note: strategy options]), reducing once per batch (``pipeline=True``).

    Casts the module to the compute dtype (fp32 master weights stay in the strategy).
    """
    zc = config.zero_optimization
    check_zero_stage(zc.stage)
    for name in ("offload_optimizer", "offload_param"):
        section = getattr(zc, name)
        if section is not None and section.enabled:
            raise PipelineConfigError(
                f"config: zero_optimization.{name}.device={section.device!r} is not supported with pipeline "
                'parallelism; set it to "none"'
            )
    strategy = build_zero_strategy(module, optimizer, config, dp_group, pipeline=True)
    dtype = compute_dtype(config)
    if zc.stage == 0 and dtype != torch.float32:
        module.to(dtype)  # stage 1's strategy casts the module itself
    return strategy


class StageOptimizer:
    """Reduces, clips and applies the gradients of one stage. See [Note: pipeline gradient reduction]."""

    def __init__(
        self,
        strategy: TrainingStrategy,
        module: PipelineModule,
        grid: PipelineParallelGrid,
        *,
        loss_scaler: LossScaler,
        gradient_clipping: float,
        lr_scheduler: LRScheduler | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        self.strategy = strategy
        # bf16.check_grad_overflow: skip a step whose global gradient norm is inf/nan
        self._boundary = OptimizerBoundaryStep(
            strategy, loss_scaler, device=_backend_device(), skip_nonfinite=skip_nonfinite
        )
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

    def step(self) -> bool:
        """Clip and apply the gradients; returns False when an fp16 overflow (or, with bf16's
        check_grad_overflow, a non-finite gradient norm) skipped the step.

        zero-core's boundary step (See [Note: optimizer boundary step]) with the pipeline's two
        terms: the norm is summed over the stages too, less the tied weights counted twice.
        """
        outcome = self._boundary(
            gradient_clipping=self.gradient_clipping,
            lr_step=None if self.lr_scheduler is None else self.lr_scheduler.step,
            norm_sq_offset=self._dup_norm_sq,
            extra_norm_groups=(self.grid.pp_group,) if self.grid.pipe_parallel_size > 1 else (),
            skipped_before=self.skipped_steps,
        )
        self.global_grad_norm = outcome.norm
        if not outcome.applied:
            self.skipped_steps += 1
        return outcome.applied

    @torch.no_grad()
    def refresh_masters_from_module(self) -> None:
        """After module weights were overwritten (checkpoint load without optimizer states),
        make the fp32 master copies match them."""
        if isinstance(self.strategy, PartitionedOptimizerStrategy):
            for gg in self.strategy.groups:
                for p in gg.params:
                    self.strategy.state_access.set_full_fp32_param(p, p.detach().float())
        else:
            for p, m in self.strategy.master.items():
                m.copy_(p.detach().float())
