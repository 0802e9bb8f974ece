"""The ``OptimizerOffload`` protocol: what the ZeRO stage strategies call on an optimizer offload.

[Note: optimizer offload seam]
With ``zero_optimization.offload_optimizer`` (cpu or nvme), zero-offload's ``OptimizerOffload``
takes over the fp32 master shards, their optimizer states and the optimizer step; the stage
strategies of zero-core (stages 1-2 and 3) hand it their masters (``adopt``), the reduced
gradients as they land (``begin_staging``/``stage_grad``/``stage_grad_range``), the step, and
ask it for values and states when users or checkpoints read them. This protocol names those
calls, so the strategies code against a type instead of ``Any``, and zero-offload's class is
checked against it (``isinstance``, in zero-offload's tests). When nothing is offloaded the
strategies hold :class:`NoOptimizerOffload`, the null implementation (FSDP2's ``OffloadPolicy``
beside ``CPUOffloadPolicy``): it owns no master and answers every call with the no-offload
behaviour, so stage code has no ``if offload is None`` branches; the question it asks is
``owns(master)`` (stage 3's ``offload_optimizer.ratio`` offloads only some masters).

Masters may be handed over as :class:`MasterSource` (a shape and a function producing the
values) instead of tensors: the offload then reads each one when it stores it, so a strategy
whose masters go to NVMe never holds them all (see [Note: ZeRO-Infinity streaming] in
zero-offload's optimizer_offload.py); the null object just builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from zero_core.utils.storage_bytes import state_tensors


@dataclass(frozen=True)
class MasterSource:
    """A master not built yet: its ``shape`` and ``produce()``, which returns its initial values.

    ``adopt`` calls ``produce`` once, when it stores that master, and drops the result before the
    next one (see [Note: optimizer offload seam]).
    """

    shape: torch.Size
    produce: Callable[[], torch.Tensor]

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


def master_values(source: torch.Tensor | MasterSource) -> torch.Tensor:
    """The values of an ``adopt`` source: the tensor itself, or what a :class:`MasterSource` produces."""
    return source.produce() if isinstance(source, MasterSource) else source


Publish = Callable[[torch.Tensor, torch.Tensor], None]


@runtime_checkable
class OptimizerOffload(Protocol):
    """See [Note: optimizer offload seam]."""

    # -- taking over the masters --------------------------------------------------------------
    def adopt(self, sources: Sequence[torch.Tensor | MasterSource]) -> list[torch.nn.Parameter]:
        """The offloaded fp32 masters holding ``sources``' values (in its home memory)."""
        ...

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        """Bind ``optimizer``'s param groups (already pointing at the adopted masters)."""
        ...

    def owns(self, master: torch.Tensor) -> bool: ...

    # -- gradients and the step ---------------------------------------------------------------
    def begin_staging(self, is_boundary: bool) -> None: ...

    def stage_grad(self, master: torch.Tensor, grad: torch.Tensor | None) -> None: ...

    def stage_grad_range(self, master: torch.Tensor, lo: int, values: torch.Tensor) -> None: ...

    def is_staged(self, master: torch.Tensor) -> bool: ...

    def streams_gradients(self) -> bool:
        """Whether staged gradients are kept in the offload's own store (NVMe), so the strategy
        drops its copy once a gradient is staged (see [Note: ZeRO-Infinity streaming])."""
        ...

    def staged_grad(self, master: torch.Tensor) -> torch.Tensor | None:
        """A new tensor with ``master``'s staged gradient (None: nothing staged this step)."""
        ...

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scale: float | torch.Tensor = 1.0,
        publish: Publish | None = None,
    ) -> None:
        """One step of every staged master; ``publish(master, values)`` receives each stepped
        master's updated weights in the training dtype as soon as they exist (required when the
        weights are never held whole: see [Note: ZeRO-Infinity streaming])."""
        ...

    def updated(self, master: torch.Tensor) -> torch.Tensor:
        """``master``'s new values after the step, on the compute device (for the 16-bit copy)."""
        ...

    def refresh_low_precision(self) -> None: ...

    # -- values and states (safe_get/safe_set, checkpoints) -----------------------------------
    def master_value(self, master: torch.Tensor) -> torch.Tensor: ...

    def set_master(self, master: torch.Tensor, values: torch.Tensor) -> None: ...

    def state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]: ...

    def deferred_state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """``state_of`` for writing checkpoints: states not in memory are ``DeferredTensor`` values
        (zero_core.checkpoint.fragments), read only when written."""
        ...

    def load_state(
        self, optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]
    ) -> None: ...

    def sync_from_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def state_dict_with_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    # -- accounting and lifetime --------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]: ...

    def owned_tensors(self) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


