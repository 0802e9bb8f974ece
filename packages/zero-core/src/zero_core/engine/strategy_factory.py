"""From a parsed ``ZeroConfig`` to the training strategy of a ZeRO stage, and to the optimizer.

[Note: strategy options]
Every engine that trains with a ZeRO strategy (``initialize``'s ``ZeroEngine``, zero-pipe's
``PipelineEngine``) builds it here, so one config gives one strategy whoever asks. The config
is typed (``ZeroConfig`` and its ``zero_optimization`` section hold every default once); each
strategy's settings are a frozen options dataclass built from those sections
(:class:`DataParallelOptions` here, ``PartitionedOptions`` and ``Stage3Options`` in
``config/strategy_options.py``, below the strategies) and handed to the strategy's constructor
whole, as the typed config sections go whole to zero-offload's builders. A pipeline asks with ``pipeline=True``: it
reduces once after all micro-batches' backwards (no overlap, See [Note: pipeline gradient
reduction] in zero-pipe) and runs stage 0 or 1 only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.config import ZeroConfig
from zero_core.config.strategy_options import (  # noqa: F401 (COMM_DTYPES, master_dtype: re-exported)
    COMM_DTYPES,
    PartitionedOptions,
    Stage3Options,
    accum_dtype,
    comm_dtype,
    compute_dtype,
    master_dtype,
)
from zero_core.engine.eval_only import is_eval_only
from zero_core.plugins import require
from zero_core.protocols.optimizer_offload import OptimizerOffload
from zero_core.protocols.shard_store import PLAIN_SHARDS, ShardStore

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

    from zero_core.engine.strategy import TrainingStrategy


@dataclass(frozen=True)
class DataParallelOptions:
    """Settings of :class:`~zero_core.engine.data_parallel.DataParallelStrategy` (stage 0)."""

    bucket_numel: int
    overlap_comm: bool
    comm_dtype: torch.dtype | None
    predivide_factor: float
    master_weights: bool
    prescale: bool
    accum_dtype: torch.dtype | None
    sparse_gradients: bool

    @classmethod
    def from_config(
        cls, cfg: ZeroConfig, *, eval_only: bool = False, pipeline: bool = False
    ) -> DataParallelOptions:
        from zero_core.engine.grad_buckets import STAGE0_DEFAULT_BUCKET_NUMEL

        zc = cfg.zero_optimization
        # See [Note: gradient buckets] for why stage 0 has its own default bucket size.
        explicit_bucket = "reduce_bucket_size" in zc.model_fields_set
        return cls(
            bucket_numel=int(zc.reduce_bucket_size) if explicit_bucket else STAGE0_DEFAULT_BUCKET_NUMEL,
            # the section resolves its None default per stage (False below stage 3)
            overlap_comm=False if pipeline else bool(zc.overlap_comm),
            comm_dtype=comm_dtype(cfg),
            predivide_factor=float(cfg.gradient_predivide_factor),
            master_weights=compute_dtype(cfg) != torch.float32 and not eval_only,
            prescale=bool(cfg.prescale_gradients),
            accum_dtype=accum_dtype(cfg),
            sparse_gradients=bool(cfg.sparse_gradients),
        )


def optimizer_offload(
    module: torch.nn.Module, cfg: ZeroConfig, group: dist.ProcessGroup | None, dtype: torch.dtype
) -> OptimizerOffload | None:
    """zero-offload's ``OptimizerOffload`` when ``offload_optimizer.device`` is cpu/nvme, else None."""
    zc = cfg.zero_optimization
    oo = zc.offload_optimizer
    if oo is None or not oo.enabled:
        return None
    mod = require("zero_offload", f'zero_optimization.offload_optimizer.device "{oo.device}"')
    first = next(module.parameters(), None)
    return mod.build_optimizer_offload(
        zc,
        cfg.aio,
        rank=comm.get_rank(group),
        compute_device=first.device if first is not None else torch.device("cpu"),
        dtype=dtype,
    )


