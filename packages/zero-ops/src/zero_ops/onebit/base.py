"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: arguments, the group, the exchange, the phase.

[Note: communication-compressed optimizers]
These optimizers do their own data-parallel communication once their warm-up is over: the
gradients stay local and the optimizer exchanges its momentum (1-bit Adam, 1-bit LAMB) or its
gradient / accumulated update (0/1 Adam) through ``zero_core.comm.compressed_all_reduce``
with error feedback. So the optimizer, not the engine, decides what crosses the wire:

* ``communicates_gradients()`` says whether the *next* step does its own communication; the
  stage-0 strategy asks it before each boundary's backward and all-reduces the gradients
  itself only when it answers False (the dense warm-up steps, 0/1 Adam's variance steps), as
  DeepSpeed's engine switches its backward all-reduce off after the freeze.
* ``bind_data_parallel(group)`` (called by that strategy) names the group and says that the
  engine does the dense steps' all-reduce. Used directly, without an engine, the optimizer
  averages the gradients of its dense steps over the world itself.
* The phase (steps taken, 0/1 Adam's intervals) lives in every param group as plain numbers,
  so ``state_dict()`` and zero's checkpoints carry it; the per-parameter state (momentum,
  variance, frozen coefficients) is identical on every rank and saved once. What differs per
  rank - the error-feedback buffers and, between 0/1 Adam's synchronisations, the local
  parameters and momentum - is ``rank_local_state()``: the strategy writes it into each
  rank's own checkpoint file and gives it back on a resume at the same world size; at another
  world size it is reset with a warning (the buffers belong to one rank's share of the
  exchange, see [Note: chunk-major layout]).

With one process the exchange is the identity, so the algorithms' math (frozen variance,
LAMB's frozen coefficients, 0/1 Adam's local steps) runs unchanged.

[Note: momentum mask]
The 1-bit exchange cannot send an exact zero (every element goes as +-scale), so entries whose
momentum must stay zero (the rows of an embedding no batch looks up, as BERT's position
embeddings past the trained sequence length) would drift by their error feedback. DeepSpeed's
remedy is kept: a parameter group may carry ``"exp_avg_mask"``, a tensor broadcastable to each
of its parameters, which multiplies every result of the compressed exchange (1-bit Adam's and
1-bit LAMB's momentum, 0/1 Adam's gradient and accumulated update), so masked entries leave
each exchange at exactly zero; the dense warm-up steps are untouched. The mask is the training
script's, not the checkpoint's: it is never saved (it is no JSON value) and
``load_state_dict`` keeps the live groups' masks, as DeepSpeed does (a mask may change between
training phases, e.g. with the sequence length).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from zero_core import comm
from zero_core.comm.compressed import compressed_all_reduce

from zero_ops.onebit.layout import ChunkLayout

#: ``comm_backend_name`` values: the torch.distributed backends zero can run on.
COMM_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")


