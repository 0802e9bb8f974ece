"""User-facing utilities (``zero.utils``): data helpers and, with ZeRO, the safe_get/safe_set
debugging helpers."""

from __future__ import annotations

from zero_core import _lazy_exports
from zero_core.utils.repeating_loader import RepeatingLoader

# name -> module that defines it (loaded on first access; they need the ZeRO machinery)
_LAZY: dict[str, str] = {
    "safe_get_full_fp32_param": "zero_core.zero.debug_access",
    "safe_get_full_grad": "zero_core.zero.debug_access",
    "safe_get_full_optimizer_state": "zero_core.zero.debug_access",
    "safe_set_full_fp32_param": "zero_core.zero.debug_access",
    "safe_set_full_optimizer_state": "zero_core.zero.debug_access",
    # this rank's partition of a parameter (stages 1-3; see [Note: safe_get owner protocol])
    "safe_get_local_fp32_param": "zero_core.zero.debug_access",
    "safe_get_local_grad": "zero_core.zero.debug_access",
    "safe_get_local_optimizer_state": "zero_core.zero.debug_access",
    "safe_set_local_fp32_param": "zero_core.zero.debug_access",
    "safe_set_local_optimizer_state": "zero_core.zero.debug_access",
    "safe_set_full_grad": "zero_core.zero.debug_access",
    "safe_set_local_grad": "zero_core.zero.debug_access",
    # ZeRO-3 leaf modules (See [Note: z3 leaf modules]) and the seed helper, as in deepspeed.utils
    "set_z3_leaf_modules": "zero_core.zero.stage3.leaf_modules",
    "unset_z3_leaf_modules": "zero_core.zero.stage3.leaf_modules",
    "get_z3_leaf_modules": "zero_core.zero.stage3.leaf_modules",
    "z3_leaf_module": "zero_core.zero.stage3.leaf_modules",
    "z3_leaf_parameter": "zero_core.zero.stage3.leaf_modules",
    "set_z3_leaf_module": "zero_core.zero.stage3.leaf_modules",
    "set_random_seed": "zero_core.utils.seed",
}

__getattr__, __dir__ = _lazy_exports(__name__, globals(), _LAZY)


__all__ = ["RepeatingLoader", *_LAZY]
