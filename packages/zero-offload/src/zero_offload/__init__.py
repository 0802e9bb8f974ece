"""zero-offload: ZeRO-Offload and ZeRO-Infinity: optimizer and parameter offload (CPU memory, NVMe).

zero-core finds this package through ``zero_core.plugins.require`` when
``zero_optimization.offload_optimizer.device`` is ``"cpu"`` or ``"nvme"``; see
[Note: optimizer offload hook] (optimizer_offload.py), [Note: parameter offload] (param_offload.py), [Note: tile pipeline] (nvme_swapper.py),
[Note: ZeRO-Infinity streaming] (offload_stream.py), [Note: host heap under NVMe offload] (host_heap.py)
and [Note: swap file lifecycle] (swap_files.py).
"""

from zero_offload.backends import NvmeOffloadBackend
from zero_offload.nvme_swapper import BufferPool, StateSwapper
from zero_offload.optimizer_offload import OptimizerOffload, build_optimizer_offload
from zero_offload.param_offload import ParamOffload, build_param_offload
from zero_offload.swap_files import SwapDirectory, SwapFileError, check_free_space, job_name
from zero_offload.version import __version__

__all__ = [
    "BufferPool",
    "NvmeOffloadBackend",
    "OptimizerOffload",
    "ParamOffload",
    "StateSwapper",
    "SwapDirectory",
    "SwapFileError",
    "__version__",
    "build_optimizer_offload",
    "build_param_offload",
    "check_free_space",
    "job_name",
]