def check_int(name: str, owner: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_number(name: str, owner: str, value: object, low: float, high: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the communication-compressed optimizers; see [Note: communication-compressed optimizers]."""

    #: the phase counters each subclass keeps in every param group, with their initial values
    PHASE: dict[str, Any] = {"compression_step": 0}

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        cuda_aware: bool,
        comm_backend_name: str,
        amsgrad: bool,
        max_grad_norm: float,
    ) -> None:
        owner = type(self).__name__
        check_number("lr", owner, defaults["lr"], 0.0)
        betas = defaults["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{owner}: betas must be two numbers in [0, 1), got {betas!r}")
        defaults["betas"] = tuple(check_number("betas", owner, b, 0.0, 1.0) for b in betas)
        check_number("eps", owner, defaults["eps"], 0.0)
        check_number("weight_decay", owner, defaults["weight_decay"], 0.0)
        if amsgrad:
            raise ValueError(f"{owner}: amsgrad=True is not supported (nor is it by DeepSpeed's {owner})")
        if max_grad_norm:
            raise ValueError(
                f"{owner}: max_grad_norm={max_grad_norm!r}: clipping is not an optimizer setting here; "
                'use the config\'s top-level "gradient_clipping"'
            )
        if not isinstance(comm_backend_name, str) or comm_backend_name.lower() not in COMM_BACKENDS:
            raise ValueError(
                f"{owner}: comm_backend_name={comm_backend_name!r} is not a backend zero runs on; "
                f"use one of {', '.join(COMM_BACKENDS)}"
            )
        if not isinstance(cuda_aware, bool):
            raise ValueError(f"{owner}: cuda_aware must be a bool, got {cuda_aware!r}")
        if cuda_aware:
            warnings.warn(
                f"{owner}: cuda_aware=True has no effect: the exchange runs on torch.distributed, whose "
                "backend moves accelerator tensors itself (DeepSpeed's flag selects a CUDA-aware MPI path)",
                UserWarning,
                stacklevel=4,  # the user's call, through init_adam_style
            )
        self.comm_backend_name = comm_backend_name.lower()
        self.cuda_aware = cuda_aware
        super().__init__(params, {**defaults, **self.PHASE})
        self._group: dist.ProcessGroup | None = None
        self._engine_reduces = False
        self._backend_checked = False
        self._layouts: dict[int, ChunkLayout] = {}
        self._errors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- the engine's side ---------------------------------------------------------------
    def bind_data_parallel(self, group: dist.ProcessGroup | None = None) -> None:
        """Exchange over ``group``; the engine all-reduces the gradients of dense steps itself."""
        self._group = group
        self._engine_reduces = True

    def communicates_gradients(self) -> bool:
        """Whether the next step exchanges data itself (the gradients must then stay local)."""
        raise NotImplementedError

    # -- phase counters (see the Note) ---------------------------------------------------
    def phase(self, key: str) -> Any:
        return self.param_groups[0][key]

    def set_phase(self, key: str, value: object) -> None:
        for group in self.param_groups:
            group[key] = value

    # -- communication -------------------------------------------------------------------
    def world_size(self) -> int:
        return comm.get_world_size(self._group) if comm.is_initialized() else 1

    def _check_backend(self) -> None:
        if self._backend_checked or not comm.is_initialized():
            return
        self._backend_checked = True
        actual = str(comm.get_backend(self._group)).lower()
        if actual != self.comm_backend_name and self.comm_backend_name != "mpi":
            warnings.warn(
                f"{type(self).__name__}: comm_backend_name={self.comm_backend_name!r} but the process group "
                f"runs {actual!r}; the exchange uses the group's backend ({actual})",
                UserWarning,
                stacklevel=3,
            )

    @staticmethod
    def trained(group: dict[str, Any]) -> list[torch.Tensor]:
        """The group's parameters that take part in training (the exchange skips the others)."""
        return [p for p in group["params"] if p.requires_grad and p.numel() > 0]

    @torch.no_grad()
    def average_dense_gradients(self) -> None:
        """All-reduce (average) the gradients here when no engine did (direct use, see the Note)."""
        n = self.world_size()
        if self._engine_reduces or n == 1:
            return
        params = [p for g in self.param_groups for p in self.trained(g)]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        comm.all_reduce(flat, group=self._group)
        flat.div_(n)
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.grad = piece.view_as(p).to(p.dtype)

    def exchange(self, index: int, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` (group ``index``'s, in place) through the compressed all-reduce."""
        self._check_backend()
        n = self.world_size()
        layout = self._layouts.get(index)
        if layout is None or layout.world_size != n:
            layout = ChunkLayout([t.numel() for t in tensors], n, tensors[0].device)
            self._layouts[index] = layout
        dtype = tensors[0].dtype
        errors = self._errors.get(index)
        if errors is None or errors[0].numel() != layout.numel or errors[0].dtype != dtype:
            errors = (
                torch.zeros(layout.numel, dtype=dtype, device=tensors[0].device),
                torch.zeros(layout.width, dtype=dtype, device=tensors[0].device),
            )
            self._errors[index] = errors
        buf = layout.gather(tensors, dtype)
        compressed_all_reduce(
            buf,
            errors[0],
            errors[1],
            self._group,
            segment_sizes=layout.segment_sizes,
        )
        layout.scatter(buf, tensors)
        self._apply_mask(index, tensors)

    def _apply_mask(self, index: int, tensors: list[torch.Tensor]) -> None:
        """Multiply the exchanged ``tensors`` by group ``index``'s ``exp_avg_mask``: See [Note: momentum mask]."""
        group = self.param_groups[index]
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        owner = type(self).__name__
        if not torch.is_tensor(mask):
            raise TypeError(
                f"{owner}: param_groups[{index}]['exp_avg_mask'] must be a tensor, got {type(mask).__name__}"
            )
        for t in tensors:
            try:
                fits = torch.broadcast_shapes(mask.shape, t.shape) == t.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(
                    f"{owner}: param_groups[{index}]['exp_avg_mask'] has shape {tuple(mask.shape)}, which does "
                    f"not broadcast to the group's parameter of shape {tuple(t.shape)}"
                )
            if mask.device != t.device or mask.dtype != t.dtype:
                mask = mask.to(device=t.device, dtype=t.dtype)
                group["exp_avg_mask"] = mask  # moved once, as DeepSpeed does
            t.mul_(mask)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's, keeping the live param groups' ``exp_avg_mask`` (See [Note: momentum mask])."""
        groups = [dict(g) for g in state_dict.get("param_groups", [])]
        for live, saved in zip(self.param_groups, groups):
            saved.pop("exp_avg_mask", None)
            if "exp_avg_mask" in live:
                saved["exp_avg_mask"] = live["exp_avg_mask"]
        super().load_state_dict({**state_dict, "param_groups": groups})

    def reset_errors(self) -> None:
        """Forget the error-feedback buffers (they start from zero at the next exchange)."""
        self._errors.clear()

    # -- per-rank state (see the Note) ---------------------------------------------------
    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state, which no other rank holds: the error-feedback buffers."""
        out = {}
        for index, (worker, server) in sorted(self._errors.items()):
            out[f"worker_error.{index}"] = worker
            out[f"server_error.{index}"] = server
        return out

    def load_rank_local_state(self, state: dict[str, torch.Tensor] | None, reason: str = "") -> None:
        """Restore :meth:`rank_local_state`; ``None`` (another world size) resets it, with a warning."""
        if state is None:
            if self._has_rank_state():
                warnings.warn(
                    f"{type(self).__name__}: the error-feedback buffers were reset ({reason}); they hold "
                    "one rank's share of the exchange and cannot be carried to another world size",
                    UserWarning,
                    stacklevel=3,
                )
            self._errors.clear()
            return
        self._errors.clear()
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        for key, value in state.items():
            kind, _, index = key.partition(".")
            if kind == "worker_error":
                server = state[f"server_error.{index}"]
                self._errors[int(index)] = (value.to(device).clone(), server.to(device).clone())

    def _has_rank_state(self) -> bool:
        return self.phase("compression_step") > 0


def init_adam_style(
    opt: CompressedOptimizer, params: Iterable[Any], args: dict[str, Any], **extra: object
) -> None:
    """Run :class:`CompressedOptimizer`'s constructor from an Adam-style constructor's arguments.

    The three optimizers share DeepSpeed's Adam-style signature (``lr``, ``bias_correction``,
    ``betas``, ``eps``, ``eps_inside_sqrt``, ``weight_decay``, ``max_grad_norm``, ``amsgrad``,
    ``cuda_aware``, ``comm_backend_name``); ``args`` is the calling constructor's ``locals()``
    and ``extra`` the param-group defaults only that optimizer has (1-bit LAMB's coefficients).
    """
    defaults = dict(
        lr=args["lr"],
        bias_correction=bool(args["bias_correction"]),
        betas=args["betas"],
        eps=args["eps"],
        eps_inside_sqrt=bool(args["eps_inside_sqrt"]),
        weight_decay=args["weight_decay"],
        **extra,
    )
    CompressedOptimizer.__init__(
        opt,
        params,
        defaults,
        cuda_aware=args["cuda_aware"],
        comm_backend_name=args["comm_backend_name"],
        amsgrad=args["amsgrad"],
        max_grad_norm=args["max_grad_norm"],
    )


class FreezeStepOptimizer(CompressedOptimizer):
    """1-bit Adam's and 1-bit LAMB's phases: dense gradient averaging and the plain update for the
    first ``freeze_step`` steps, then each parameter group's compressed step. Subclasses set
    ``freeze_step`` and implement ``_warmup_step(group, step)`` and
    ``_compressed_step(index, group, step)``."""

    freeze_step: int

    def communicates_gradients(self) -> bool:
        return self.phase("compression_step") >= self.freeze_step

    def _has_rank_state(self) -> bool:
        return self.phase("compression_step") > self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        done = self.phase("compression_step")
        compressed = done >= self.freeze_step
        if not compressed:
            self.average_dense_gradients()
        step = done + 1
        for index, group in enumerate(self.param_groups):
            if compressed:
                self._compressed_step(index, group, step)
            else:
                self._warmup_step(group, step)
        self.set_phase("compression_step", step)
        return loss
