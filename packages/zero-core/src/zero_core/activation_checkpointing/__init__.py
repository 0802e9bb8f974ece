"""Activation checkpointing (DeepSpeed's ``deepspeed.checkpointing``): recompute blocks in backward
instead of keeping their activations, with optional partitioning of the kept inputs across the
model-parallel group, host-memory copies, contiguous buffers, and RNG state tracking so dropout in the
recompute matches the forward.

Typical use::

    from zero_core import activation_checkpointing as ac
    ac.configure(mpu_=None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    hidden = ac.checkpoint(block, hidden, attention_mask)
"""

from zero_core.activation_checkpointing.checkpointing import (
    CheckpointFunction,
    checkpoint,
    configure,
    get_config,
    get_mpu,
    is_configured,
    model_parallel_cuda_manual_seed,
    profile_stats,
    reset,
)
from zero_core.activation_checkpointing.config import (
    ActivationCheckpointingConfig,
    read_activation_checkpointing_config,
)
from zero_core.activation_checkpointing.non_reentrant import non_reentrant_checkpoint
from zero_core.activation_checkpointing.rng import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "get_config",
    "get_cuda_rng_tracker",
    "get_mpu",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "profile_stats",
    "read_activation_checkpointing_config",
    "reset",
]
