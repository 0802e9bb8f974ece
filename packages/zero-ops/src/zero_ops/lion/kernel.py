"""CPULionKernel: the FlatOptimizerKernel for Lion (see zero_ops.flat_kernel)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zero_ops import _flat
from zero_ops.flat_kernel import FlatKernelBase, TileCallback
from zero_ops.lion.functional import cpu_lion_step


class CPULionKernel(FlatKernelBase):
    """Lion on flat buffers: state ``exp_avg``. ``step`` is accepted (protocol) but unused."""

    _name = "CPULionKernel"
    _hparam_names = ("betas", "weight_decay")

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

    def step(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        states: Mapping[str, torch.Tensor],
        *,
        step: int,
        lr: float,
        low_precision_out: torch.Tensor | None = None,
        on_tile_done: TileCallback | None = None,
        **hparams: Any,
    ) -> None:
        """One Lion update of the flat ``params`` in place."""
        h = self._merged(hparams)
        beta1, beta2 = h["betas"]
        _flat.check_step(self._name, step)

        def fn(p, g, m, lp):
            cpu_lion_step(
                p,
                g,
                m,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=h["weight_decay"],
                low_precision_out=lp,
                threads=self.threads,
            )

        self._run_tiled(params, grads, self._states(states), low_precision_out, on_tile_done, fn)
