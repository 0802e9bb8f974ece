"""Utilities (deepspeed.utils): safe_get/safe_set helpers, RepeatingLoader, from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.utils", "zero_core.utils")
