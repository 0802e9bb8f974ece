"""``checkpoint``: how training checkpoints are validated, written and loaded."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from zero_core.config.base import ConfigModel, one_of


class ParallelWriteConfig(ConfigModel):
    """``checkpoint.parallel_write``: ``pipeline_stage`` lets every pipeline stage write its own layers."""

    config_path: ClassVar[str] = "checkpoint.parallel_write"

    pipeline_stage: bool = False


class CheckpointConfig(ConfigModel):
    """``checkpoint``.

    ``tag_validation`` (``"Ignore"``, ``"Warn"``, ``"Fail"``, any case) says what happens when ranks
    save under different tags; ``load_universal`` loads a universal (world-size independent)
    checkpoint; ``use_node_local_storage`` lets every node write to its own (non-shared) disk.
    """

    config_path: ClassVar[str] = "checkpoint"

    tag_validation: one_of(("Ignore", "Warn", "Fail")) = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
