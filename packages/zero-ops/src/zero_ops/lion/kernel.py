"""CPULionKernel: the FlatOptimizerKernel for Lion (see zero_ops.flat_kernel)."""

from __future__ import annotations

from zero_ops import _flat
from zero_ops.flat_kernel import FlatKernelBase
from zero_ops.lion.functional import lion_update


class CPULionKernel(FlatKernelBase):
    """Lion on flat buffers: state ``exp_avg``. ``step`` is accepted (protocol) but unused."""

    _name = "CPULionKernel"
    _hparam_names = ("betas", "weight_decay")
    _update_fn = staticmethod(lion_update)

    def __init__(
        self,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        threads: int | None = None,
        tile_numel: int | None = None,
    ) -> None:
        super().__init__({"betas": tuple(betas), "weight_decay": weight_decay}, threads, tile_numel)

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg",)

    def _check_step(self, step: int) -> None:
        _flat.check_step(self._name, step)  # Lion's update does not use step, so nothing else would
