"""MoE helpers (deepspeed.moe.utils), from zero-moe."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.moe.utils", "zero_moe.utils")
