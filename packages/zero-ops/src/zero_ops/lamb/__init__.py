"""LAMB (``zero.ops.lamb``; DeepSpeed's ``deepspeed.ops.lamb.FusedLamb``), in torch ops.

1-bit LAMB, which needs zero-core's collectives, is ``zero_ops.onebit.OnebitLamb``.
"""

from zero_ops.lamb.fused_lamb import Lamb

__all__ = ["Lamb"]
