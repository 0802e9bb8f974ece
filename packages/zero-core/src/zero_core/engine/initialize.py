"""``initialize``: from a model, an optimizer and a DeepSpeed-format config to a training engine.

Order matters and is the same for every stage: (1) distributed init, (2) config (the batch
sizes need the data-parallel world size), (3) model on the device in fp32 and identical on
every rank (broadcast from rank 0), (4) optimizer and LR scheduler, (5) the stage's strategy
(which may create fp32 master weights from the still-fp32 parameters), (6) the cast of the
module to fp16/bf16, (7) data loader and monitors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zero_core import comm
from zero_core.config import ZeroConfig
from zero_core.engine.agreement import check_agreement, initialize_fields
from zero_core.engine.data import ZeroDataLoader
from zero_core.engine.engine import ZeroEngine
from zero_core.engine.eval_only import is_eval_only
from zero_core.engine.loss_scaler import build_loss_scaler
from zero_core.engine.strategy_factory import build_optimizer, build_strategy, compute_dtype
from zero_core.plugins import require
from zero_core.protocols.training import LRScheduler, ModelParallelUnit

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT
    from torch.utils.data import Dataset

    from zero_core.config.loader import ConfigSource
    from zero_core.engine.model_engines import ModelEngineHook

#: what ``initialize(optimizer=...)`` takes: an optimizer, a callable building one from the parameters, or None.
ClientOptimizer = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
#: what ``initialize(lr_scheduler=...)`` takes: a scheduler, a callable (or class) building one from the optimizer, or None.
ClientScheduler = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None

__all__ = ["compute_dtype", "initialize"]


def _broadcast_module(module: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every rank start from the same parameters and buffers.

    Each parameter comes from the first rank of the group it is reduced over: the
    data-parallel group, or for an expert parameter its expert-data-parallel group (ranks of
    one expert-parallel group hold different experts). See [Note: expert parameters].
    """
    if comm.get_world_size(group) == 1:
        return
    from zero_core.utils.param_groups import reduction_groups

    with torch.no_grad():
        for reduce_group, params in reduction_groups(list(module.parameters()), group):
            if comm.get_world_size(reduce_group) == 1:
                continue
            src = comm.get_global_rank(reduce_group, 0) if reduce_group is not None else 0
            for p in params:
                comm.broadcast(p.data, src=src, group=reduce_group)
        src = comm.get_global_rank(group, 0) if group is not None else 0
        for b in module.buffers():
            comm.broadcast(b.data, src=src, group=group)


def _build_scheduler(
    lr_scheduler: ClientScheduler, optimizer: torch.optim.Optimizer, cfg: ZeroConfig
) -> LRScheduler | None:
    if is_eval_only(optimizer):
        if lr_scheduler is not None or cfg.scheduler is not None:
            raise ValueError(
                "initialize: an LR scheduler (lr_scheduler= or a 'scheduler' section) needs an optimizer; "
                "pass optimizer= or add an 'optimizer' section, or drop the scheduler for evaluation"
            )
        return None
    if lr_scheduler is not None:
        # A scheduler class is a callable too (it has a ``step`` attribute, unbound): call it.
        if isinstance(lr_scheduler, type) or (callable(lr_scheduler) and not hasattr(lr_scheduler, "step")):
            built = lr_scheduler(optimizer)
            if not callable(getattr(built, "step", None)):
                raise TypeError(
                    f"initialize: the lr_scheduler callable returned {type(built).__name__}, "
                    "which has no step() method"
                )
            return built
        if not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(
                f"initialize: lr_scheduler must be a scheduler (with step()) or a callable taking the "
                f"optimizer, got {type(lr_scheduler).__name__}"
            )
        return lr_scheduler
    section = cfg.scheduler
    if section is None:
        return None
    from zero_core.lr_schedules import build_lr_scheduler

    return build_lr_scheduler(optimizer, {"type": section.type, "params": dict(section.params)})


def _explicit(cfg: ZeroConfig, name: str) -> bool:
    """Whether the user's config gave section ``name`` (not just its defaults)."""
    return name in cfg.model_fields_set


def _apply_comms_timeout(cfg: ZeroConfig) -> None:
    """``comms_timeout`` bounds every collective (see [Note: collective watchdog])."""
    seconds = cfg.comms_timeout
    if seconds is not None:
        comm.watchdog.set_collective_timeout(float(seconds))
    comm.watchdog.get_watchdog()  # started now, so its records exist before the first step


