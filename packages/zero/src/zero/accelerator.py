"""The accelerator abstraction (deepspeed.accelerator), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.accelerator", "zero_core.accelerator")
