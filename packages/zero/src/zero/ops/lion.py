"""CPU Lion (deepspeed.ops.lion), from zero-ops."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.ops.lion", "zero_ops.lion")
