"""CPU Adagrad (deepspeed.ops.adagrad), from zero-ops."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.ops.adagrad", "zero_ops.adagrad")
