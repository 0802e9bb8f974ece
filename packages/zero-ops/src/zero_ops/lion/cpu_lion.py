"""CPULion: the Lion optimizer on CPU with the native kernel (DeepSpeedCPULion's interface)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zero_ops import _flat
from zero_ops.lion.functional import lion_update
from zero_ops.optimizer_base import CPUOptimizerBase

_WHERE = "CPULion"


class CPULion(CPUOptimizerBase):
    """Lion for CPU parameters (state: ``step``, ``exp_avg``); see :func:`cpu_lion_step`."""

    _update_fn = staticmethod(lion_update)

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
        _flat.check_betas(_WHERE, betas, high_open=False)
        _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
        self.threads = _flat.optional_threads(_WHERE, threads)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)


DeepSpeedCPULion = CPULion
