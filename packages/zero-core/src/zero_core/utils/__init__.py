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
}

__getattr__, __dir__ = _lazy_exports(__name__, globals(), _LAZY)


__all__ = ["RepeatingLoader", *_LAZY]
