"""Loading state dicts written with DeepSpeed's MoE submodule names.

[Note: DeepSpeed MoE names]
zero-moe names the MoE layer's inner module ``zero_moe`` and the expert list ``zero_experts``
where DeepSpeed's are ``deepspeed_moe`` and ``deepspeed_experts``; the rest of the layout
(``gate.wg``, ``experts``, ``mlp``, ``coefficient``, one entry per local expert) is the same. So a
DeepSpeed model's MoE weights (``layer.deepspeed_moe.experts.deepspeed_experts.0.fc1.weight``)
load into our layer: a load-state-dict pre-hook on :class:`~zero_moe.layer.MoE` and on
:class:`~zero_moe.experts.Experts` renames the keys under the module's prefix before PyTorch
matches them. Our own names stay what ``state_dict()`` writes; a state dict holding both
spellings of one key is an error rather than a silent choice.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def _rename(state_dict: dict[str, Any], prefix: str, old: str, new: str) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + old)]:
        target = prefix + new + key[len(prefix + old) :]
        if target in state_dict:
            raise RuntimeError(
                f"load_state_dict: both {key!r} (DeepSpeed's name) and {target!r} (zero's) are given; "
                "keep one of them"
            )
        state_dict[target] = state_dict.pop(key)


def _moe_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: object) -> None:
    # ``deepspeed_moe.X`` -> ``zero_moe.X``; the experts below are renamed by their own hook.
    _rename(state_dict, prefix, "deepspeed_moe.", "zero_moe.")


def _experts_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: object) -> None:
    _rename(state_dict, prefix, "deepspeed_experts.", "zero_experts.")


def accept_deepspeed_moe_names(module: nn.Module) -> None:
    """Let ``module`` (an MoE layer) load DeepSpeed-named keys. See [Note: DeepSpeed MoE names]."""
    module.register_load_state_dict_pre_hook(_moe_pre_hook)


def accept_deepspeed_experts_names(module: nn.Module) -> None:
    """Let ``module`` (an Experts container) load DeepSpeed-named keys. See [Note: DeepSpeed MoE names]."""
    module.register_load_state_dict_pre_hook(_experts_pre_hook)
