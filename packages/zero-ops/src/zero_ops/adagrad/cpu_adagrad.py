"""CPUAdagrad: Adagrad on CPU with the native kernel (DeepSpeedCPUAdagrad's interface)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zero_ops import _flat
from zero_ops.adagrad.functional import adagrad_update
from zero_ops.optimizer_base import CPUOptimizerBase

_WHERE = "CPUAdagrad"


class CPUAdagrad(CPUOptimizerBase):
    """Adagrad for CPU parameters; same results and state layout as ``torch.optim.Adagrad``
    (``initial_accumulator_value=0``). ``amsgrad`` exists for DeepSpeed compatibility and must be
    False (DeepSpeed does not implement it either)."""

    _update_fn = staticmethod(adagrad_update)

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        *,
        lr_decay: float = 0.0,
        threads: int | None = None,
    ) -> None:
        _flat.check_scalar(_WHERE, "lr", lr, low=0.0)
        _flat.check_scalar(_WHERE, "eps", eps, low=0.0)
        _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
        _flat.check_scalar(_WHERE, "lr_decay", lr_decay, low=0.0)
        if amsgrad:
            raise ValueError(f"{_WHERE}: amsgrad=True is not supported by Adagrad")
        self.threads = _flat.optional_threads(_WHERE, threads)
        defaults = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "lr_decay": lr_decay,
            "initial_accumulator_value": 0.0,
            "maximize": False,
        }
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def _step_sparse(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """A sparse gradient (``nn.Embedding(sparse=True)``), as DeepSpeed's CPUAdagrad: only the
        entries the gradient holds (rows of an embedding) are updated, their ``sum`` included;
        with weight decay 0 this is torch.optim.Adagrad's sparse update (which refuses weight
        decay; here it applies to the touched entries, as in DeepSpeed)."""
        if grad.device.type != "cpu" or grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{_WHERE}: gradient must be a CPU fp32/bf16/fp16 tensor, got {grad.dtype}")
        grad = grad.coalesce()  # repeated indices (a token seen twice) summed, as torch does
        where = tuple(grad.indices())
        state = self._new_state(p, group)
        state["step"] += 1
        low_precision = p.dtype != torch.float32 and self.fp32_optimizer_states
        if low_precision and "master_param" not in state:
            state["master_param"] = p.detach().float().contiguous()
        target = state["master_param"] if low_precision else p
        work = target[where].float().contiguous()
        sums = {"sum": state["sum"][where].float().contiguous()}
        self._update(work, grad.values().float().contiguous(), sums, None, group, int(state["step"].item()))
        target[where] = work.to(target.dtype)
        state["sum"][where] = sums["sum"].to(state["sum"].dtype)
        if target is not p:
            p[where] = work.to(p.dtype)

    def _normalize_loaded_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize", False):
            raise ValueError(f"{_WHERE}.load_state_dict: maximize=True is not supported")
        group.setdefault("lr_decay", 0.0)


DeepSpeedCPUAdagrad = CPUAdagrad
