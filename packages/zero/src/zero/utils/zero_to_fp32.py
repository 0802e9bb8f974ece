"""fp32 consolidation of ZeRO checkpoints (deepspeed.utils.zero_to_fp32), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.utils.zero_to_fp32", "zero_core.checkpoint.zero_to_fp32")
