"""The communication layer every collective goes through (deepspeed.comm), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.comm", "zero_core.comm")
