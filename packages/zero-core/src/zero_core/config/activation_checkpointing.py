"""``activation_checkpointing``: the config read by ``zero.checkpointing.configure``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from zero_core.config.base import ConfigModel, PosInt


class ActivationCheckpointingConfig(ConfigModel):
    """``activation_checkpointing``.

    ``contiguous_memory_optimization`` copies checkpoints into one buffer sized from
    ``number_checkpoints``; it works only with ``partition_activations`` (both as documented for
    ``deepspeed.checkpointing.configure``). A missing ``number_checkpoints`` is not an error here:
    like DeepSpeed, ``zero.checkpointing.configure`` checks it, after its ``num_checkpoints``
    argument (Megatron passes its layer count there) has been applied.
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
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ValueError(
                "activation_checkpointing.contiguous_memory_optimization: works only with "
                "partition_activations: true"
            )
        return self