#: config sections that only another package of the family acts on: section -> (import name, what).
#: (``moe`` is not one: MoE layers take their settings in code and the section configures nothing,
#: its keys are errors when set, see config/unimplemented.py.)
OWNED_SECTIONS = {
    "pipeline": ("zero_pipe", "pipeline parallelism"),
}


def _require_section_owners(cfg: ZeroConfig) -> None:
    """A section the user gave whose package is missing is an error naming that package.

    zero-core validates these sections (a config file stays checkable with zero-core alone),
    but nothing in zero-core acts on them: training with one would silently ignore it.
    """
    for name, (module, what) in OWNED_SECTIONS.items():
        if _explicit(cfg, name):
            require(module, f"the config's '{name}' section ({what})")


def _configure_side_systems(cfg: ZeroConfig) -> None:
    """Communication logging and activation checkpointing read their config sections here."""
    if _explicit(cfg, "comms_logger"):
        comm.comms_logger.configure(cfg.comms_logger.model_dump())
    if _explicit(cfg, "activation_checkpointing"):
        from zero_core.activation_checkpointing import checkpointing

        checkpointing.configure_from_initialize(cfg)


def _build_profiler(model: torch.nn.Module, cfg: ZeroConfig, engine: ZeroEngine) -> Any:
    """zero-profiler's per-step profiler when ``flops_profiler.enabled`` (warn if not installed)."""
    section = cfg.flops_profiler
    if not getattr(section, "enabled", False):  # a plugin section: its fields are the plugin's
        return None
    from zero_core.plugins import is_available

    if not is_available("zero_profiler"):
        import warnings

        warnings.warn(
            "flops_profiler.enabled is set but the 'zero-profiler' package is not installed "
            "(pip install packages/zero-profiler from a clone); training continues without the profile",
            stacklevel=3,
        )
        return None
    from zero_profiler.engine_hook import StepProfiler

    data = section.model_dump() if hasattr(section, "model_dump") else dict(section)
    return StepProfiler(model, data, engine=engine, rank=comm.get_rank() if comm.is_initialized() else 0)


def _check_compressed_optimizer(cfg: ZeroConfig, optimizer: ClientOptimizer, is_pipeline: bool) -> None:
    """1-bit Adam, 0/1 Adam and 1-bit LAMB run on plain data parallelism only (as in DeepSpeed).

    Told apart by what the stage-0 strategy asks them, ``communicates_gradients`` (zero-ops'
    [Note: communication-compressed optimizers]): zero-core imports no optimizer of zero-ops."""
    section = cfg.optimizer
    named = (section.type if section is not None else "").replace("_", "").lower()
    if callable(getattr(optimizer, "communicates_gradients", None)):
        name = type(optimizer).__name__
    elif optimizer is None and named in ("onebitadam", "zerooneadam", "onebitlamb"):
        name = f"optimizer.type {section.type!r}"
    else:
        return
    stage = int(cfg.zero_optimization.stage)
    if is_pipeline or stage != 0:
        what = "pipeline parallelism" if is_pipeline else f"zero_optimization.stage {stage}"
        raise ValueError(
            f"{name} does its own compressed data-parallel communication and runs with plain data "
            f"parallelism only (zero_optimization.stage 0, no pipeline), as in DeepSpeed; it cannot be "
            f"combined with {what}: use stage 0 or another optimizer"
        )


