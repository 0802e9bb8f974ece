"""Adam variants (deepspeed.ops.adam): CPU Adam from zero-ops; 1-bit Adam and 0/1 Adam from zero-core
(DeepSpeed's deepspeed.runtime.fp16.onebit.adam.OnebitAdam and .zoadam.ZeroOneAdam)."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module(
    "zero.ops.adam",
    "zero_ops.adam",
    names={
        "OnebitAdam": "zero_core.optim.onebit:OnebitAdam",
        "ZeroOneAdam": "zero_core.optim.onebit:ZeroOneAdam",
    },
)
