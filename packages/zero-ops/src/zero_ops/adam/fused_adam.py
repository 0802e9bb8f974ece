"""Adam as DeepSpeed's ``FusedAdam`` defines it, for the settings torch's Adam cannot express.

The builder uses ``torch.optim.AdamW``/``Adam`` for ``"type": "Adam"`` (identical math, faster
foreach kernels); this class covers ``"bias_correction": false`` (BERT-style pre-training
configs), where the update is ``lr * m / (sqrt(v) + eps)`` with no ``1 - beta**step`` terms.
The arithmetic follows torch's Adam step for step, so with ``bias_correction=True`` it matches
``torch.optim.AdamW`` (``adam_w_mode=True``) or ``torch.optim.Adam`` (L2 decay). Param groups
carry ``adamw_mode`` and ``bias_correction``, which the CPU-offloaded step reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad)``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported (as in DeepSpeed's FusedAdam)")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"FusedAdam: lr must be a finite number >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: betas must be two numbers in [0, 1), got {betas!r}")
        if not eps >= 0:
            raise ValueError(f"FusedAdam: eps must be >= 0, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"FusedAdam: weight_decay must be >= 0, got {weight_decay!r}")
        defaults = dict(
            lr=lr,
            bias_correction=bool(bias_correction),
            betas=(float(betas[0]), float(betas[1])),
            eps=float(eps),
            adamw_mode=bool(adam_w_mode),
            weight_decay=float(weight_decay),
        )
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                grad = p.grad
                state = self.state[p]
                if not state:
                    # torch's layout (0-dim float step), so checkpoints read like torch.optim.Adam's
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if wd != 0:
                    if group["adamw_mode"]:
                        p.mul_(1 - lr * wd)
                    else:
                        grad = grad.add(p, alpha=wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    step_size = lr / (1 - beta1**step)
                    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                else:
                    step_size = lr
                    denom = exp_avg_sq.sqrt().add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
