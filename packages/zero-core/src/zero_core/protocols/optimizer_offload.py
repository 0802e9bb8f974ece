"""The ``OptimizerOffload`` protocol: what the ZeRO stage strategies call on an optimizer offload.

[Note: optimizer offload seam]
With ``zero_optimization.offload_optimizer`` (cpu or nvme), zero-offload's ``OptimizerOffload``
takes over the fp32 master shards, their optimizer states and the optimizer step; the stage
strategies of zero-core (stages 1-2 and 3) hand it their masters (``adopt``), the reduced
gradients as they land (``begin_staging``/``stage_grad``/``stage_grad_range``), the step, and
ask it for values and states when users or checkpoints read them. This protocol names those
calls, so the strategies code against a type instead of ``Any``, and zero-offload's class is
checked against it (``isinstance``, in zero-offload's tests). The strategies hold ``None`` when
nothing is offloaded (a null implementation that would remove their ``if self.offload is not
None`` branches is not written yet).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class OptimizerOffload(Protocol):
    """See [Note: optimizer offload seam]."""

    # -- taking over the masters --------------------------------------------------------------
    def adopt(self, sources: list[torch.Tensor]) -> list[torch.nn.Parameter]:
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

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float | torch.Tensor = 1.0) -> None: ...

    def updated(self, master: torch.Tensor) -> torch.Tensor:
        """``master``'s new values after the step, on the compute device (for the 16-bit copy)."""
        ...

    def refresh_low_precision(self) -> None: ...

    # -- values and states (safe_get/safe_set, checkpoints) -----------------------------------
    def master_value(self, master: torch.Tensor) -> torch.Tensor: ...

    def set_master(self, master: torch.Tensor, values: torch.Tensor) -> None: ...

    def state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]: ...

    def load_state(
        self, optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]
    ) -> None: ...

    def sync_from_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def state_dict_with_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    # -- accounting and lifetime --------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]: ...

    def owned_tensors(self) -> list[torch.Tensor]: ...

    def close(self) -> None: ...
