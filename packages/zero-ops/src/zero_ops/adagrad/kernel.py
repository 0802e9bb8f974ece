"""CPUAdagradKernel: the FlatOptimizerKernel for Adagrad (see zero_ops.flat_kernel)."""

from __future__ import annotations

from zero_ops.adagrad.functional import adagrad_update
from zero_ops.flat_kernel import FlatKernelBase


class CPUAdagradKernel(FlatKernelBase):
    """Adagrad on flat buffers: state ``sum``."""

    _name = "CPUAdagradKernel"
    _hparam_names = ("eps", "weight_decay", "lr_decay")
    _update_fn = staticmethod(adagrad_update)

    def __init__(
        self,
        *,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        lr_decay: float = 0.0,
        threads: int | None = None,
        tile_numel: int | None = None,
    ) -> None:
        super().__init__(
            {"eps": eps, "weight_decay": weight_decay, "lr_decay": lr_decay}, threads, tile_numel
        )

    def state_names(self) -> tuple[str, ...]:
        return ("sum",)
