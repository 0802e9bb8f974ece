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
beside ``CPUOffloadPolicy``): it owns no master. Every implementation answers the calls about
a master it does not own with the no-offload behaviour, the identity: ``master_value`` is the
master itself, ``set_master`` copies into it, ``state_of`` / ``deferred_state_of`` /
``load_state`` are the optimizer's own state, ``updated`` is the master, ``stage_grad`` keeps
nothing and ``staged_grad`` has nothing (stage 3's ``offload_optimizer.ratio`` offloads only
some masters, so zero-offload's class answers so for the rest). So stage code has no ``if
offload is None`` branches and reads and writes every master through the offload.
``owns(master)`` remains for what really differs: which masters the strategy's own optimizer
steps (decided once, at construction), the host-side accounting, and checkpoint loads that read
an owned master's values into a buffer of their own.

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
    def begin_staging(self, is_boundary: bool, prefetch: bool = True) -> None:
        """A backward pass starts (``is_boundary``: it completes the step's gradients), or
        ``zero_grad`` forgets what was staged (``prefetch=False``): after it, an offload may read
        the step's states as the gradients land."""
        ...

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
        """``master``'s new values after the step, on the compute device (for the 16-bit copy);
        ``master`` itself when not owned."""
        ...

    def refresh_low_precision(self) -> None: ...

    # -- values and states (safe_get/safe_set, checkpoints) -----------------------------------
    def master_value(self, master: torch.Tensor) -> torch.Tensor:
        """``master``'s values, wherever they live (``master.detach()`` when not owned)."""
        ...

    def set_master(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """Set ``master``'s values (copied into it when not owned)."""
        ...

    def state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """``master``'s optimizer state in torch's format (``optimizer.state`` when not owned)."""
        ...

    def deferred_state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """``state_of`` for writing checkpoints: states not in memory are ``DeferredTensor`` values
        (zero_core.checkpoint.fragments), read only when written."""
        ...

    def load_state(
        self, optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]
    ) -> None:
        """Set the given entries of ``master``'s optimizer state (see :func:`load_own_state`)."""
        ...

    def sync_from_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def state_dict_with_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    # -- accounting and lifetime --------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]: ...

    def owned_tensors(self) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


@torch.no_grad()
def load_own_state(optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]) -> None:
    """``load_state`` of a master nobody offloads: each entry of ``state`` goes into
    ``optimizer.state[master]``, a tensor copied into the live tensor of the same shape when
    there is one (so views and the optimizer's own references stay valid), else set."""
    live = optimizer.state[master]
    for key, value in state.items():
        current = live.get(key)
        if torch.is_tensor(current) and torch.is_tensor(value) and current.shape == value.shape:
            if current is not value:
                current.copy_(value)
        else:
            live[key] = value


class NoOptimizerOffload:
    """The :class:`OptimizerOffload` of a run that offloads nothing (the null object).

    It owns no master, so the strategies keep every master, gradient and state on the device:
    staging and the step do nothing, the accounting is empty, a checkpoint's optimizer state is
    the optimizer's own, and the calls about a master answer with the master itself (identity).
    As FSDP2's ``OffloadPolicy`` is to ``CPUOffloadPolicy``. See [Note: optimizer offload seam].
    """

    def adopt(self, sources: Sequence[torch.Tensor | MasterSource]) -> list[torch.Tensor]:
        # the masters stay where they are (a MasterSource is built here, as a Parameter)
        return [s if isinstance(s, torch.Tensor) else torch.nn.Parameter(master_values(s)) for s in sources]

    def finalize(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def owns(self, master: torch.Tensor) -> bool:
        return False

    def begin_staging(self, is_boundary: bool, prefetch: bool = True) -> None:
        pass

    def stage_grad(self, master: torch.Tensor, grad: torch.Tensor | None) -> None:
        pass  # the gradient stays with the strategy, which hands it to its own optimizer

    def stage_grad_range(self, master: torch.Tensor, lo: int, values: torch.Tensor) -> None:
        pass  # reduced gradients stay in the strategy's buffers

    def is_staged(self, master: torch.Tensor) -> bool:
        return False

    def streams_gradients(self) -> bool:
        return False

    def staged_grad(self, master: torch.Tensor) -> torch.Tensor | None:
        return None  # nothing is staged here

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scale: float | torch.Tensor = 1.0,
        publish: Publish | None = None,
    ) -> None:
        pass  # nothing is staged here: the strategy's own optimizer.step() updates every master

    def updated(self, master: torch.Tensor) -> torch.Tensor:
        return master.detach()  # the strategy's optimizer stepped the master itself

    def refresh_low_precision(self) -> None:
        pass

    def master_value(self, master: torch.Tensor) -> torch.Tensor:
        return master.detach()

    @torch.no_grad()
    def set_master(self, master: torch.Tensor, values: torch.Tensor) -> None:
        master.copy_(values.reshape(master.shape))

    def state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        return optimizer.state.get(master, {})

    def deferred_state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        return self.state_of(optimizer, master)  # in memory: nothing to defer

    def load_state(
        self, optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]
    ) -> None:
        load_own_state(optimizer, master, state)

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
