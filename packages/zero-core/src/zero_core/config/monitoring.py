"""Monitoring sections: ``tensorboard``, ``wandb``, ``csv_monitor``, ``comms_logger`` and
``flops_profiler`` (the latter is a plugin section owned by zero-profiler, see
[Note: config sections]; this is its built-in model).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from zero_core.config.base import ConfigModel, Int, NonNegFloat, PermissiveSection, PosInt


class TensorBoardConfig(ConfigModel):
    """``tensorboard``: event files under ``output_path/job_name``."""

    config_path: ClassVar[str] = "tensorboard"

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(ConfigModel):
    """``wandb``: Weights & Biases run in ``team``/``project``, optionally grouped."""

    config_path: ClassVar[str] = "wandb"

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CSVConfig(ConfigModel):
    """``csv_monitor``: one CSV file per logged name under ``output_path/job_name``."""

    config_path: ClassVar[str] = "csv_monitor"

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CommsLoggerConfig(ConfigModel):
    """``comms_logger``: records every collective (op, size, latency, bandwidth).

    ``prof_all`` logs every op; otherwise only the ops named in ``prof_ops``.
    """

    config_path: ClassVar[str] = "comms_logger"

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class FlopsProfilerConfig(PermissiveSection):
    """``flops_profiler``: profile the forward pass at ``profile_step``."""

    config_path: ClassVar[str] = "flops_profiler"

    enabled: bool = False
    recompute_fwd_factor: NonNegFloat = 0.0
    profile_step: PosInt = 1
    module_depth: Int = -1
    top_modules: PosInt = 1
    detailed: bool = True
    output_file: str | None = None
