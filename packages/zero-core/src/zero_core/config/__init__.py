"""DeepSpeed's JSON config format as pydantic v2 models.

``load_config(...) -> ZeroConfig`` reads a dict, a JSON file or argparse args; ``ConfigError``
lists every problem with its key path. Plugin sections of other packages:
``register_config_section`` or the ``zero.config_sections`` entry point group.
"""

from zero_core.config.activation_checkpointing import ActivationCheckpointingConfig
from zero_core.config.base import ConfigModel, PermissiveSection
from zero_core.config.batch import BatchSizes, detect_world_size, resolve_batch_size
from zero_core.config.checkpoint import CheckpointConfig
from zero_core.config.errors import ConfigError
from zero_core.config.loader import load_config
from zero_core.config.monitoring import (
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zero_core.config.optimizer import OptimizerConfig, SchedulerConfig
from zero_core.config.precision import AmpConfig, BF16Config, DataTypesConfig, FP16Config
from zero_core.config.root import ZeroConfig
from zero_core.config.sections import (
    ENTRY_POINT_GROUP,
    config_sections,
    refresh_entry_points,
    register_config_section,
    section_model,
    unregister_config_section,
)
from zero_core.config.zero_optimization import (
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroOptimizationConfig,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ActivationCheckpointingConfig",
    "AmpConfig",
    "BF16Config",
    "BatchSizes",
    "CSVConfig",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "ConfigModel",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PermissiveSection",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "ZeroOptimizationConfig",
    "config_sections",
    "detect_world_size",
    "load_config",
    "refresh_entry_points",
    "register_config_section",
    "resolve_batch_size",
    "section_model",
    "unregister_config_section",
]
