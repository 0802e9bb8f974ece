"""Checkpoint helpers (deepspeed.checkpoint), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.checkpoint", "zero_core.checkpoint")
