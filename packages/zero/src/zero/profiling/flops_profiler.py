"""The flops profiler (deepspeed.profiling.flops_profiler), from zero-profiler."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.profiling.flops_profiler", "zero_profiler")
