"""Progressive layer drop's schedule (deepspeed.runtime.progressive_layer_drop), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.progressive_layer_drop", "zero_core.engine.progressive_layer_drop")
