"""CPU Lion (``zero.ops.lion``; DeepSpeed's ``deepspeed.ops.lion``)."""

from zero_ops.lion.cpu_lion import CPULion, DeepSpeedCPULion
from zero_ops.lion.functional import cpu_lion_step
from zero_ops.lion.kernel import CPULionKernel

__all__ = ["CPULion", "CPULionKernel", "DeepSpeedCPULion", "cpu_lion_step"]
