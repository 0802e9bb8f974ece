"""The inference engine (deepspeed.inference), from zero-inference."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.inference", "zero_inference")
