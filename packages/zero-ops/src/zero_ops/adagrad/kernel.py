"""CPUAdagradKernel: the FlatOptimizerKernel for Adagrad (see zero_ops.flat_kernel)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zero_ops.adagrad.functional import cpu_adagrad_step
from zero_ops.flat_kernel import FlatKernelBase, TileCallback


class CPUAdagradKernel(FlatKernelBase):
    """Adagrad on flat buffers: state ``sum``."""

    _name = "CPUAdagradKernel"
    _hparam_names = ("eps", "weight_decay", "lr_decay")

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
        """One Adagrad update of the flat ``params`` in place."""
        h = self._merged(hparams)

        def fn(p, g, s, lp):
            cpu_adagrad_step(
                p,
                g,
                s,
                step=step,
                lr=lr,
                eps=h["eps"],
                weight_decay=h["weight_decay"],
                lr_decay=h["lr_decay"],
                low_precision_out=lp,
                threads=self.threads,
            )

        self._run_tiled(params, grads, self._states(states), low_precision_out, on_tile_done, fn)
