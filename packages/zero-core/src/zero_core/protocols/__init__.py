"""Typed interfaces shared across the zero family (only what two packages share)."""

from zero_core.protocols.accelerator import Accelerator, Event, Stream
from zero_core.protocols.comm import CommBackend
from zero_core.protocols.monitor import Monitor
from zero_core.protocols.offload import OffloadBackend
from zero_core.protocols.optimizer_kernel import FlatOptimizerKernel
from zero_core.protocols.optimizer_offload import OptimizerOffload
from zero_core.protocols.training import LRScheduler, ModelParallelUnit

__all__ = [
    "Accelerator",
    "CommBackend",
    "Event",
    "FlatOptimizerKernel",
    "LRScheduler",
    "ModelParallelUnit",
    "Monitor",
    "OffloadBackend",
    "OptimizerOffload",
    "Stream",
]
