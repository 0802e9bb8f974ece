"""1-bit Adam (Tang et al., arXiv 2102.02888), as DeepSpeed's ``OnebitAdam`` exposes it.

Warm-up (the first ``freeze_step`` steps): Adam on all-reduced gradients, with the arithmetic
of :class:`zero_ops.adam.FusedAdam` (decoupled weight decay), so it matches that
optimizer bit for bit. Then the variance is frozen, and each step updates the momentum with
this rank's own gradient and averages the momentum through the error-compensated 1-bit
exchange (see [Note: compressed all-reduce]); every rank then applies the same update.

``bias_correction`` is honoured (DeepSpeed's implementation accepts and ignores it): after
the freeze the variance keeps the correction of the step it froze at, ``1 - beta2**freeze_step``,
so a short warm-up does not inflate the steps; pass ``bias_correction=False`` for DeepSpeed's
uncorrected math.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from zero_ops.onebit.base import FreezeStepOptimizer, check_int, init_adam_style


def adam_moments(state: dict[str, Any], p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp_avg``, ``exp_avg_sq`` of ``p`` (created as zeros, like FusedAdam's)."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state["exp_avg"], state["exp_avg_sq"]


def adam_denominator(v: torch.Tensor, group: dict[str, Any], var_step: int) -> torch.Tensor:
    """``sqrt(v_hat) + eps`` (or ``sqrt(v_hat + eps)``), in FusedAdam's order of operations."""
    beta2 = group["betas"][1]
    if group["eps_inside_sqrt"]:
        v_hat = v / (1 - beta2**var_step) if group["bias_correction"] else v
        return (v_hat + group["eps"]).sqrt()
    if group["bias_correction"]:
        return (v.sqrt() / math.sqrt(1 - beta2**var_step)).add_(group["eps"])
    return v.sqrt().add_(group["eps"])


def adam_apply(
    p: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, group: dict[str, Any], step: int
) -> None:
    """``p <- p (1 - lr wd) - lr m_hat / denom`` (FusedAdam's adam_w_mode arithmetic)."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0:
        p.mul_(1 - lr * wd)
    step_size = lr / (1 - group["betas"][0] ** step) if group["bias_correction"] else lr
    p.addcdiv_(m, denom, value=-step_size)


class OnebitAdam(FreezeStepOptimizer):
    """DeepSpeed's ``OnebitAdam(params, deepspeed, lr, freeze_step, bias_correction, betas, eps,
    eps_inside_sqrt, weight_decay, max_grad_norm, amsgrad, cuda_aware, comm_backend_name)``.

    ``deepspeed`` (DeepSpeed's engine handle) is accepted for the signature; zero's engine binds
    itself through ``bind_data_parallel``. See [Note: communication-compressed optimizers].
    """

    def __init__(
        self,
        params: Iterable[Any],
        deepspeed: object = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        self.freeze_step = check_int("freeze_step", "OnebitAdam", freeze_step, 1)
        init_adam_style(self, params, locals())

    def _warmup_step(self, group: dict[str, Any], step: int) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            m, v = adam_moments(self.state[p], p)
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            adam_apply(p, m, adam_denominator(v, group, step), group, step)

    def _compressed_step(self, index: int, group: dict[str, Any], step: int) -> None:
        params = self.trained(group)
        if not params:
            return
        beta1 = group["betas"][0]
        moments = [adam_moments(self.state[p], p) for p in params]
        for p, (m, _) in zip(params, moments):
            if p.grad is None:
                m.mul_(beta1)  # no local gradient: a zero one (every rank must exchange every tensor)
            else:
                m.lerp_(p.grad, 1 - beta1)
        self.exchange(index, [m for m, _ in moments])
        for p, (m, v) in zip(params, moments):
            adam_apply(p, m, adam_denominator(v, group, self.freeze_step), group, step)
