"""User-facing utilities (``zero.utils``): data helpers and, with ZeRO, the safe_get/safe_set
debugging helpers."""

from __future__ import annotations

import importlib
from typing import Any

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
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_core.utils' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)


__all__ = ["RepeatingLoader", *_LAZY]
