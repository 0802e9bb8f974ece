"""Reference ``FlatOptimizerKernel`` implementations in plain torch.

``TorchAdamKernel`` reproduces ``torch.optim.AdamW`` (``adamw_mode=True``) and
``torch.optim.Adam`` (``adamw_mode=False``, L2 weight decay) operation for operation, on one
flat fp32 buffer. It is the correctness reference for zero-ops' native CPUAdam and the
default kernel of the engine when no native kernel is installed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_HPARAMS = ("betas", "eps", "weight_decay")


class TorchAdamKernel:
    """Adam/AdamW over flat fp32 buffers; states ``exp_avg`` and ``exp_avg_sq``.

    Args:
        betas, eps, weight_decay: defaults, overridable per ``step`` call.
        adamw_mode: decoupled weight decay (AdamW) when True, L2 added to the gradient (Adam)
            when False.
        bias_correction: apply Adam's bias correction (DeepSpeed's ``bias_correction`` flag).
    """

    def __init__(
        self,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        self.defaults = _check_hparams(
            {"betas": betas, "eps": eps, "weight_decay": weight_decay}, "TorchAdamKernel"
        )
        self.adamw_mode = bool(adamw_mode)
        self.bias_correction = bool(bias_correction)

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def init_state(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-initialised states for ``params``."""
        return {name: torch.zeros_like(params, dtype=torch.float32) for name in self.state_names()}

    def step(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        states: dict[str, torch.Tensor],
        *,
        step: int,
        lr: float,
        low_precision_out: torch.Tensor | None = None,
        **hparams: Any,
    ) -> None:
        """One Adam(W) update of ``params`` and ``states`` in place (``step`` counts from 1)."""
        _check_buffers(params, grads, states, self.state_names(), low_precision_out)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"TorchAdamKernel.step: step must be an int >= 1, got {step!r}")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"TorchAdamKernel.step: lr must be a finite number >= 0, got {lr!r}")
        unknown = sorted(set(hparams) - set(_HPARAMS))
        if unknown:
            raise ValueError(
                f"TorchAdamKernel.step: unknown hyper-parameter(s) {unknown}; allowed: {list(_HPARAMS)}"
            )
        hp = _check_hparams({**self.defaults, **hparams}, "TorchAdamKernel.step")
        beta1, beta2 = hp["betas"]
        eps, wd = hp["eps"], hp["weight_decay"]
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]

        with torch.no_grad():
            grad = grads if grads.dtype == torch.float32 else grads.float()
            if wd != 0:
                if self.adamw_mode:
                    params.mul_(1 - lr * wd)
                else:
                    grad = grad.add(params, alpha=wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if self.bias_correction:
                step_size = lr / (1 - beta1**step)
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            else:
                step_size = lr
                denom = exp_avg_sq.sqrt().add_(eps)
            params.addcdiv_(exp_avg, denom, value=-step_size)
            if low_precision_out is not None:
                low_precision_out.view(-1).copy_(params.view(-1))


def _check_hparams(hp: dict[str, Any], where: str) -> dict[str, Any]:
    betas = hp["betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) for b in betas)
    ):
        raise ValueError(f"{where}: betas must be a pair of floats, got {betas!r}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must lie in [0, 1), got {betas!r}")
    if not isinstance(hp["eps"], (int, float)) or not hp["eps"] >= 0:
        raise ValueError(f"{where}: eps must be >= 0, got {hp['eps']!r}")
    if not isinstance(hp["weight_decay"], (int, float)) or not hp["weight_decay"] >= 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {hp['weight_decay']!r}")
    return {
        "betas": (float(betas[0]), float(betas[1])),
        "eps": float(hp["eps"]),
        "weight_decay": float(hp["weight_decay"]),
    }


def _check_buffers(
    params: Any, grads: Any, states: Any, names: tuple[str, ...], low_precision_out: Any
) -> None:
    where = "TorchAdamKernel.step"
    if not isinstance(params, torch.Tensor) or params.dtype != torch.float32:
        raise TypeError(
            f"{where}: params must be a float32 tensor, got {getattr(params, 'dtype', type(params).__name__)}"
        )
    if not params.is_contiguous():
        raise ValueError(f"{where}: params must be contiguous (a flat buffer)")
    if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
        raise TypeError(f"{where}: grads must be a floating-point tensor")
    if grads.shape != params.shape or grads.device != params.device:
        raise ValueError(
            f"{where}: grads {tuple(grads.shape)}@{grads.device} must match params {tuple(params.shape)}@{params.device}"
        )
    if not isinstance(states, dict) or set(states) != set(names):
        got = sorted(states) if isinstance(states, dict) else type(states).__name__
        raise ValueError(f"{where}: states must be a dict with exactly the keys {list(names)}, got {got}")
    for name in names:
        s = states[name]
        if (
            not isinstance(s, torch.Tensor)
            or s.dtype != torch.float32
            or s.shape != params.shape
            or s.device != params.device
        ):
            raise ValueError(
                f"{where}: states[{name!r}] must be a float32 tensor shaped and placed like params"
            )
    if low_precision_out is not None:
        if not isinstance(low_precision_out, torch.Tensor) or low_precision_out.dtype not in (
            torch.float16,
            torch.bfloat16,
        ):
            raise TypeError(f"{where}: low_precision_out must be a float16 or bfloat16 tensor")
        if low_precision_out.numel() != params.numel() or not low_precision_out.is_contiguous():
            raise ValueError(f"{where}: low_precision_out must be contiguous with {params.numel()} elements")
