"""Mixed-precision sections: ``fp16`` (with dynamic loss scaling), ``bf16``, ``amp``, ``data_types``
and the communication data type.

Exclusivity between them (fp16 xor bf16, amp alone) is checked by the root model, which sees all
sections at once.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator, ConfigDict

from zero_core.config.base import AUTO, ConfigModel, NonNegFloat, NonNegInt, PosFloat, PosInt, one_of

_DTYPE_SPELLINGS = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
}


def _canonical_dtype(value: object) -> object:
    if isinstance(value, str):
        return _DTYPE_SPELLINGS.get(value.lower(), value)
    return value


#: ``"fp16"``, ``"bf16"`` or ``"fp32"``; also accepts ``"float16"``, ``"bfloat16"``, ``"torch.half"``, ...
DataType = Annotated[one_of(("fp16", "bf16", "fp32")), BeforeValidator(_canonical_dtype)]


class FP16Config(ConfigModel):
    """``fp16``: fp16 mixed precision with a (dynamic by default) loss scaler.

    ``loss_scale`` 0 selects dynamic loss scaling starting at ``2**initial_scale_power``; the scale
    is halved after ``hysteresis`` overflowing steps and doubled after ``loss_scale_window`` clean
    steps, never going below ``min_loss_scale``.
    """

    config_path: ClassVar[str] = "fp16"

    enabled: Annotated[bool, AUTO] = False
    auto_cast: bool = False
    loss_scale: NonNegFloat = 0.0
    initial_scale_power: NonNegInt = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: PosFloat = 1.0
    fp16_master_weights_and_grads: bool = False

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts (``loss_scale`` is 0)."""
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The loss scale of the first step: ``2**initial_scale_power`` when dynamic."""
        return float(2**self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


#: fp16 keys that configs often copy into ``bf16`` (DeepSpeed's own tests do): DeepSpeed ignores
#: them there, as bf16 needs no loss scaling and ``auto_cast`` is an fp16 switch.
_FP16_ONLY_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "auto_cast",
)


class BF16Config(ConfigModel):
    """``bf16`` (alias ``bfloat16``): bf16 mixed precision; no loss scaling is needed.

    The fp16-only keys of :data:`_FP16_ONLY_KEYS` are accepted and dropped with a warning, as
    DeepSpeed ignores them in this section.
    """

    config_path: ClassVar[str] = "bf16"
    deprecated_keys: ClassVar[dict[str, str]] = dict.fromkeys(_FP16_ONLY_KEYS, "nothing (fp16 only)")

    enabled: Annotated[bool, AUTO] = False
    immediate_grad_update: bool = False
    # DeepSpeed (0.19's default): a step whose gradient norm is inf/nan is skipped, not applied.
    check_grad_overflow: bool = True
    # DeepSpeed 0.18's memory mode: bf16 masters, gradients and optimizer states (See [Note: bf16
    # master weights]); checked against the other sections by bf16_master_problems
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    @classmethod
    def _translate_deprecated(cls, data: dict[str, Any]) -> dict[str, Any]:
        dropped = [k for k in _FP16_ONLY_KEYS if k in data]
        for key in dropped:
            del data[key]
        verb, has = ("applies", "has") if len(dropped) == 1 else ("apply", "have")
        warnings.warn(
            f"bf16: {', '.join(dropped)} {verb} to fp16 only and {has} no effect with bf16 (which needs no "
            "loss scaling); ignored, as DeepSpeed does",
            UserWarning,
            stacklevel=2,
        )
        return data


class AmpConfig(ConfigModel):
    """``amp``: NVIDIA Apex AMP. Every key besides ``enabled`` is passed to ``amp.initialize``."""

    model_config = ConfigDict(extra="allow")
    config_path: ClassVar[str] = "amp"
    unknown_keys: ClassVar[str] = "allow"

    enabled: Annotated[bool, AUTO] = False

    @property
    def params(self) -> dict[str, Any]:
        """The keyword arguments for ``amp.initialize`` (every key but ``enabled``)."""
        return dict(self.model_extra or {})


class DataTypesConfig(ConfigModel):
    """``data_types``: ``grad_accum_dtype`` is the dtype gradients are accumulated in."""

    config_path: ClassVar[str] = "data_types"

    grad_accum_dtype: DataType | None = None


def bf16_master_problems(bf16: BF16Config, stage: int, offload_optimizer: bool) -> list[str]:
    """What is wrong with ``bf16.bf16_master_weights_and_grads`` / ``bf16.bf16_optimizer_states``
    given the ZeRO stage and whether the optimizer is offloaded (See [Note: bf16 master weights])."""
    masters, states = bf16.bf16_master_weights_and_grads, bf16.bf16_optimizer_states
    if not (masters or states):
        return []
    if states and not masters:
        return [
            "bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads: true as well "
            "(as in DeepSpeed: bf16 states step bf16 masters)"
        ]
    key = "bf16.bf16_master_weights_and_grads"
    if not states:
        return [
            f"{key}: true without bf16.bf16_optimizer_states keeps fp32 optimizer states beside bf16 "
            "masters, which DeepSpeed runs only with offload_optimizer and its CPU Adam and zero does not "
            "implement; set bf16.bf16_optimizer_states: true too (masters, gradients and states in bf16)"
        ]
    problems = []
    if not bf16.enabled:
        problems.append(f"{key}: true needs bf16.enabled: true (bf16 masters of bf16 parameters)")
    if stage not in (1, 2, 3):
        problems.append(
            f"{key}: true needs zero_optimization.stage 1, 2 or 3 (as in DeepSpeed), got stage {stage}"
        )
    if offload_optimizer:
        problems.append(
            f"{key}: true cannot be combined with zero_optimization.offload_optimizer here (zero-offload "
            "steps fp32 masters); remove one of them"
        )
    return problems
