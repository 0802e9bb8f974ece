"""Adam variants (deepspeed.ops.adam), from zero-ops: CPU Adam, FusedAdam, and 1-bit Adam and 0/1 Adam
(DeepSpeed's deepspeed.runtime.fp16.onebit.adam.OnebitAdam and .zoadam.ZeroOneAdam; zero-ops' onebit
extra, which needs zero-core)."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module(
    "zero.ops.adam",
    "zero_ops.adam",
    names={
        "OnebitAdam": "zero_ops.onebit:OnebitAdam",
        "ZeroOneAdam": "zero_ops.onebit:ZeroOneAdam",
    },
)
