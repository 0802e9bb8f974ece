"""CPULion: the Lion optimizer on CPU with the native kernel (DeepSpeedCPULion's interface)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zero_ops import _flat
from zero_ops.lion.functional import cpu_lion_step
from zero_ops.optimizer_base import CPUOptimizerBase

_WHERE = "CPULion"


class CPULion(CPUOptimizerBase):
    """Lion for CPU parameters (state: ``step``, ``exp_avg``); see :func:`cpu_lion_step`."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
        *,
        threads: int | None = None,
    ) -> None:
        _flat.check_scalar(_WHERE, "lr", lr, low=0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{_WHERE}: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            _flat.check_scalar(_WHERE, f"betas[{i}]", b, low=0.0, high=1.0)
        _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
        self.threads = _flat.resolve_threads(_WHERE, threads) if threads is not None else None
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def _update(self, work, grad, states, lp_out, group, step) -> None:
        beta1, beta2 = group["betas"]
        cpu_lion_step(
            work,
            grad,
            states["exp_avg"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            low_precision_out=lp_out,
            threads=self.threads,
        )


DeepSpeedCPULion = CPULion