def _not_owned(what: str) -> KeyError:
    return KeyError(
        f"NoOptimizerOffload.{what}: this run offloads no optimizer state, so it owns no master "
        "(callers ask owns(master) first)"
    )


class NoOptimizerOffload:
    """The :class:`OptimizerOffload` of a run that offloads nothing (the null object).

    It owns no master, so the strategies keep every master, gradient and state on the device:
    staging and the step do nothing, the accounting is empty, and a checkpoint's optimizer state
    is the optimizer's own. The calls that only make sense for an owned master raise (the
    strategies ask :meth:`owns` first). As FSDP2's ``OffloadPolicy`` is to ``CPUOffloadPolicy``.
    See [Note: optimizer offload seam].
    """

    def adopt(self, sources: Sequence[torch.Tensor | MasterSource]) -> list[torch.Tensor]:
        # the masters stay where they are (a MasterSource is built here, as a Parameter)
        return [s if isinstance(s, torch.Tensor) else torch.nn.Parameter(master_values(s)) for s in sources]

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def owns(self, master: torch.Tensor) -> bool:
        return False

    def begin_staging(self, is_boundary: bool) -> None:
        pass

    def stage_grad(self, master: torch.Tensor, grad: torch.Tensor | None) -> None:
        raise _not_owned("stage_grad")

    def stage_grad_range(self, master: torch.Tensor, lo: int, values: torch.Tensor) -> None:
        pass  # reduced gradients stay in the strategy's buffers

    def is_staged(self, master: torch.Tensor) -> bool:
        return False

    def streams_gradients(self) -> bool:
        return False

    def staged_grad(self, master: torch.Tensor) -> torch.Tensor | None:
        raise _not_owned("staged_grad")

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scale: float | torch.Tensor = 1.0,
        publish: Publish | None = None,
    ) -> None:
        pass  # nothing is staged here: the strategy's own optimizer.step() updates every master

    def updated(self, master: torch.Tensor) -> torch.Tensor:
        raise _not_owned("updated")

    def refresh_low_precision(self) -> None:
        pass

    def master_value(self, master: torch.Tensor) -> torch.Tensor:
        raise _not_owned("master_value")

    def set_master(self, master: torch.Tensor, values: torch.Tensor) -> None:
        raise _not_owned("set_master")

    def state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        raise _not_owned("state_of")

    def deferred_state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        raise _not_owned("deferred_state_of")

    def load_state(
        self, optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]
    ) -> None:
        raise _not_owned("load_state")

    def sync_from_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def state_dict_with_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def memory_breakdown(self) -> dict[str, int]:
        return {}

    def owned_tensors(self) -> list[torch.Tensor]:
        return []

    def close(self) -> None:
        pass


def add_host_breakdown(
    out: dict[str, int], offload: OptimizerOffload, optimizer: torch.optim.Optimizer, count: Any
) -> None:
    """Merge ``offload``'s host-side pools into a strategy's memory breakdown ``out``.

    The per-master scalars (Adam's ``step``) of offloaded masters sit in ``optimizer.state``
    beside the offload's pools, on the host too: they are added to ``host_optimizer_states``
    (``count``: the strategy's storage ledger's ``count``). Nothing is added without offload.
    """
    out.update(offload.memory_breakdown())
    if "host_optimizer_states" in out:
        out["host_optimizer_states"] += count(state_tensors(optimizer, offload.owns))
