"""zero-ops: native CPU optimizers (Adam, Adagrad, Lion) and async file I/O for the zero family.

Compiled ahead of time with pybind11 when the package is installed (no CUDA, no JIT); when the
compiled extension is unavailable every op runs an equivalent pure-torch path after one warning
(see [Note: native or fallback] in zero_ops._native). Subpackages: ``zero_ops.adam``,
``zero_ops.adagrad``, ``zero_ops.lion``, ``zero_ops.aio``; the torch-op optimizers ``FusedAdam``
(in ``zero_ops.adam``) and ``zero_ops.lamb``; the fused transformer layer ``zero_ops.transformer``;
and, with zero-core installed (the ``onebit`` extra), the communication-compressed optimizers
``zero_ops.onebit`` (1-bit Adam, 0/1 Adam, 1-bit LAMB).
"""

from zero_ops.report import op_report
from zero_ops.version import __version__

__all__ = ["__version__", "op_report"]
