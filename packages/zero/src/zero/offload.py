"""ZeRO-Offload / ZeRO-Infinity optimizer offload (CPU memory and NVMe), from zero-offload.

Names: ``OptimizerOffload``, ``build_optimizer_offload``, ``NvmeOffloadBackend``,
``SwapDirectory``, ``SwapFileError``, ``StateSwapper``, ``BufferPool``, ``job_name``,
``check_free_space``.
"""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.offload", "zero_offload")
