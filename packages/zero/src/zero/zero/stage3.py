"""ZeRO-3 memory estimators (deepspeed.runtime.zero.stage3), from zero-profiler."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.zero.stage3", "zero_profiler")
