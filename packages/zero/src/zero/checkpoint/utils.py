"""Checkpoint utilities (deepspeed.checkpoint.utils), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.checkpoint.utils", "zero_core.checkpoint.utils")
