"""CPU Adam (deepspeed.ops.adam), from zero-ops."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.ops.adam", "zero_ops.adam")