def param_offload(cfg: ZeroConfig, group: dist.ProcessGroup | None) -> ShardStore:
    """zero-offload's ``ParamOffload`` when ``offload_param.device`` is cpu/nvme (stage 3), else
    the plain store (See [Note: shard store seam])."""
    zc = cfg.zero_optimization
    op = zc.offload_param
    if op is None or not op.enabled:
        return PLAIN_SHARDS
    mod = require("zero_offload", f'zero_optimization.offload_param.device "{op.device}"')
    return mod.build_param_offload(zc, cfg.aio, rank=comm.get_rank(group))


def build_strategy(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: ZeroConfig,
    group: dist.ProcessGroup | None,
    *,
    pipeline: bool = False,
) -> TrainingStrategy:
    """The training strategy of ``cfg``'s ZeRO stage over ``group``. See [Note: strategy options].

    Only stage 3 casts the module itself (it partitions the parameters); for the other stages
    the caller casts it to the compute dtype after this (fp32 master weights come first).
    """
    stage = int(cfg.zero_optimization.stage)
    eval_only = is_eval_only(optimizer)  # See [Note: engine without an optimizer]
    if pipeline and stage not in (0, 1):
        raise ValueError(f"a pipeline trains with ZeRO stage 0 or 1, got {stage}")
    if not eval_only:
        from zero_core.engine.sparse_grads import check_no_sparse_gradients

        check_no_sparse_gradients(module, stage)  # See [Note: sparse gradient reduction]
    if stage == 0 or (eval_only and stage in (1, 2)):
        from zero_core.engine.data_parallel import DataParallelStrategy

        dp = DataParallelOptions.from_config(cfg, eval_only=eval_only, pipeline=pipeline)
        return DataParallelStrategy(module, optimizer, dp, group=group)
    if stage in (1, 2):
        from zero_core.zero.stage_1_and_2 import PartitionedOptimizerStrategy

        po = PartitionedOptions.from_config(cfg, pipeline=pipeline)
        offload = optimizer_offload(module, cfg, group, po.dtype)
        return PartitionedOptimizerStrategy(module, optimizer, po, group=group, optimizer_offload=offload)
    if stage == 3:
        # Partitioning and the 16-bit cast of parameters are the strategy's business here.
        from zero_core.zero.stage3.shard_groups import build_route
        from zero_core.zero.stage3.strategy import Stage3Strategy

        zc = cfg.zero_optimization
        s3 = Stage3Options.from_config(cfg, eval_only=eval_only)
        # MiCS / hpZ groups, validated against the world before any step: See [Note: MiCS and hpZ shard groups]
        route = build_route(
            group,
            int(zc.mics_shard_size),
            bool(zc.mics_hierarchical_params_gather),
            int(zc.zero_hpz_partition_size),
        )
        return Stage3Strategy(
            module,
            optimizer,
            s3,
            group=group,
            optimizer_offload=None if eval_only else optimizer_offload(module, cfg, group, s3.dtype),
            param_offload=param_offload(cfg, group),
            route=route,
        )
    raise NotImplementedError(f"zero_optimization.stage {stage} is not available in this build")


def build_optimizer(
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None,
    params: ParamsT,
    cfg: ZeroConfig,
    *,
    required_by: str | None = None,
) -> torch.optim.Optimizer:
    """The optimizer ``initialize`` trains with: the client's, built by the client's callable, or
    from the config's ``optimizer`` section.

    Without any of them: ``required_by`` names who needs one (an error saying so), else the
    engine evaluates only (See [Note: engine without an optimizer]).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if optimizer is not None:
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}"
            )
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer"
            )
        return built
    section = cfg.optimizer
    if section is None or section.type is None:
        if required_by is not None:
            raise ValueError(
                f"initialize: no optimizer for {required_by}: pass optimizer= or add an 'optimizer' "
                "section to the config"
            )
        from zero_core.engine.eval_only import EvalOnlyOptimizer

        # See [Note: engine without an optimizer]
        return EvalOnlyOptimizer(params)
    from zero_core.optim import build_optimizer as build_named

    return build_named(params, section.type, dict(section.params or {}))
