"""``initialize_pipeline``: what ``zero.initialize(model=PipelineModule, ...)`` hands over to.

zero-core's ``initialize`` sets up the process group and parses the config, then, seeing a
:class:`PipelineModule`, calls this function, which returns the same 4-tuple as for any model:
``(engine, optimizer, training_dataloader, lr_scheduler)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from zero_core.config import ZeroConfig
from zero_core.engine.data import ZeroDataLoader
from zero_core.engine.strategy_factory import build_optimizer

from zero_pipe.data import RepeatingLoader
from zero_pipe.engine import PipelineEngine
from zero_pipe.module import PipelineModule
from zero_pipe.optimizer_step import PipelineConfigError

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT
    from torch.utils.data import Dataset
    from zero_core.engine.initialize import ClientScheduler
    from zero_core.protocols.training import LRScheduler


def _scheduler(
    lr_scheduler: ClientScheduler, optimizer: torch.optim.Optimizer, cfg: ZeroConfig
) -> LRScheduler | None:
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    section = cfg.scheduler
    if section is None:
        return None
    from zero_core.lr_schedules import build_lr_scheduler

    return build_lr_scheduler(optimizer, {"type": section.type, "params": dict(section.params)})


def _apply_pipeline_section(model: PipelineModule, cfg: ZeroConfig) -> None:
    section = getattr(cfg, "pipeline", None)
    if section is None:
        return
    stages = getattr(section, "stages", "auto")
    if stages != "auto" and stages != model.num_stages:
        raise PipelineConfigError(
            f"config: pipeline.stages={stages} but the PipelineModule has {model.num_stages} stages; "
            'set pipeline.stages to "auto" or to the module\'s num_stages'
        )
    interval = int(getattr(section, "activation_checkpoint_interval", 0) or 0)
    if interval and model.activation_checkpoint_interval == 0:
        model.activation_checkpoint_interval = interval


def initialize_pipeline(
    *,
    model: PipelineModule,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None,
    model_parameters: ParamsT | None,
    training_data: Dataset | None,
    lr_scheduler: ClientScheduler,
    config: ZeroConfig,
    collate_fn: Callable[..., Any] | None = None,
) -> tuple[PipelineEngine, torch.optim.Optimizer, Any, Any]:
    """Build the :class:`PipelineEngine` of ``model`` from a parsed config.

    The optimizer and scheduler come from the arguments or the config's ``optimizer`` /
    ``scheduler`` sections; ``training_data`` (a dataset) becomes a loader over this stage's
    data-parallel replica. Returns ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    if not isinstance(model, PipelineModule):
        raise TypeError(f"initialize_pipeline: model must be a PipelineModule, got {type(model).__name__}")
    if model.grid() is None:
        raise ValueError(
            "initialize_pipeline: the PipelineModule was built before the process group existed; call "
            "zero.init_distributed() before constructing it"
        )
    if not isinstance(config, ZeroConfig):
        raise TypeError(
            f"initialize_pipeline: config must be a parsed ZeroConfig, got {type(config).__name__}"
        )
    _apply_pipeline_section(model, config)
    params = model_parameters if model_parameters is not None else model.parameters()
    opt = build_optimizer(optimizer, params, config, required_by="the pipeline")
    engine = PipelineEngine(model, opt, config)
    scheduler = _scheduler(lr_scheduler, engine.optimizer, config)
    engine.stage_optimizer.lr_scheduler = scheduler
    if config.dump_state:
        from zero_core.engine.state_report import dump_engine_state

        dump_engine_state(engine)
    loader = None
    if training_data is not None:
        grid = model.grid()
        loader = ZeroDataLoader(
            training_data,
            engine.train_micro_batch_size_per_gpu(),
            rank=grid.data_parallel_id,
            world_size=grid.data_parallel_size,
            collate_fn=collate_fn,
        )
        engine.training_dataloader = loader
        # As DeepSpeed's pipeline engine: train_batch() without an argument repeats this loader.
        engine.set_dataiterator(iter(RepeatingLoader(loader)))
    return engine, engine.optimizer, loader, scheduler


class PipelineModelEngine:
    """zero-pipe's hook for ``zero.initialize`` (entry point group ``zero.model_engines``):
    a :class:`PipelineModule`, or any subclass, trains with :class:`PipelineEngine`.
    See [Note: model engine hooks] in zero-core's ``engine/model_engines.py``."""

    def accepts(self, model: object) -> bool:
        return isinstance(model, PipelineModule)

    def data_parallel_world_size(self, model: PipelineModule, world_size: int) -> int:
        return max(1, world_size // int(model.num_stages))

    def initialize(self, **kwargs: Any) -> tuple[PipelineEngine, torch.optim.Optimizer, Any, Any]:
        return initialize_pipeline(**kwargs)


#: the object the ``zero.model_engines`` entry point names
MODEL_ENGINE = PipelineModelEngine()
