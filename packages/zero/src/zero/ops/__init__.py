"""Native ops (deepspeed.ops), from zero-ops."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.ops", "zero_ops")
