"""Monitors: TensorBoard, W&B, CSV (deepspeed.monitor), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.monitor", "zero_core.monitor")
