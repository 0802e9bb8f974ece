"""Activation checkpointing: run a block without keeping its activations and recompute it in backward.

[Note: how a checkpoint recomputes]
``checkpoint(function, *args)`` runs ``function`` under ``torch.no_grad()`` inside an autograd Function,
keeping only the inputs (see [Note: saved-input storage]) and every RNG state (see [Note: which generator
the tracker tracks]). Its backward rebuilds the inputs as fresh leaves, restores the RNG states and the
autocast state of the forward, recomputes ``function`` with grad enabled, back-propagates the incoming
gradients through the recomputed outputs (which accumulates parameter gradients) and returns the inputs'
gradients. Non-tensor arguments are passed through unchanged, and outputs may be a tensor or a tuple
(non-tensor entries get no gradient). A zero-size leaf that requires grad is passed along so the output
requires grad even when no input does (the first layer gets data); without it autograd would never call
the backward and the block's parameters would get no gradient. Under ``torch.no_grad()`` the function just
runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import FunctionCtx

from zero_core.activation_checkpointing import storage
from zero_core.activation_checkpointing.config import (
    ActivationCheckpointingConfig,
    read_activation_checkpointing_config,
)
from zero_core.activation_checkpointing.rng import RNGSnapshot, seed_model_parallel

if TYPE_CHECKING:
    from zero_core.protocols.training import ModelParallelUnit

logger = logging.getLogger(__name__)

_MPU_METHODS = ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group")


@dataclasses.dataclass
class CheckpointingState:
    """The process's activation-checkpointing state, set by ``configure()``; ``checkpoint()``
    uses the defaults when ``configure()`` was never called."""

    config: ActivationCheckpointingConfig = dataclasses.field(default_factory=ActivationCheckpointingConfig)
    mpu: ModelParallelUnit | None = None
    configured: bool = False
    # whether the last configure() came from zero_core.initialize (which re-reads each engine's
    # config) rather than from the user's own call (which initialize must not undo)
    from_initialize: bool = False
    buffers: storage.ContiguousBuffers = dataclasses.field(default_factory=storage.ContiguousBuffers)
    profile: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


_STATE = CheckpointingState()


def configure(
    mpu_: ModelParallelUnit | None = None,
    deepspeed_config: object = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure activation checkpointing for this process.

    ``deepspeed_config`` (a whole config as dict, JSON path or config object) gives the
    ``activation_checkpointing`` section; every other argument that is not None overrides its key.
    ``mpu_`` must provide ``get_model_parallel_rank/world_size/group`` (needed by ``partition_activations``).
    """
    if mpu_ is not None:
        missing = [m for m in _MPU_METHODS if not callable(getattr(mpu_, m, None))]
        if missing:
            raise TypeError(f"configure: mpu_ ({type(mpu_).__name__}) lacks the methods {missing}")
    config = (
        read_activation_checkpointing_config(deepspeed_config, validate=False)
        if deepspeed_config is not None
        else ActivationCheckpointingConfig()
    )
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    config.validate(where="activation_checkpointing.configure")
    if config.partition_activations and mpu_ is None:
        logger.warning("configure: partition_activations without an mpu_ has nothing to partition across")
    _STATE.config, _STATE.mpu, _STATE.configured, _STATE.from_initialize = config, mpu_, True, False
    reset()


def configure_from_initialize(deepspeed_config: object) -> bool:
    """``configure`` from an engine's config, unless that is the caller's job.

    Megatron-style scripts call ``checkpointing.configure(mpu, deepspeed_config=..., num_checkpoints=N)``
    before ``initialize`` (DeepSpeed's engine never configures it); re-reading the config there
    would drop their ``mpu_`` and overrides. A section with ``contiguous_memory_optimization`` but
    no ``number_checkpoints`` cannot size its buffer yet: that same call, with Megatron's layer
    count, configures it. Returns whether it configured.
    """
    section = read_activation_checkpointing_config(deepspeed_config, validate=False)
    if section.contiguous_memory_optimization and section.number_checkpoints is None:
        return False
    if _STATE.configured and not _STATE.from_initialize:
        if section != _STATE.config:
            warnings.warn(
                f"activation_checkpointing: the config's section ({section}) is not applied: checkpointing was "
                f"configured by the caller's own checkpointing.configure call ({_STATE.config}), which initialize keeps",
                UserWarning,
                stacklevel=3,
            )
        return False
    configure(deepspeed_config=deepspeed_config)
    _STATE.from_initialize = True
    return True


def is_configured() -> bool:
    """True once ``configure`` has been called."""
    return _STATE.configured


def get_config() -> ActivationCheckpointingConfig:
    """The options checkpoint() currently uses."""
    return _STATE.config


def get_mpu() -> ModelParallelUnit | None:
    """The model-parallel unit given to ``configure`` (or None)."""
    return _STATE.mpu


