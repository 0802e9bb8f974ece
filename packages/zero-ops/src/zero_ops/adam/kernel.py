"""CPUAdamKernel: the FlatOptimizerKernel for Adam/AdamW (see [Note: tiled updates] in zero_ops.flat_kernel)."""

from __future__ import annotations

from zero_ops.adam.functional import adam_update
from zero_ops.flat_kernel import FlatKernelBase


class CPUAdamKernel(FlatKernelBase):
    """Adam/AdamW on flat buffers: states ``exp_avg``, ``exp_avg_sq`` (+ ``max_exp_avg_sq``)."""

    _name = "CPUAdamKernel"
    _hparam_names = ("betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
    _update_fn = staticmethod(adam_update)

    def __init__(
        self,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        threads: int | None = None,
        tile_numel: int | None = None,
    ) -> None:
        super().__init__(
            {
                "betas": tuple(betas),
                "eps": eps,
                "weight_decay": weight_decay,
                "adamw_mode": adamw_mode,
                "bias_correction": bias_correction,
            },
            threads,
            tile_numel,
        )
        self.amsgrad = bool(amsgrad)

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")
