"""LAMB variants (deepspeed.ops.lamb), from zero-ops: LAMB (DeepSpeed's FusedLamb) and 1-bit LAMB
(DeepSpeed's deepspeed.runtime.fp16.onebit.lamb.OnebitLamb; zero-ops' onebit extra, which needs
zero-core)."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module(
    "zero.ops.lamb",
    "zero_ops.lamb",
    names={"OnebitLamb": "zero_ops.onebit:OnebitLamb", "FusedLamb": "zero_ops.lamb:Lamb"},
)
