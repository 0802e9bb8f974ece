"""CPU Adam/AdamW and FusedAdam (``zero.ops.adam``; DeepSpeed's ``deepspeed.ops.adam``).

``FusedAdam`` is torch ops (the config's ``"bias_correction": false``, which torch's Adam cannot
express); 1-bit Adam and 0/1 Adam, which need zero-core's collectives, are in ``zero_ops.onebit``.
"""

from zero_ops.adam.cpu_adam import CPUAdam, DeepSpeedCPUAdam
from zero_ops.adam.functional import cpu_adam_step
from zero_ops.adam.fused_adam import FusedAdam
from zero_ops.adam.kernel import CPUAdamKernel

__all__ = ["CPUAdam", "CPUAdamKernel", "DeepSpeedCPUAdam", "FusedAdam", "cpu_adam_step"]
