"""Communication-compressed optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB.

They cut data-parallel traffic about 32x after a warm-up by exchanging sign bits with error
feedback (``zero_core.comm.compressed_all_reduce``); see [Note: communication-compressed
optimizers] in ``base.py``. DeepSpeed's names are kept: ``OnebitAdam``, ``ZeroOneAdam``,
``OnebitLamb`` (config ``"type"``: ``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``).
"""

from zero_core.optim.onebit.adam import OnebitAdam
from zero_core.optim.onebit.base import COMM_BACKENDS, CompressedOptimizer
from zero_core.optim.onebit.lamb import OnebitLamb
from zero_core.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["COMM_BACKENDS", "CompressedOptimizer", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