def model_parallel_cuda_manual_seed(seed: int, mpu: object | None = None) -> None:
    """Seed the default generator with ``seed`` (the same on every model-parallel rank: data-parallel
    regions) and add a tracked ``model-parallel-rng`` state seeded ``seed + 2718 + model_parallel_rank``
    (different on every model-parallel rank: dropout inside model-parallel regions).

    ``mpu`` defaults to the one given to ``configure``; without one the model-parallel rank is 0.
    Call it after model parallelism is initialised, and call no other manual_seed after it.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    if mpu is None:
        mpu = get_mpu()
    seed_model_parallel(seed, mpu.get_model_parallel_rank() if mpu is not None else 0)


def reset() -> None:
    """Free the contiguous checkpoint buffers; call it in eval loops that run forward passes with grad
    enabled but no backward, which otherwise keep their buffer slots."""
    _STATE.buffers.reset()


def profile_stats() -> dict[str, dict[str, float]]:
    """``{"forward"|"backward": {"count": n, "total_s": seconds}}`` collected while ``profile`` is on."""
    return {phase: dict(stats) for phase, stats in _STATE.profile.items()}


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Boundary:
    """Synchronize and time one checkpoint phase as the config asks."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def __enter__(self) -> None:
        if _STATE.config.synchronize_checkpoint_boundary:
            _synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if _STATE.config.synchronize_checkpoint_boundary:
            _synchronize()
        if _STATE.config.profile:
            elapsed = time.perf_counter() - self.start
            stats = _STATE.profile.setdefault(self.phase, {"count": 0, "total_s": 0.0})
            stats["count"] += 1
            stats["total_s"] += elapsed
            logger.info("activation checkpoint %s: %.3f ms", self.phase, elapsed * 1e3)


def _autocast_state() -> dict[str, tuple[bool, torch.dtype]]:
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices}


class CheckpointFunction(torch.autograd.Function):
    """The autograd Function behind ``checkpoint``. See [Note: how a checkpoint recomputes]."""

    @staticmethod
    def forward(ctx: FunctionCtx, run_function: Callable, _grad_anchor: torch.Tensor, *args: Any) -> Any:
        with _Boundary("forward"):
            ctx.run_function = run_function
            ctx.rng = RNGSnapshot.capture()
            ctx.autocast = _autocast_state()
            ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            ctx.input_needs_grad = [args[i].requires_grad for i in ctx.tensor_positions]
            ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
            with torch.no_grad():
                outputs = run_function(*args)
            tensors = [args[i] for i in ctx.tensor_positions]
            ctx.config, ctx.mpu = _STATE.config, _STATE.mpu
            if storage.uses_storage(_STATE.config, _STATE.mpu):
                ctx.saved = storage.save_inputs(tensors, _STATE.config, _STATE.mpu, _STATE.buffers)
            else:
                ctx.saved = None
                ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx: FunctionCtx, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "activation checkpointing is not compatible with torch.autograd.grad(); use .backward()"
            )
        with _Boundary("backward"):
            if ctx.saved is None:
                tensors = list(ctx.saved_tensors)
            else:
                tensors = storage.load_inputs(ctx.saved, ctx.mpu)
                if ctx.config.contiguous_memory_optimization:
                    _STATE.buffers.release()
            args = list(ctx.args)
            for pos, tensor, needs_grad in zip(ctx.tensor_positions, tensors, ctx.input_needs_grad):
                args[pos] = tensor.detach().requires_grad_(needs_grad)

            outer_rng = RNGSnapshot.capture()
            ctx.rng.restore()
            try:
                with torch.enable_grad(), _AutocastAsInForward(ctx.autocast):
                    outputs = ctx.run_function(*args)
            finally:
                outer_rng.restore()

            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [
                (out, grad)
                for out, grad in zip(outputs, grad_outputs)
                if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            grads = [
                args[pos].grad if needs else None
                for pos, needs in zip(ctx.tensor_positions, ctx.input_needs_grad)
            ]
        input_grads: list[Any] = [None] * len(args)
        for pos, grad in zip(ctx.tensor_positions, grads):
            input_grads[pos] = grad
        return (None, None, *input_grads)


class _AutocastAsInForward:
    """Enter the autocast state recorded at forward for every device (a context manager)."""

    def __init__(self, state: dict[str, tuple[bool, torch.dtype]]) -> None:
        self.managers = [torch.autocast(d, dtype=dtype, enabled=on) for d, (on, dtype) in state.items()]

    def __enter__(self) -> None:
        for manager in self.managers:
            manager.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for manager in reversed(self.managers):
            manager.__exit__(*exc)


def checkpoint(function: Callable, *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its activations; recompute them during backward.

    Returns what ``function`` returns (a tensor or a tuple). See [Note: how a checkpoint recomputes].
    """
    if not callable(function):
        raise TypeError(f"checkpoint: 'function' must be callable, got {type(function).__name__}")
    if not torch.is_grad_enabled():
        return function(*args)
    anchor = torch.empty(0, requires_grad=True)
    return CheckpointFunction.apply(function, anchor, *args)
