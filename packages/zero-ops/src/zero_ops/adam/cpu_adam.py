"""CPUAdam: Adam/AdamW on CPU with the native kernel (DeepSpeedCPUAdam's interface)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zero_ops import _flat
from zero_ops.adam.functional import adam_update
from zero_ops.optimizer_base import CPUOptimizerBase

_WHERE = "CPUAdam"


class CPUAdam(CPUOptimizerBase):
    """Adam (``adamw_mode=False``, L2 weight decay) or AdamW (default) for CPU parameters.

    Same results as ``torch.optim.AdamW`` / ``torch.optim.Adam`` with the same hyper-parameters,
    and the same state_dict layout (see [Note: CPU optimizer state layout]). bf16/fp16 parameters
    keep an fp32 master copy and fp32 moments unless ``fp32_optimizer_states=False``.
    """

    _update_fn = staticmethod(adam_update)

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        threads: int | None = None,
    ) -> None:
        _flat.check_scalar(_WHERE, "lr", lr, low=0.0)
        _flat.check_betas(_WHERE, betas, high_open=True)
        _flat.check_scalar(_WHERE, "eps", eps, low=0.0)
        _flat.check_scalar(_WHERE, "weight_decay", weight_decay, low=0.0)
        for name, flag in (
            ("bias_correction", bias_correction),
            ("amsgrad", amsgrad),
            ("adamw_mode", adamw_mode),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{_WHERE}: {name} must be a bool, got {flag!r}")
        self.threads = _flat.optional_threads(_WHERE, threads)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "bias_correction": bias_correction,
            "adamw_mode": adamw_mode,
            # torch's key for the same choice, so torch.optim.AdamW can load our state_dict.
            "decoupled_weight_decay": adamw_mode,
            "maximize": False,
        }
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return names + ("max_exp_avg_sq",) if group["amsgrad"] else names

    def _normalize_loaded_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize", False):
            raise ValueError(f"{_WHERE}.load_state_dict: maximize=True is not supported")
        if "adamw_mode" not in group:  # a torch Adam/AdamW state_dict
            group["adamw_mode"] = bool(group.get("decoupled_weight_decay", False))
        group.setdefault("decoupled_weight_decay", group["adamw_mode"])
        group.setdefault("bias_correction", True)
        group.setdefault("amsgrad", False)
        group.setdefault("maximize", False)


# DeepSpeed's name, for users migrating from deepspeed.ops.adam.
DeepSpeedCPUAdam = CPUAdam