def initialize(
    args: object = None,
    model: torch.nn.Module | None = None,
    optimizer: ClientOptimizer = None,
    model_parameters: ParamsT | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: ClientScheduler = None,
    distributed_port: int = 29500,
    mpu: ModelParallelUnit | None = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: ConfigSource | None = None,
    config_params: ConfigSource | None = None,
) -> tuple[ZeroEngine, torch.optim.Optimizer, Any, Any]:
    """Build the training engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if model is None:
        raise ValueError("initialize: model is required")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is not None and config_params is not None:
        raise ValueError("initialize: give the config as config= or config_params=, not both")
    from zero_core.distributed import init_distributed

    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    # measured before anything is built: see engine/autotuning_experiment.py
    from zero_core.engine.autotuning_experiment import attach_experiment_hook, experiment_baseline

    baseline = experiment_baseline(model)
    group = mpu.get_data_parallel_group() if mpu is not None else None
    cfg, model_engine, dp_world = _agreed_config(model, optimizer, config, config_params, args, mpu, group)
    if model_engine is not None:
        return model_engine.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            config=cfg,
            collate_fn=collate_fn,
        )
    loader = None
    if training_data is not None:
        loader = ZeroDataLoader(
            training_data,
            int(cfg.train_micro_batch_size_per_gpu),
            rank=comm.get_rank(group),
            world_size=dp_world,
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
        )
    engine, scheduler = _build_engine(model, optimizer, model_parameters, lr_scheduler, loader, cfg, group)
    attach_experiment_hook(cfg, engine, baseline)
    return engine, engine.optimizer, loader, scheduler


def _agreed_config(
    model: torch.nn.Module,
    optimizer: ClientOptimizer,
    config: ConfigSource | None,
    config_params: ConfigSource | None,
    args: object,
    mpu: ModelParallelUnit | None,
    group: dist.ProcessGroup | None,
) -> tuple[ZeroConfig, ModelEngineHook | None, int]:
    """The parsed config every rank agreed on, the model's engine hook (None: ZeroEngine) and the
    data-parallel world size the batch sizes are per."""
    from zero_core.config import load_config
    from zero_core.distributed import world_info
    from zero_core.engine.model_engines import find_model_engine

    dp_world = comm.get_world_size(group)
    # A PipelineModule (or a subclass) goes to zero-pipe: See [Note: model engine hooks].
    model_engine = find_model_engine(model)
    if model_engine is not None and mpu is None:
        # e.g. a pipeline's data-parallel degree is the world divided by its stages: batch
        # sizes are per data-parallel replica, not per process.
        dp_world = model_engine.data_parallel_world_size(model, comm.get_world_size())
    cfg = load_config(
        config if config is not None else config_params,
        args=args,
        world_size=dp_world,
        world_size_source=world_info().source,
    )
    _require_section_owners(cfg)
    _apply_comms_timeout(cfg)
    # The first collective of the engine: every rank reaches it (see [Note: rank agreement]).
    check_agreement(initialize_fields(cfg, model, pipeline=model_engine is not None), group, "initialize")
    _configure_side_systems(cfg)
    _check_compressed_optimizer(cfg, optimizer, model_engine is not None)
    return cfg, model_engine, dp_world


def _build_engine(
    model: torch.nn.Module,
    optimizer: ClientOptimizer,
    model_parameters: ParamsT | None,
    lr_scheduler: ClientScheduler,
    loader: ZeroDataLoader | None,
    cfg: ZeroConfig,
    group: dist.ProcessGroup | None,
) -> tuple[ZeroEngine, LRScheduler | None]:
    """Steps (3)-(6) of the module docstring's order and the monitors: the ``ZeroEngine`` and its
    LR scheduler."""
    from zero_core.accelerator import get_accelerator
    from zero_core.monitor import MonitorMaster

    acc = get_accelerator()
    device = acc.device(acc.current_device())
    model.to(device)
    _broadcast_module(model, group)
    params = model_parameters if model_parameters is not None else model.parameters()
    opt = build_optimizer(optimizer, params, cfg)
    strategy = build_strategy(model, opt, cfg, group)
    dtype = compute_dtype(cfg)
    if dtype != torch.float32 and (int(cfg.zero_optimization.stage) == 0 or _replicated_eval(opt, cfg)):
        model.to(dtype)
    scheduler = _build_scheduler(lr_scheduler, strategy.optimizer, cfg)
    engine = ZeroEngine(
        model,
        strategy,
        config=cfg,
        loss_scaler=build_loss_scaler(cfg.fp16.enabled, cfg.fp16),
        lr_scheduler=scheduler,
        training_dataloader=loader,
        monitor=MonitorMaster(cfg),
        device=device,
        dp_group=group,
        compute_dtype=dtype,
    )
    engine.profiler = _build_profiler(model, cfg, engine)
    if cfg.dump_state:
        from zero_core.engine.state_report import dump_engine_state

        dump_engine_state(engine)
    return engine, scheduler


def _replicated_eval(optimizer: torch.optim.Optimizer, cfg: ZeroConfig) -> bool:
    """An optimizer-less engine at stage 1 or 2 is plain data parallel (See [Note: engine without an optimizer])."""
    return is_eval_only(optimizer) and int(cfg.zero_optimization.stage) in (1, 2)
