"""CPUAdamKernel: the FlatOptimizerKernel for Adam/AdamW (see [Note: tiled updates] in zero_ops.flat_kernel)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zero_ops.adam.functional import cpu_adam_step
from zero_ops.flat_kernel import FlatKernelBase, TileCallback


class CPUAdamKernel(FlatKernelBase):
    """Adam/AdamW on flat buffers: states ``exp_avg``, ``exp_avg_sq`` (+ ``max_exp_avg_sq``)."""

    _name = "CPUAdamKernel"
    _hparam_names = ("betas", "eps", "weight_decay", "adamw_mode", "bias_correction")

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
        """One update of the flat ``params`` in place (see cpu_adam_step and [Note: tiled updates])."""
        h = self._merged(hparams)
        beta1, beta2 = h["betas"]
        bufs = self._states(states)

        def fn(p, g, m, v, *rest):
            vmax = rest[0] if self.amsgrad else None
            cpu_adam_step(
                p,
                g,
                m,
                v,
                step=step,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=h["eps"],
                weight_decay=h["weight_decay"],
                adamw_mode=h["adamw_mode"],
                bias_correction=h["bias_correction"],
                amsgrad_max=vmax,
                low_precision_out=rest[-1],
                threads=self.threads,
            )

        self._run_tiled(params, grads, bufs, low_precision_out, on_tile_done, fn)
