"""ZeRO partitioning API (deepspeed.zero): Init, GatheredParameters, external parameters, TiledLinear."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.zero", "zero_core")
