"""1-bit LAMB (Li et al., arXiv 2104.06069), as DeepSpeed's ``OnebitLamb`` exposes it.

Warm-up (the first ``freeze_step`` steps): LAMB on all-reduced gradients, with the
arithmetic of :class:`zero_ops.lamb.Lamb` (so it matches that optimizer bit for bit),
while each tensor's trust ratio ``clamp(||w|| / ||update||, min_coeff, max_coeff)`` is
averaged: ``coeff = coeff_beta * coeff + (1 - coeff_beta) * ratio``.

Compression stage: the variance and the averaged coefficients are frozen; each rank updates
the momentum with its own gradient and the momenta are averaged through the 1-bit exchange
(see [Note: compressed all-reduce]; scales per tensor replace the paper's momentum scaling).
From consecutive averaged momenta each rank reconstructs the global gradient,
``(m_t - beta1 m_{t-1}) / (1 - beta1)``, and keeps a *fresh* variance of it. The frozen
coefficient is scaled by ``max(denominator_frozen / denominator_fresh)`` (blended towards 1 by
the share of weight decay in the update), clamped to ``[factor_min, factor_max]`` and to within
``factor_threshold`` of the previous step's factor, as the paper describes. Everything is
computed on the device: no value is read back to the host inside the step.

Bias correction (when ``bias_correction``): the momentum by ``1 - beta1**t``, the frozen
variance by ``1 - beta2**freeze_step``; the factor compares the uncorrected variances.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero_ops.onebit.base import FreezeStepOptimizer, check_int, check_number, init_adam_style


def _lamb_update(
    m: torch.Tensor, v: torch.Tensor, w: torch.Tensor, group: dict[str, Any], bc1: float, bc2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(update without weight decay, update with it), in Lamb's order of operations."""
    if group["bias_correction"]:
        m_hat, v_hat = m / bc1, v / bc2
    else:
        m_hat, v_hat = m, v
    if group["eps_inside_sqrt"]:
        prelim = m_hat / (v_hat + group["eps"]).sqrt()
    else:
        prelim = m_hat / (v_hat.sqrt() + group["eps"])
    update = prelim + group["weight_decay"] * w if group["weight_decay"] != 0 else prelim
    return prelim, update


def _trust_ratio(w: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    w_norm, u_norm = w.norm(), update.norm()
    ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


class OnebitLamb(FreezeStepOptimizer):
    """DeepSpeed's ``OnebitLamb(params, deepspeed, lr, freeze_step, bias_correction, betas, eps,
    eps_inside_sqrt, weight_decay, max_grad_norm, max_coeff, min_coeff, amsgrad, cuda_aware,
    comm_backend_name, coeff_beta, factor_max, factor_min, factor_threshold)``.

    See [Note: communication-compressed optimizers].
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        owner = "OnebitLamb"
        self.freeze_step = check_int("freeze_step", owner, freeze_step, 1)
        self.coeff_beta = check_number("coeff_beta", owner, coeff_beta, 0.0, 1.0)
        self.factor_min = check_number("factor_min", owner, factor_min, 0.0)
        self.factor_max = check_number("factor_max", owner, factor_max, 0.0)
        self.factor_threshold = check_number("factor_threshold", owner, factor_threshold, 0.0)
        if self.factor_min > self.factor_max:
            raise ValueError(f"{owner}: factor_min {factor_min} > factor_max {factor_max}")
        check_number("min_coeff", owner, min_coeff, 0.0)
        if min_coeff > max_coeff:
            raise ValueError(f"{owner}: min_coeff {min_coeff} > max_coeff {max_coeff}")
        init_adam_style(self, params, locals(), max_coeff=float(max_coeff), min_coeff=float(min_coeff))

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["lamb_coeff_freeze"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in ("lamb_coeff_freeze", "last_factor"):  # a checkpoint load gives back host tensors
            if key in state and state[key].device != p.device:
                state[key] = state[key].to(p.device)
        return state

    def _warmup_step(self, group: dict[str, Any], step: int) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad.float()
            state = self._state(p)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            w = p.float()
            _, update = _lamb_update(m, v, w, group, 1 - beta1**step, 1 - beta2**step)
            ratio = _trust_ratio(w, update, group)
            state["lamb_coeff_freeze"].mul_(self.coeff_beta).add_(ratio, alpha=1 - self.coeff_beta)
            p.add_((update * (-group["lr"] * ratio)).to(p.dtype))

    def _compressed_step(self, index: int, group: dict[str, Any], step: int) -> None:
        params = self.trained(group)
        if not params:
            return
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        previous = [s["exp_avg"].clone() for s in states]
        for p, s in zip(params, states):
            if "exp_avg_sq_fresh" not in s:  # the first compressed step: start the fresh variance
                s["exp_avg_sq_fresh"] = s["exp_avg_sq"].clone()
                s["last_factor"] = torch.ones((), dtype=torch.float32, device=p.device)
            if p.grad is None:
                s["exp_avg"].mul_(beta1)
            else:
                s["exp_avg"].mul_(beta1).add_(p.grad.float(), alpha=1 - beta1)
        self.exchange(index, [s["exp_avg"] for s in states])
        bc1, bc2 = 1 - beta1**step, 1 - beta2**self.freeze_step
        for p, s, m_prev in zip(params, states, previous):
            m, v, fresh = s["exp_avg"], s["exp_avg_sq"], s["exp_avg_sq_fresh"]
            rebuilt = (m - beta1 * m_prev).div_(1 - beta1)
            fresh.mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
            w = p.float()
            prelim, update = _lamb_update(m, v, w, group, bc1, bc2)
            coeff = s["lamb_coeff_freeze"] * self._factor(s, v, fresh, prelim, update, group)
            p.add_((update * (-group["lr"] * coeff)).to(p.dtype))

    def _factor(
        self,
        s: dict[str, Any],
        v: torch.Tensor,
        fresh: torch.Tensor,
        prelim: torch.Tensor,
        update: torch.Tensor,
        group: dict[str, Any],
    ) -> torch.Tensor:
        """The scaling of the frozen coefficient (paper's Algorithm 1), as a device scalar."""
        eps = group["eps"]
        factor = ((v.sqrt() + eps) / (fresh.sqrt() + eps)).max()
        if group["weight_decay"] != 0:
            share = (prelim.norm() / update.norm()).clamp(max=1.0).nan_to_num(1.0)
            factor = factor * share + (1.0 - share)
        factor = factor.clamp(self.factor_min, self.factor_max)
        last = s["last_factor"]
        factor = torch.minimum(
            torch.maximum(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold)
        )
        last.copy_(factor)
        return factor
