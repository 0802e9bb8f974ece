"""LAMB: layer-wise adaptive moments (You et al., 2019), as DeepSpeed's FusedLamb computes it.

Adam's update direction is rescaled per parameter tensor by the trust ratio
``||w|| / ||update||``, clamped to ``[min_coeff, max_coeff]`` (DeepSpeed's defaults 0.01 and
10.0). A zero norm on either side gives a ratio of 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        if eps <= 0:
            raise ValueError(f"Lamb: eps must be > 0, got {eps}")
        if min_coeff > max_coeff:
            raise ValueError(f"Lamb: min_coeff {min_coeff} > max_coeff {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = int(state["step"].item())
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = m / (1 - beta1**step)
                    v_hat = v / (1 - beta2**step)
                else:
                    m_hat, v_hat = m, v
                w = p.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"] != 0:
                    update = update + group["weight_decay"] * w
                w_norm = w.norm()
                u_norm = update.norm()
                if w_norm > 0 and u_norm > 0:
                    ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
                else:
                    ratio = torch.tensor(1.0)
                p.add_((update * (-group["lr"] * ratio)).to(p.dtype))
        return loss
