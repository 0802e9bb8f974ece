"""LAMB variants (deepspeed.ops.lamb): LAMB and 1-bit LAMB (DeepSpeed's
deepspeed.runtime.fp16.onebit.lamb.OnebitLamb), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module(
    "zero.ops.lamb",
    "zero_core.optim.onebit",
    names={"OnebitLamb": "zero_core.optim.onebit:OnebitLamb", "FusedLamb": "zero_core.optim.lamb:Lamb"},
)
