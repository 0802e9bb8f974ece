"""Communication-compressed optimizers: 1-bit Adam, 0/1 Adam and 1-bit LAMB.

They cut data-parallel traffic about 32x after a warm-up by exchanging sign bits with error
feedback (``zero_core.comm.compressed_all_reduce``); see [Note: communication-compressed
optimizers] in ``base.py``. DeepSpeed's names are kept: ``OnebitAdam``, ``ZeroOneAdam``,
``OnebitLamb`` (config ``"type"``: ``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``).

The exchange is a collective, so it is zero-core's (``zero_core.comm``): this subpackage is
zero-ops' ``onebit`` extra, the one part of zero-ops that needs zero-core; the rest of zero-ops
depends on torch alone. Without zero-core, importing it says what to install.
"""

import importlib.util

if importlib.util.find_spec("zero_core") is None:
    raise ModuleNotFoundError(
        "zero_ops.onebit (1-bit Adam, 0/1 Adam, 1-bit LAMB) exchanges through zero-core's compressed "
        "all-reduce, and zero-core is not installed: pip install packages/zero-core "
        "'packages/zero-ops[onebit]' (from a clone of the zero repository)",
        name="zero_core",
    )

from zero_ops.onebit.adam import OnebitAdam  # noqa: E402
from zero_ops.onebit.base import COMM_BACKENDS, CompressedOptimizer  # noqa: E402
from zero_ops.onebit.lamb import OnebitLamb  # noqa: E402
from zero_ops.onebit.zoadam import ZeroOneAdam  # noqa: E402

__all__ = ["COMM_BACKENDS", "CompressedOptimizer", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
