"""The training engine: the loop around a model that ``zero.initialize`` returns.

The engine owns the training-loop bookkeeping (micro-steps, gradient-accumulation
boundaries, loss scaling, clipping, LR schedule, monitors, timers) and composes the parts
that do the work: a :class:`TrainingStrategy` chosen by the ZeRO stage (see
[Note: engine strategies]), a loss scaler, monitors and timers. It never branches on the
stage itself.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero_core import comm
from zero_core.config import ZeroConfig
from zero_core.engine.accessors import DeepSpeedAccessors
from zero_core.engine.agreement import LoadAgreement, SaveAgreement
from zero_core.engine.boundary_step import OptimizerBoundaryStep
from zero_core.engine.data import cast_floating
from zero_core.engine.eval_only import is_eval_only, require_optimizer
from zero_core.engine.loss_scaler import LossScaler
from zero_core.engine.model_states import ModelStates
from zero_core.engine.module_attrs import forward_to_module
from zero_core.engine.no_sync import NoSyncGuard
from zero_core.engine.progressive_layer_drop import build_progressive_layer_drop
from zero_core.engine.state_report import breakdown_text
from zero_core.engine.strategy import TrainingStrategy
from zero_core.engine.timers import Timers
from zero_core.utils import termination
from zero_core.utils.sparse_names import sparse_module_names


class ZeroEngine(DeepSpeedAccessors, torch.nn.Module):
    """Wraps a model for training; use it like the model, plus ``backward`` and ``step``.

    DeepSpeed's accessors (``zero_optimization_stage()``, ``bfloat16_enabled()`` ...) come from
    :class:`DeepSpeedAccessors` (see [Note: DeepSpeed engine accessors]); ``no_sync()`` delegates to
    the :class:`NoSyncGuard` it holds (see [Note: no_sync]), ``offload_states()``/``reload_states()``
    to its :class:`ModelStates`; unknown attributes are looked up on the wrapped module by
    :func:`forward_to_module` (see [Note: engine attribute forwarding]).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        strategy: TrainingStrategy,
        *,
        config: ZeroConfig,
        loss_scaler: LossScaler,
        lr_scheduler: Any = None,
        training_dataloader: Any = None,
        monitor: Any = None,
        device: torch.device | None = None,
        dp_group: Any = None,
        compute_dtype: torch.dtype = torch.float32,
        step_hooks: list[Callable[[ZeroEngine], None]] | None = None,
        profiler: Any = None,
    ) -> None:
        super().__init__()
        self._no_sync_guard = NoSyncGuard()  # See [Note: no_sync]
        self._model_states = ModelStates()  # See [Note: offloading model states between phases]
        self.module = module
        self.strategy = strategy
        self.config = config
        self.loss_scaler = loss_scaler
        # Strategies that report gradients to users (safe_get_full_grad) unscale them with it.
        if hasattr(strategy, "bind_loss_scaler"):
            strategy.bind_loss_scaler(loss_scaler)
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.monitor = monitor
        self.device = device or torch.device("cpu")
        self.dp_group = dp_group
        self.compute_dtype = compute_dtype
        self.dp_world_size = comm.get_world_size(dp_group) if comm.is_initialized() else 1
        self.global_rank = comm.get_rank() if comm.is_initialized() else 0
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        # Device tensors until someone asks: See [Note: scalars stay on the device in the step]
        self._global_grad_norm: float | torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._last_loss: float | torch.Tensor | None = None
        self._step_hooks = list(step_hooks or [])
        # zero-profiler's StepProfiler (the ``flops_profiler`` section), or None
        self.profiler = profiler
        # DeepSpeed's attribute; None without the section. See [Note: progressive layer drop]
        self.progressive_layer_drop = build_progressive_layer_drop(config)
        # DeepSpeed's bookkeeping of sparse_gradients: See [Note: sparse gradients]
        self.sparse_tensor_module_names = sparse_module_names(module, bool(config.sparse_gradients))
        self.timers = Timers()
        self._wall_clock = config.wall_clock_breakdown
        # fp16.auto_cast: forward casts floating-point inputs to fp16
        self._auto_cast_fp16 = bool(config.fp16.enabled and config.fp16.auto_cast)
        # bf16.check_grad_overflow: a non-finite gradient norm skips the step (see _boundary_step)
        self._boundary = OptimizerBoundaryStep(
            strategy,
            loss_scaler,
            device=self.device,
            skip_nonfinite=bool(config.bf16.enabled and config.bf16.check_grad_overflow),
        )
        self._last_boundary_time = time.perf_counter()
        self._samples_per_sec = 0.0
        # timers.throughput.enabled: samples/s on the progress line and in the monitors
        throughput = getattr(getattr(config, "timers", None), "throughput", None)
        self._throughput = bool(getattr(throughput, "enabled", True))
        # why training must not go on: a load failed after overwriting part of the state
        # (see [Note: single-pass load] in checkpoint/single_pass.py), and whether it touched the optimizer
        self._invalid_state: str | None = None
        self._invalid_state_optimizer = False
        self._save_agreement = SaveAgreement()
        self._load_agreement = LoadAgreement()

    # -- the parts it holds: attribute forwarding, no_sync, offload_states -----------------
    def __getattr__(self, name: str) -> Any:
        return forward_to_module(self, name)  # See [Note: engine attribute forwarding]

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside the context keep their gradients local (stages 0 and 1).

        See [Note: no_sync]."""
        return self._no_sync_guard.context(self.zero_optimization_stage())

    def offload_states(
        self,
        include: Iterable[Any] | None = None,
        device: Any = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the model states of ``include`` (default: all kinds) to host memory (ZeRO stage 3).

        See [Note: offloading model states between phases]."""
        stage = self.zero_optimization_stage()
        self._model_states.offload(
            self.strategy, stage, self.device, include, device, pin_memory, non_blocking
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back every state :meth:`offload_states` moved, to the device it came from."""
        self._model_states.reload(self.strategy, non_blocking)

    @property
    def flops_profiler(self) -> Any:
        """DeepSpeed's name for the engine's profiler: zero-profiler's ``FlopsProfiler`` of the
        ``flops_profiler`` section (``get_total_flops()`` ..., and after the profiled step the
        ``flops``/``macs``/``params`` of its profile), None without the section. ``engine.profiler``
        is the per-step driver around it."""
        return getattr(self.profiler, "profiler", None)

    # -- the strategy's parts -----------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer (None for an engine built without one: See [Note: engine without an optimizer])."""
        opt = self.strategy.optimizer
        return None if is_eval_only(opt) else opt

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:  # set_gradient_accumulation_boundary
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank by category, measured from live tensors."""
        return self.strategy.memory_breakdown()

    def empty_partition_cache(self) -> None:
        """Release parameters kept gathered between steps (ZeRO stage 3; a no-op otherwise)."""
        release = getattr(self.strategy, "empty_partition_cache", None)
        if release is not None:
            release()

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
        *,
        max_shard_size: int | str = "5GB",
    ) -> bool:
        """Write the model's weights in the training dtype as ``from_pretrained`` loads them
        (``model.safetensors``, sharded with an index past ``max_shard_size``; rank 0 writes; a
        pickle name such as ``pytorch_model.bin`` gets safetensors, see [Note: 16-bit model files
        for from_pretrained]).

        Collective under ZeRO stage 3 (every rank must call it). Returns False when nothing was
        saved (stage 3 without ``gather_16bit_weights_on_model_save``).
        """
        self._require_valid_state("save_16bit_model")
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_16bit_model: save_dir must be a path, got {type(save_dir).__name__}")
        if not isinstance(save_filename, str) or not save_filename or os.sep in save_filename:
            raise ValueError(
                f"save_16bit_model: save_filename must be a plain file name, got {save_filename!r}"
            )
        from zero_core.checkpoint.zero_to_fp32 import parse_size

        parse_size(max_shard_size)  # a bad size fails on every rank, before any collective
        saver = getattr(self.strategy, "save_16bit_model", None)
        if saver is not None:
            return bool(saver(str(save_dir), save_filename, exclude_frozen_parameters, max_shard_size))
        from zero_core.zero.stage3.model_save import write_hf_weights

        if comm.is_initialized() and any(comm.get_world_size(g) > 1 for g, _ in _expert_groups(self.module)):
            # Ranks of an expert-parallel group hold different experts under the same local
            # names: rank 0's state dict is not the model. See [Note: expert parameters].
            raise NotImplementedError(
                "save_16bit_model: the model has experts sharded over an expert-parallel group "
                "(ep_size > 1), so no single rank holds every expert; use engine.save_checkpoint(...) "
                "and zero.utils.zero_to_fp32 to get the full model"
            )
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        state = {
            k: (v.to(self.compute_dtype) if v.is_floating_point() else v)
            for k, v in self.module.state_dict().items()
            if not (exclude_frozen_parameters and k in frozen)
        }
        if self.global_rank == 0:
            write_hf_weights(state, str(save_dir), save_filename, max_shard_size)
        return True

    # -- state left invalid by a failed load (see [Note: single-pass load]) -------------
    def invalidate_state(self, reason: str, *, optimizer: bool) -> None:
        """Refuse to train or save until a load succeeds: part of the state was overwritten by a failed load.

        ``optimizer`` says whether the failed load was restoring optimizer states too: then only
        a load that restores them again makes the engine usable.
        """
        self._invalid_state = reason
        self._invalid_state_optimizer = self._invalid_state_optimizer or optimizer

    def state_restored(self, *, optimizer: bool) -> None:
        """A load succeeded; it clears an invalid state if it restored everything the failed one touched."""
        if optimizer or not self._invalid_state_optimizer:
            self._invalid_state = None
            self._invalid_state_optimizer = False

    def _require_valid_state(self, what: str) -> None:
        if self._invalid_state is not None:
            raise RuntimeError(f"engine.{what}: {self._invalid_state}")

    # -- the loop -----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_valid_state("forward")
        self._model_states.require_on_device("forward", ("lp_params",))
        if self.profiler is not None and self.micro_steps % self.gradient_accumulation_steps() == 0:
            self.profiler.on_step_begin(self.global_steps)
        if self._wall_clock:
            self.timers.start("forward")
        if self._auto_cast_fp16:
            args, kwargs = cast_floating(args, torch.float16), cast_floating(kwargs, torch.float16)
        if self.progressive_layer_drop is not None and self.module.training:
            # See [Note: progressive layer drop]
            kwargs = {**kwargs, **self.progressive_layer_drop.get_state()}
        out = self.module(*args, **kwargs)
        if self._wall_clock:
            self.timers.stop("forward")
        return out

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of ``loss`` scaled by 1/gradient_accumulation_steps and the loss scale.

        Returns, as DeepSpeed does, the loss divided by ``gradient_accumulation_steps`` in fp32
        (``loss.float() / gas``, whatever the training dtype) when ``scale_wrt_gas`` and the
        steps are more than one, else ``loss`` itself; never the fp16 loss scale. Inside
        :meth:`no_sync` the gradients stay on this rank (See [Note: no_sync]).
        """
        self._require_valid_state("backward")
        require_optimizer(self.strategy.optimizer, "backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        self._model_states.require_on_device("backward")
        boundary = self.is_gradient_accumulation_boundary()
        self._note(f"engine.backward of micro-step {self.micro_steps}")
        reduce = self._no_sync_guard.reduce_in_this_backward(boundary)
        self._losses.append(loss.detach().float().reshape(()))  # on the device: no host sync
        gas_scaled = loss
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            gas_scaled = loss.float() / self.gradient_accumulation_steps()
        scaled = self.loss_scaler.scale_loss(gas_scaled.float())
        if self._wall_clock:
            self.timers.start("backward")
        self.strategy.before_backward(reduce)
        scaled.backward(retain_graph=retain_graph)
        if self._wall_clock:
            # the communication left after backward: waiting for the gradient reduction
            self.timers.start("backward_allreduce")
        self.strategy.after_backward(reduce)
        if self._wall_clock:
            self.timers.stop("backward_allreduce")
            self.timers.stop("backward")
        return gas_scaled

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End a micro-step; on an accumulation boundary apply the optimizer."""
        self._require_valid_state("step")
        require_optimizer(self.strategy.optimizer, "step")
        self._no_sync_guard.require_outside("step")
        self._model_states.require_on_device("step")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if not boundary:
            return
        if self._wall_clock:
            self.timers.start("step")
        self._note(f"engine.step (optimizer step {self.global_steps})")
        if self.progressive_layer_drop is not None:  # before the counter moves, as DeepSpeed
            self.progressive_layer_drop.update_state(self.global_steps)
        self._boundary_step(lr_kwargs)
        if self._wall_clock:
            self.timers.stop("step")
        self._report()
        if self.profiler is not None:
            self.profiler.on_step_end(self.global_steps - 1)
        for hook in self._step_hooks:
            hook(self)

    @staticmethod
    def _note(label: str) -> None:
        """Tell the collective watchdog where training is (named when a collective times out)."""
        wd = comm.watchdog.get_watchdog()
        if wd is not None:
            wd.note(label)

    def _boundary_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        """The optimizer step of an accumulation boundary: See [Note: optimizer boundary step]."""
        outcome = self._boundary(
            gradient_clipping=self.gradient_clipping(),
            lr_step=None
            if self.lr_scheduler is None
            else lambda: self.lr_scheduler.step(**(lr_kwargs or {})),
            step_index=self.global_steps + 1,
            skipped_before=self.skipped_steps,
        )
        self._step_applied = outcome.applied
        self._global_grad_norm = outcome.norm
        if not outcome.applied:
            self.skipped_steps += 1
        self.global_steps += 1

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def destroy(self) -> None:
        """Release what the strategy holds outside Python's reach (offload swap files); idempotent."""
        close = getattr(self.strategy, "close", None)
        if close is not None:
            close()

    # -- checkpoints (zero_core.checkpoint; see [Note: checkpoint format]) --------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save the full training state under ``save_dir/tag`` (collective: call on every rank)."""
        from zero_core.checkpoint.saver import save_checkpoint

        self._require_valid_state("save_checkpoint")
        # Every rank calls, with one tag, or a clear error within the timeout (see [Note: rank agreement]).
        from zero_core.checkpoint.format import validate_tag

        effective = validate_tag(f"global_step{self.global_steps}" if tag is None else tag)
        mode = self.config.checkpoint.tag_validation
        tag = self._save_agreement.agree(effective, mode, self.dp_group)
        # A SIGTERM during the save removes the staging directory (see [Note: cleanup on SIGTERM]).
        key = _remove_on_termination(save_dir, tag) if self.global_rank == 0 else None
        try:
            return save_checkpoint(
                self,
                save_dir,
                tag,
                client_state if client_state is not None else {},
                save_latest,
                exclude_frozen_parameters,
            )
        finally:
            if key is not None:
                termination.forget(key)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved at any world size and stage; returns ``(load_path, client_state)``."""
        from zero_core.checkpoint.loader import load_checkpoint, resolve_tag

        # Every rank calls, for one tag, or a clear error (see [Note: one-sided calls]).
        if isinstance(load_dir, (str, os.PathLike)):
            try:
                resolved = resolve_tag(os.fspath(load_dir), tag)
            except Exception as exc:  # the loader raises it below, on every rank that sees it
                resolved = f"(unreadable: {exc})"
            self._load_agreement.agree_tag(resolved, self.dp_group)
        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )

    # -- reporting ----------------------------------------------------------------------
    def _report(self) -> None:
        now = time.perf_counter()
        elapsed = max(now - self._last_boundary_time, 1e-9)
        self._last_boundary_time = now
        self._samples_per_sec = self.train_batch_size() / elapsed
        loss_t = torch.stack(self._losses).mean() if self._losses else None
        self._last_loss = loss_t
        self._losses.clear()
        step = self.global_steps
        events: list[tuple[str, float, int]] = []
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            loss = self.last_loss
            events = [
                ("Train/Samples/train_loss", loss, self.global_samples),
                ("Train/Samples/lr", self.get_lr()[0], self.global_samples),
                ("Train/Samples/loss_scale", self.loss_scaler.loss_scale, self.global_samples),
            ]
            if self._throughput:
                events.append(("Train/Samples/samples_per_sec", self._samples_per_sec, self.global_samples))
            if self.get_global_grad_norm() is not None:
                events.append(("Train/Samples/grad_norm", self.get_global_grad_norm(), self.global_samples))
        every = self.config.steps_per_print or 10  # None: the default interval
        # collective: every rank is at the same step, so every rank takes this branch
        mem_per_rank = self._model_state_mb_per_rank() if step % every == 0 else None
        if self.monitor is not None and getattr(self.monitor, "enabled", False):
            if mem_per_rank is not None:
                events.append(("Train/Memory/model_states_MB_max", max(mem_per_rank), self.global_samples))
                events += [
                    (f"Train/Memory/model_states_MB_rank{r}", mb, self.global_samples)
                    for r, mb in enumerate(mem_per_rank)
                ]
            self.monitor.write_events(events)
        if mem_per_rank is not None and self.global_rank == 0:
            loss = self.last_loss
            line = f"[zero] step {step} | loss {loss:.4f} | lr {self.get_lr()[0]:.3e} | "
            if self._throughput:  # timers.throughput.enabled
                line += f"samples/s {self._samples_per_sec:.1f} | "
            line += f"model states {max(mem_per_rank):.1f} MB/rank (max)"
            if self.config.memory_breakdown:  # See engine/state_report.py
                line += " | " + breakdown_text(self.memory_breakdown())
            if self.loss_scaler.checks_overflow:
                line += f" | loss scale {self.loss_scaler.loss_scale:g} | skipped {self.skipped_steps}"
            if self._wall_clock:
                line += " | " + ", ".join(f"{k} {v:.1f} ms" for k, v in self.timers.means_ms().items())
            print(line, flush=True)

    def _model_state_mb_per_rank(self) -> list[float]:
        """Model-state MiB held by each global rank (gathered: monitors write on rank 0 only).

        [Note: per-rank model-state memory]
        Monitors and the progress line live on global rank 0, but partitioned stages hold
        different amounts on different ranks, so at ``steps_per_print`` every rank contributes
        its own measurement: the monitors get one scalar per rank
        (``Train/Memory/model_states_MB_rank{r}``) plus their maximum, and the progress line
        prints the maximum (the figure that decides whether a job fits). Only the model states
        count (see :func:`model_state_bytes`), not working memory such as stage 3's gathered
        parameters, which would make stage 3 look larger than stage 2.
        """
        mine = model_state_bytes(self.memory_breakdown()) / 2**20
        if not comm.is_initialized() or comm.get_world_size() == 1:
            return [mine]
        world = comm.get_world_size()
        gathered = torch.zeros(world, dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(gathered, torch.tensor([mine], dtype=torch.float64, device=self.device))
        return gathered.tolist()

    def held_step_scalars(self) -> list[torch.Tensor]:
        """The 0-dim device tensors the engine keeps until they are read (the micro-steps' losses,
        the last loss, the gradient norm); not model states, so ``memory_breakdown()`` leaves them out."""
        held = [t for t in (self._last_loss, self._global_grad_norm) if isinstance(t, torch.Tensor)]
        return [*self._losses, *held]

    @property
    def last_loss(self) -> float | None:
        """Mean loss over the micro-batches of the last optimizer step (read from the device on
        first access: See [Note: scalars stay on the device in the step])."""
        if self._last_loss is None:
            return float("nan") if self.global_steps > 0 else None
        if isinstance(self._last_loss, torch.Tensor):
            self._last_loss = float(self._last_loss)
        return self._last_loss


def _remove_on_termination(save_dir: Any, tag: str) -> int | None:
    """Register the removal of ``tag``'s staging directory under ``save_dir`` for SIGTERM."""
    import shutil

    from zero_core.checkpoint.format import staging_dir_name

    if not isinstance(save_dir, (str, os.PathLike)):
        return None  # the saver reports the bad argument
    staging = os.path.join(os.fspath(save_dir), staging_dir_name(tag))
    return termination.on_termination(lambda: shutil.rmtree(staging, ignore_errors=True))


#: the categories of ``memory_breakdown()`` that are model states in the ZeRO paper's sense
#: (parameters, gradients, fp32 master weights, optimizer states), on the device or offloaded to
#: host memory. The other categories are working memory: communication buckets ("buffers"),
#: stage 3's gathered parameters and their peak, swap and copy buffers, files on NVMe.
MODEL_STATE_KEYS = (
    "parameters",
    "persistent_parameters",
    "gradients",
    "master_weights",
    "optimizer_states",
    "host_parameters",
    "host_low_precision_params",
    "host_gradients",
    "host_master_weights",
    "host_optimizer_states",
)


def model_state_bytes(breakdown: dict[str, int]) -> int:
    """Model-state bytes of an engine's ``memory_breakdown()`` (what the progress line reports)."""
    return sum(breakdown.get(k, 0) for k in MODEL_STATE_KEYS)


def _expert_groups(module: torch.nn.Module) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """``[(expert-parallel group, expert params)]`` of ``module`` (empty without experts)."""
    from zero_core.plugins import require
    from zero_core.utils.param_groups import is_expert_param

    experts: dict[str, list[torch.nn.Parameter]] = {}
    for p in module.parameters():
        if is_expert_param(p):
            experts.setdefault(getattr(p, "group_name", "default"), []).append(p)
    if not experts:
        return []
    groups = require("zero_moe.groups", "saving a Mixture-of-Experts model")
    return [(groups.get_expert_parallel_group(name), ps) for name, ps in experts.items()]
