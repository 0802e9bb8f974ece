"""Fused BERT transformer layer (deepspeed.ops.transformer), from zero-ops."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.ops.transformer", "zero_ops.transformer")
