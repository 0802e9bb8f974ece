"""The monitor sections of the config (``tensorboard``, ``wandb``, ``csv_monitor``) as plain dataclasses.

Read from a whole config (dict) or a config object with those attributes; a missing section gives the
defaults (disabled). Unknown keys are errors that list the valid ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT_JOB_NAME = "DeepSpeedJobName"


@dataclasses.dataclass
class TensorBoardConfig:
    """``tensorboard`` section: event files go to ``<output_path or cwd>/<job_name>``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = DEFAULT_JOB_NAME


@dataclasses.dataclass
class WandbConfig:
    """``wandb`` section; ``team`` is the W&B entity."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclasses.dataclass
class CSVConfig:
    """``csv_monitor`` section: one ``<metric>.csv`` per metric in ``<output_path or cwd>/<job_name>``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = DEFAULT_JOB_NAME


SECTIONS: dict[str, type] = {"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig}


def _as_dict(section: object, name: str) -> dict[str, Any]:
    if section is None:
        return {}
    if isinstance(section, dict):
        return section
    if hasattr(section, "model_dump"):  # pydantic models of zero_core.config
        return section.model_dump()
    if dataclasses.is_dataclass(section):
        return dataclasses.asdict(section)
    raise TypeError(f"monitor config: section '{name}' must be a dict, got {type(section).__name__}")


def parse_section(name: str, section: object) -> TensorBoardConfig | WandbConfig | CSVConfig:
    """Validate one monitor section and return its dataclass."""
    cls = SECTIONS[name]
    data = _as_dict(section, name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"monitor config: unknown keys {unknown} in '{name}'; valid keys: {list(fields)}")
    for key, value in data.items():
        if key == "enabled":
            if not isinstance(value, bool):
                raise TypeError(f"monitor config: '{name}.enabled' must be a bool, got {value!r}")
        elif not (value is None and fields[key].default is None) and not isinstance(value, str):
            raise TypeError(f"monitor config: '{name}.{key}' must be a string, got {type(value).__name__}")
    return cls(**data)


def parse_monitor_config(config: object) -> dict[str, TensorBoardConfig | WandbConfig | CSVConfig]:
    """``{"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig}`` from a whole
    config (dict or object); other keys of the config are ignored."""
    if config is None:
        config = {}
    if not isinstance(config, dict) and not any(hasattr(config, name) for name in SECTIONS):
        raise TypeError(
            f"monitor config: expected a config dict or object with {list(SECTIONS)}, got {type(config).__name__}"
        )
    out = {}
    for name in SECTIONS:
        section = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        out[name] = parse_section(name, section)
    return out
