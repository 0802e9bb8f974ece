"""DeepSpeed's learning-rate schedulers (deepspeed.runtime.lr_schedules), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.lr_schedules", "zero_core.lr_schedules")
