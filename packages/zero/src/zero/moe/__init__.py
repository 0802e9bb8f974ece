"""Mixture-of-Experts (deepspeed.moe), from zero-moe."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.moe", "zero_moe")
