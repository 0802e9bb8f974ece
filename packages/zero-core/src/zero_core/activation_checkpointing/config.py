"""The ``activation_checkpointing`` section of the config, read from a dict, a JSON file or a config object.

The project's pydantic config lives in ``zero_core.config``; this module deliberately accepts plain data too
(a whole config dict, a path to a JSON config, or any object with an ``activation_checkpointing``
attribute) so that ``configure()`` works without building the full config.
"""

from __future__ import annotations

import dataclasses
import json
import os

SECTION = "activation_checkpointing"


@dataclasses.dataclass
class ActivationCheckpointingConfig:
    """Options of activation checkpointing; field names are the JSON keys of the config section."""

    partition_activations: bool = False
    """Partition each saved input across the model-parallel group; gather it again on recompute."""
    cpu_checkpointing: bool = False
    """Keep saved inputs in host memory (a separate host copy, also when they already live on the CPU)."""
    contiguous_memory_optimization: bool = False
    """Copy saved inputs into one preallocated buffer of ``number_checkpoints`` slots."""
    number_checkpoints: int | None = None
    """How many checkpoints are alive at once: the slot count of the contiguous buffer."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the accelerator at the start and end of every checkpoint forward and backward."""
    profile: bool = False
    """Time every checkpoint's forward and recompute+backward (see ``profile_stats()``)."""

    def validate(self, where: str = SECTION) -> ActivationCheckpointingConfig:
        """Check types and combinations; return self."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "number_checkpoints":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(
                        f"{where}: 'number_checkpoints' must be a positive int or null, got {value!r}"
                    )
            elif not isinstance(value, bool):
                raise TypeError(
                    f"{where}: '{field.name}' must be a bool, got {type(value).__name__} ({value!r})"
                )
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError(
                f"{where}: 'contiguous_memory_optimization' needs 'number_checkpoints' (the buffer's slot count)"
            )
        return self


def _section_from(source: object) -> object:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            with open(path, encoding="utf-8") as f:
                source = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"activation checkpointing: config file '{path}' does not exist"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(
                f"activation checkpointing: config file '{path}' is not valid JSON: {err}"
            ) from None
    if isinstance(source, dict):
        return source.get(SECTION) or {}
    if hasattr(source, SECTION):
        return getattr(source, SECTION) or {}
    raise TypeError(
        "activation checkpointing: the config must be a dict, a path to a JSON file, or an object with an "
        f"'{SECTION}' attribute, got {type(source).__name__}"
    )


def read_activation_checkpointing_config(
    source: object, *, validate: bool = True
) -> ActivationCheckpointingConfig:
    """Read the ``activation_checkpointing`` section of a whole config (dict, JSON path or config object).

    A missing section gives the defaults. Unknown keys are errors that list the valid ones.
    ``validate=False`` leaves the combination checks to the caller: ``configure`` applies its
    arguments first (Megatron gives ``num_checkpoints`` there, not in the config).
    """
    section = _section_from(source)
    if hasattr(section, "model_dump"):  # a pydantic model from zero_core.config
        section = section.model_dump()
    elif not isinstance(section, dict):
        section = {
            f.name: getattr(section, f.name) for f in dataclasses.fields(ActivationCheckpointingConfig)
        }
    valid = [f.name for f in dataclasses.fields(ActivationCheckpointingConfig)]
    unknown = sorted(set(section) - set(valid))
    if unknown:
        raise ValueError(f"{SECTION}: unknown keys {unknown}; valid keys: {valid}")
    config = ActivationCheckpointingConfig(**section)
    return config.validate() if validate else config
