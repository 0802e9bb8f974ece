"""The ``FlatOptimizerKernel`` protocol: an optimizer that updates flat fp32 buffers in place.

ZeRO keeps each rank's optimizer partition as one flat fp32 buffer of parameters, one of
gradients and one per optimizer state, so the update is a single kernel call over contiguous
memory (the CPUAdam / fused-Adam shape). zero-ops provides the native kernels against this
signature, and zero-offload's optimizer step drives them.

``step`` updates ``params`` and every tensor in ``states`` in place. ``step`` (the
optimizer step count, starting at 1) drives bias correction; ``lr`` and any ``hparams``
(``betas``, ``eps``, ``weight_decay`` ...) may change from call to call (LR schedules,
per-group settings). When ``low_precision_out`` is given, the updated parameters are also
written into it, cast to its dtype (fp16/bf16), in the same pass: this is the fused copy-out
of the 16-bit model weights that mixed precision needs after every step.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class FlatOptimizerKernel(Protocol):
    def state_names(self) -> tuple[str, ...]:
        """Names of the per-element state buffers ``step`` expects in ``states``."""
        ...

    def step(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        states: dict[str, torch.Tensor],
        *,
        step: int,
        lr: float,
        low_precision_out: torch.Tensor | None = None,
        **hparams: object,
    ) -> None: ...
