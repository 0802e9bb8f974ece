"""CPU Adagrad (``zero.ops.adagrad``; DeepSpeed's ``deepspeed.ops.adagrad``)."""

from zero_ops.adagrad.cpu_adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from zero_ops.adagrad.functional import cpu_adagrad_step
from zero_ops.adagrad.kernel import CPUAdagradKernel

__all__ = ["CPUAdagrad", "CPUAdagradKernel", "DeepSpeedCPUAdagrad", "cpu_adagrad_step"]
