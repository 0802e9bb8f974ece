"""Stage 0's side of the ``safe_get_*`` / ``safe_set_*`` helpers (See [Note: safe_get owner protocol]).

Nothing is partitioned at stage 0, so every rank holds the whole of each value and nothing
here communicates; what the owner adds over reading the module is the right *tensor*: with
fp16/bf16 the optimizer steps fp32 master copies, so the "fp32 parameter" and the optimizer
states belong to the master, not to the 16-bit module parameter (DeepSpeed's bf16 optimizer
answers the same way). Gradients are the reduced ones (valid between the backward of a
boundary and ``engine.step()``), divided by the fp16 loss scale. "Local" means the whole
parameter, flattened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zero_core.engine.data_parallel import DataParallelStrategy


class DataParallelStateAccess:
    """The owner object of [Note: safe_get owner protocol] for stage-0 parameters."""

    def __init__(self, strategy: DataParallelStrategy) -> None:
        self.strategy = strategy

    def _master(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.strategy.master.get(p, p)

    def _scale(self) -> float:
        scaler = getattr(self.strategy, "loss_scaler", None)
        return float(scaler.loss_scale) if scaler is not None else 1.0

    def _state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        state = self.strategy.optimizer.state.get(self._master(p), {})
        if key not in state:
            have = sorted(state) or "none yet: states appear after the first optimizer step"
            raise KeyError(f"optimizer state {key!r} does not exist for this parameter (available: {have})")
        return state[key]

    # -- full form --------------------------------------------------------------------------
    def full_fp32_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self._master(p).detach().float().clone()

    def full_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        grad = self.strategy.grad_of(p)
        if grad is None:
            return None
        g = (grad.to_dense() if grad.is_sparse else grad).detach().float().clone()
        scale = self._scale()
        return g.div_(scale) if scale != 1.0 else g

    def full_optimizer_state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        return self._state(p, key).detach().clone()

    @torch.no_grad()
    def set_full_fp32_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        m = self._master(p)
        m.copy_(value.detach().reshape(m.shape).to(m.dtype))
        if m is not p:
            p.copy_(m.to(p.dtype))

    @torch.no_grad()
    def set_full_optimizer_state(self, p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        target = self._state(p, key)
        target.copy_(value.detach().reshape(target.shape).to(target.dtype))

    @torch.no_grad()
    def set_full_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        g = value.detach().reshape(p.shape).float() * self._scale()
        self.strategy.set_grad(p, g)

    # -- local form: the whole parameter, flat ----------------------------------------------
    def local_fp32_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.full_fp32_param(p).reshape(-1)

    def local_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        g = self.full_grad(p)
        return None if g is None else g.reshape(-1)

    def local_optimizer_state(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        return self.full_optimizer_state(p, key).reshape(-1)

    def _check(self, p: torch.nn.Parameter, value: object, where: str) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: value must be a torch.Tensor, got {type(value).__name__}")
        if value.numel() != p.numel():
            raise ValueError(f"{where}: value has {value.numel()} elements, the parameter {p.numel()}")

    def set_local_fp32_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self._check(p, value, "safe_set_local_fp32_param")
        self.set_full_fp32_param(p, value)

    def set_local_optimizer_state(self, p: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        self._check(p, value, "safe_set_local_optimizer_state")
        self.set_full_optimizer_state(p, value, key)

    def set_local_grad(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        self._check(p, value, "safe_set_local_grad")
        self.set_full_grad(p, value)
