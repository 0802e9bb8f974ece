"""Async file I/O (deepspeed.ops.aio), from zero-ops."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.ops.aio", "zero_ops.aio")
