"""``activation_checkpointing``: the config read by ``zero.checkpointing.configure``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from zero_core.config.base import ConfigModel, PosInt


class ActivationCheckpointingConfig(ConfigModel):
    """``activation_checkpointing``.

    ``contiguous_memory_optimization`` copies checkpoints into one buffer sized from
    ``number_checkpoints``; it works only with ``partition_activations`` (both as documented for
    ``deepspeed.checkpointing.configure``).
    """

    config_path: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: PosInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @model_validator(mode="after")
    def _check_contiguous(self) -> ActivationCheckpointingConfig:
        problems = []
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            problems.append(
                "activation_checkpointing.number_checkpoints: required when contiguous_memory_optimization is true"
            )
        if self.contiguous_memory_optimization and not self.partition_activations:
            problems.append(
                "activation_checkpointing.contiguous_memory_optimization: works only with "
                "partition_activations: true"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self
