"""CPU Adam/AdamW (``zero.ops.adam``; DeepSpeed's ``deepspeed.ops.adam``)."""

from zero_ops.adam.cpu_adam import CPUAdam, DeepSpeedCPUAdam
from zero_ops.adam.functional import cpu_adam_step
from zero_ops.adam.kernel import CPUAdamKernel

__all__ = ["CPUAdam", "CPUAdamKernel", "DeepSpeedCPUAdam", "cpu_adam_step"]
