"""Flops profiler and memory estimators (deepspeed.profiling), from zero-profiler."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.profiling", "zero_profiler")
