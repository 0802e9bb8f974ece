"""ZeRO-1/2 memory estimators (deepspeed.runtime.zero.stage_1_and_2), from zero-profiler."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.zero.stage_1_and_2", "zero_profiler")
