"""The MoE layer (deepspeed.moe.layer), from zero-moe."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.moe.layer", "zero_moe")
