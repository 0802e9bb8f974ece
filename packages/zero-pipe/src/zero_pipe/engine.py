"""``PipelineEngine``: the batch/step API of pipeline training on a :class:`PipelineModule`.

One ``train_batch`` runs ``gradient_accumulation_steps`` micro-batches through the 1F1B
schedule (the interleaved one when the module holds several chunks, see [Note: model chunks]),
averages the loss over them (each backward uses ``loss / micro_batches``), then reduces,
clips and applies the gradients (see [Note: pipeline gradient reduction]). The result matches
one process training the whole ``nn.Sequential`` on the whole batch with a mean loss.

This module builds the stage (config, ZeRO strategy, optimizer) and owns the public API; what
happens inside a batch (instructions, transfers, trace) is :class:`StageExecutor`'s, in
``executor.py`` (see [Note: receive prefetch] there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from zero_core.config import ZeroConfig, load_config
from zero_core.engine.loss_scaler import LossScaler, build_loss_scaler
from zero_core.engine.state_report import breakdown_text
from zero_core.engine.strategy_factory import compute_dtype
from zero_core.protocols.training import LRScheduler

from zero_pipe import _dist
from zero_pipe.config_checks import check_pipeline_config
from zero_pipe.executor import ComputeSpan, StageExecutor
from zero_pipe.module import PipelineModule
from zero_pipe.optimizer_step import (
    PipelineConfigError,
    StageOptimizer,
    build_strategy,
    check_no_experts_across_stages,
    check_zero_stage,
)
from zero_pipe.schedule import (
    InferenceSchedule,
    InterleavedInferenceSchedule,
    InterleavedTrainSchedule,
    PipeSchedule,
    TrainSchedule,
)

__all__ = ["ComputeSpan", "PipelineConfigError", "PipelineEngine"]


class PipelineEngine:
    """Hybrid pipeline + data-parallel training of a :class:`PipelineModule`.

    ``config`` is a DeepSpeed-format mapping or a parsed ``ZeroConfig``: the batch triple
    (``gradient_accumulation_steps`` is the number of micro-batches per batch),
    ``zero_optimization.stage`` (0 or 1), ``fp16``/``bf16``, ``gradient_clipping``,
    ``pipeline.lookahead`` (see [Note: 1F1B lookahead]). Each
    ``data_iter`` item is one micro-batch ``(inputs, labels)``; the first stage uses the inputs,
    the last stage the labels, so both should be given the same data. ``has_bool_tensors`` is
    accepted for DeepSpeed compatibility: bool activations are always supported.
    """

    def __init__(
        self,
        module: PipelineModule,
        optimizer: torch.optim.Optimizer,
        config: Mapping[str, Any] | ZeroConfig,
        lr_scheduler: LRScheduler | None = None,
        *,
        has_bool_tensors: bool = False,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine: module must be a PipelineModule, got {type(module)}")
        if module.grid() is None:
            raise ValueError(
                "PipelineEngine: the PipelineModule was built without a process group; init one first"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"PipelineEngine: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}"
            )
        if not isinstance(has_bool_tensors, bool):
            raise TypeError(f"PipelineEngine: has_bool_tensors must be a bool, got {has_bool_tensors!r}")
        self.module = module
        self.grid = module.grid()
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.pipe_parallel_size
        self.num_chunks = module.num_chunks
        self.dp_size = self.grid.data_parallel_size
        self.has_bool_tensors = has_bool_tensors
        self.config = self._load_config(config)
        # DeepSpeed's engine attribute; pipelines refuse sparse gradients (config_checks.py), so
        # no module of a stage has them
        self.sparse_tensor_module_names: set[str] = set()
        check_zero_stage(self.config.zero_optimization.stage)
        check_no_experts_across_stages(module, self.grid)
        check_pipeline_config(self.config, module)
        if getattr(getattr(self.config, "progressive_layer_drop", None), "enabled", False):
            # See [Note: progressive layer drop] in zero_core.engine.progressive_layer_drop
            raise PipelineConfigError(
                "progressive_layer_drop: the pipeline engine cannot pass progressive_layer_drop/pld_theta "
                "to the stages of a PipelineModule (DeepSpeed's pipeline forward fails with a TypeError "
                "there); switch the section off or train the model without pipeline parallelism"
            )
        self.micro_batch_size = int(self.config.train_micro_batch_size_per_gpu)
        self.micro_batches = int(self.config.gradient_accumulation_steps)
        self._train_batch_size = self.micro_batch_size * self.micro_batches * self.dp_size
        self.compute_dtype = compute_dtype(self.config)
        section = getattr(self.config, "pipeline", None)
        #: extra 1F1B warm-up forwards: See [Note: 1F1B lookahead]
        self.lookahead = int(getattr(section, "lookahead", 0) or 0)
        self.strategy = build_strategy(module, optimizer, self.config, self.grid.dp_group)
        self.loss_scaler = loss_scaler or build_loss_scaler(self.config.fp16.enabled, self.config.fp16)
        self.stage_optimizer = StageOptimizer(
            self.strategy,
            module,
            self.grid,
            loss_scaler=self.loss_scaler,
            gradient_clipping=float(self.config.gradient_clipping or 0.0),
            lr_scheduler=lr_scheduler,
            skip_nonfinite=bool(self.config.bf16.enabled and self.config.bf16.check_grad_overflow),
        )
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.global_steps = 0
        self.global_samples = 0
        #: the loader over ``initialize``'s ``training_data`` (set by ``initialize_pipeline``)
        self.training_dataloader: Iterable[object] | None = None
        self._print_clock = time.perf_counter()
        #: schedules by what they depend on; building one plans the whole pipeline
        self._schedules: dict[tuple, PipeSchedule] = {}
        #: runs the instructions of each batch: See [Note: receive prefetch]
        self.executor = StageExecutor(module, self.stage_optimizer, self.loss_scaler, self.compute_dtype)

    def _load_config(self, config: Mapping[str, Any] | ZeroConfig) -> ZeroConfig:
        source = f"pipeline data-parallel size (world / {self.num_stages} stages)"
        if isinstance(config, ZeroConfig):
            sizes = config.batch_sizes
            if sizes is not None and sizes.world_size != self.dp_size:
                # Resolved for another world size: keep the micro batch and the number of micro-batches.
                config = config.model_copy(update={"train_batch_size": None})
            return config.with_batch_sizes(self.dp_size, source)
        if not isinstance(config, Mapping):
            raise TypeError(f"PipelineEngine: config must be a mapping or a ZeroConfig, got {type(config)}")
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        check_zero_stage(stage)  # before load_config, for the pipeline-specific message
        raw = dict(config)
        raw.setdefault("gradient_clipping", 0.0)  # a plain dict means no clipping unless asked
        return load_config(raw, world_size=self.dp_size, world_size_source=source)

    # -- public API ----------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def lr_scheduler(self) -> LRScheduler | None:
        return self.stage_optimizer.lr_scheduler

    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.micro_batches

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.executor.at_boundary

    @property
    def trace(self) -> list[ComputeSpan] | None:
        """When a list, ``train_batch``/``eval_batch`` append one :class:`ComputeSpan` per
        forward, backward and receive wait of this stage."""
        return self.executor.trace

    @trace.setter
    def trace(self, value: list[ComputeSpan] | None) -> None:
        if value is not None and not isinstance(value, list):
            raise TypeError(f"PipelineEngine.trace must be a list or None, got {type(value)}")
        self.executor.trace = value

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (all stages) of the last step, before clipping (kept on the
        device by the step, read to the host here)."""
        norm = self.stage_optimizer.global_grad_norm
        if isinstance(norm, torch.Tensor):
            norm = self.stage_optimizer.global_grad_norm = float(norm)
        return norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank by category, measured from live tensors."""
        return self.strategy.memory_breakdown()

    @property
    def device(self) -> torch.device:
        """The device this stage computes on (DeepSpeed's attribute; scripts build their data there)."""
        from zero_pipe.optimizer_step import _backend_device

        return _backend_device()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for an fp16 overflow (DeepSpeed's counter)."""
        return self.stage_optimizer.skipped_steps

    def set_dataloader(self, loader: Iterable[object]) -> None:
        """DeepSpeed's: train on ``loader`` (an iterator over it on the first and last stages)."""
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"set_dataloader: expected an iterable data loader, got {type(loader)}")
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    # DeepSpeed's engine is an nn.Module wrapping the model, so user code walks its parameters
    # through the engine (``engine.parameters()`` in DeepSpeed's own pipeline checkpoint tests):
    # the same walks here, over this stage's PipelineModule.
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.module.modules()

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
        return self.module.named_modules(prefix=prefix)

    def empty_partition_cache(self) -> None:
        """Release parameters kept gathered between steps, as the ZeRO engine's method does.

        A pipeline stage runs ZeRO stage 0 or 1, which keeps no gathered copies, so there is
        nothing to release unless the stage's strategy holds such a cache. DeepSpeed's pipeline
        engine inherits the method; its checkpoint tests call it on every engine."""
        release = getattr(self.strategy, "empty_partition_cache", None)
        if release is not None:
            release()

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        if not hasattr(iterator, "__next__"):
            raise TypeError(f"set_dataiterator: expected an iterator, got {type(iterator)}")
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"set_batch_fn: fn must be callable, got {fn!r}")
        self.batch_fn = fn

    def set_train_batch_size(self, train_batch_size: int) -> None:
        per_step = self.micro_batch_size * self.dp_size
        if (
            not isinstance(train_batch_size, int)
            or isinstance(train_batch_size, bool)
            or train_batch_size < 1
            or train_batch_size % per_step
        ):
            raise ValueError(
                f"set_train_batch_size: {train_batch_size!r} must be a positive multiple of micro batch "
                f"{self.micro_batch_size} * data-parallel size {self.dp_size}"
            )
        self.micro_batches = train_batch_size // per_step
        self._train_batch_size = train_batch_size

    def reset_activation_shape(self) -> None:
        """Forget cached activation shapes (call on every rank when they change)."""
        self.executor.reset_activation_shape()

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "PipelineEngine: forward() is disabled for pipeline parallelism; use train_batch()"
        )

    def backward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "PipelineEngine: backward() is disabled for pipeline parallelism; use train_batch()"
        )

    def step(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("PipelineEngine: step() is disabled for pipeline parallelism; use train_batch()")

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch; returns the mean loss over micro-batches (and data-parallel replicas).

        Without ``data_iter`` the batch comes from the iterator set before: ``set_dataiterator``,
        an earlier ``data_iter``, or (as DeepSpeed) a repeating loader over the ``training_data``
        given to ``initialize``."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise ValueError(
                "train_batch: no data iterator; pass data_iter, call set_dataiterator(), or give "
                "training_data to initialize()"
            )
        self.module.train()
        result = self.executor.run(self._schedule(True, self.micro_batches), self._next_batch, training=True)
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        loss = self._aggregate_loss(result.losses, reduce_output="avg", bcast=True)
        self._print_progress(loss)
        return loss

    def _print_progress(self, loss: torch.Tensor) -> None:
        """Every ``steps_per_print`` batches global rank 0 prints DeepSpeed's pipeline progress line
        (``steps: N loss: L iter time (s): T samples/sec: S``), timed since the last line."""
        every = self.config.steps_per_print or 10  # None: the default interval
        if self.global_steps % every:
            return
        now = time.perf_counter()
        iter_time, self._print_clock = (now - self._print_clock) / every, now
        if _dist.get_rank() == 0:  # the loss was broadcast to every stage, so rank 0 has it
            line = f"steps: {self.global_steps} loss: {loss.item():0.4f} iter time (s): {iter_time:0.3f}"
            throughput = getattr(getattr(self.config, "timers", None), "throughput", None)
            if getattr(throughput, "enabled", True):  # timers.throughput.enabled
                line += f" samples/sec: {self._train_batch_size / iter_time:0.3f}"
            if self.config.memory_breakdown:
                line += " | " + breakdown_text(self.memory_breakdown())
            print(line, flush=True)

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default: gradient accumulation steps) micro-batches
        without gradients; returns the loss (with ``compute_loss=False``, the outputs averaged as
        DeepSpeed does), and with ``return_logits`` also the last stage's list of outputs, one per
        micro-batch (DeepSpeed keeps only the last micro-batch's)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(f"eval_batch: data_iter must be an iterator, got {type(data_iter)}")
        mbs = self.micro_batches if num_micro_batches is None else num_micro_batches
        if not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1:
            raise ValueError(f"eval_batch: num_micro_batches must be an int >= 1, got {mbs!r}")
        saved = self.data_iterator
        self.data_iterator = data_iter
        self.module.eval()
        schedule = self._schedule(False, mbs)
        try:
            with torch.no_grad():
                ran = self.executor.run(schedule, self._next_batch, training=False, compute_loss=compute_loss)
        finally:
            self.data_iterator = saved
        outputs = ran.outputs if self.is_last_stage() else None
        if compute_loss:
            result: Any = self._aggregate_loss(ran.losses, reduce_output, bcast_loss)
        else:  # DeepSpeed reduces the outputs themselves ("models that return their loss")
            result = self._average_outputs(outputs, reduce_output)
        if return_logits:
            return result, outputs
        return result

    def _average_outputs(self, outputs: list[Any] | None, reduce_output: str | None) -> Any:
        """eval_batch(compute_loss=False): the last stage's outputs, element-wise averaged over the
        micro-batches and data-parallel replicas with ``reduce_output="avg"`` (a list with None);
        None on the other stages, as DeepSpeed (nothing is broadcast)."""
        if outputs is None or reduce_output is None:
            return outputs

        def average(parts: list[torch.Tensor]) -> torch.Tensor:
            if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in parts):
                raise ValueError(
                    "eval_batch(compute_loss=False, reduce_output='avg'): the outputs must be floating-point "
                    "tensors (or tuples of them) to average; use reduce_output=None for the raw outputs"
                )
            mean = torch.stack([t.float() for t in parts]).mean(0)
            if self.dp_size > 1:
                _dist.all_reduce(mean, group=self.grid.dp_group)
                mean /= self.dp_size
            return mean.to(parts[0].dtype)

        if isinstance(outputs[0], (tuple, list)):
            return type(outputs[0])(average([o[i] for o in outputs]) for i in range(len(outputs[0])))
        return average(outputs)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | int | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save weights, optimizer states, scheduler, loss scaler and counters (call on every rank);
        returns the tag directory. The checkpoint loads at any number of stages, data-parallel
        size and ZeRO stage: see [Note: universal pipeline checkpoints] in ``checkpoint.py``."""
        from zero_pipe.checkpoint import save_engine_checkpoint

        return save_engine_checkpoint(
            self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters
        )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | int | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """Load a checkpoint of :meth:`save_checkpoint`, saved in any layout (call on every rank);
        returns ``(path, client_state)``, ``(None, None)`` when there is none."""
        from zero_pipe.checkpoint import load_engine_checkpoint

        return load_engine_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def _schedule(self, training: bool, micro_batches: int) -> PipeSchedule:
        """The schedule of this stage for a training or an eval batch of ``micro_batches``, built
        once per distinct key (the executor caches its compiled stream by ``cache_key()``)."""
        key = (training, micro_batches, self.num_stages, self.stage_id, self.num_chunks, self.lookahead)
        schedule = self._schedules.get(key)
        if schedule is None:
            if training and self.num_chunks > 1:
                schedule = InterleavedTrainSchedule(
                    micro_batches, self.num_stages, self.stage_id, chunks=self.num_chunks
                )
            elif training:
                schedule = TrainSchedule(
                    micro_batches, self.num_stages, self.stage_id, lookahead=self.lookahead
                )
            elif self.num_chunks > 1:
                schedule = InterleavedInferenceSchedule(
                    micro_batches, self.num_stages, self.stage_id, chunks=self.num_chunks
                )
            else:
                schedule = InferenceSchedule(micro_batches, self.num_stages, self.stage_id)
            self._schedules[key] = schedule
        return schedule

    def _next_batch(self) -> Any:
        if self.data_iterator is None:
            raise ValueError("PipelineEngine: no data iterator; pass data_iter or call set_dataiterator()")
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn is not None else batch

    def _aggregate_loss(
        self, losses: list[torch.Tensor], reduce_output: str | None, bcast: bool
    ) -> torch.Tensor | list[torch.Tensor] | None:
        """Mean over micro-batches and data-parallel replicas on the last stage, then
        broadcast to every stage of the pipeline (when ``bcast``; otherwise the other stages
        get None, as in DeepSpeed, rather than a made-up loss)."""
        if reduce_output is None:
            return losses if self.is_last_stage() else None
        if not bcast and not self.is_last_stage():
            return None
        loss = torch.zeros((), dtype=torch.float32)
        if self.is_last_stage():
            loss = torch.stack([x.float() for x in losses]).mean()
            if self.dp_size > 1:
                _dist.all_reduce(loss, group=self.grid.dp_group)
                loss /= self.dp_size
        if bcast and self.num_stages > 1:
            _dist.broadcast(loss, self.grid.stage_to_global(self.num_stages - 1), group=self.grid.pp_group)
        return loss
