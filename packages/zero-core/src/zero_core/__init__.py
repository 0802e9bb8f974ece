"""zero-core: the shared protocol layer, config, distributed runtime, ZeRO partitioning and
the training engine of the zero family.

Public names are resolved lazily so that ``import zero_core`` stays cheap and optional
dependencies (tensorboard, wandb, mpi4py) are only imported when used.
"""

from __future__ import annotations

import importlib
from typing import Any

from zero_core.version import __version__

# public name -> "module:attribute" (filled in as subsystems land)
_LAZY: dict[str, str] = {
    "initialize": "zero_core.engine.initialize:initialize",
    "ZeroEngine": "zero_core.engine.engine:ZeroEngine",
    "init_distributed": "zero_core.distributed:init_distributed",
    "add_config_arguments": "zero_core.arguments:add_config_arguments",
    "load_config": "zero_core.config:load_config",
    "ZeroConfig": "zero_core.config:ZeroConfig",
    "ConfigError": "zero_core.config:ConfigError",
    "get_accelerator": "zero_core.accelerator:get_accelerator",
    "resolve_batch_size": "zero_core.config:resolve_batch_size",
    "register_config_section": "zero_core.config:register_config_section",
    "build_lr_scheduler": "zero_core.lr_schedules:build_lr_scheduler",
    "MonitorMaster": "zero_core.monitor:MonitorMaster",
    "RepeatingLoader": "zero_core.utils:RepeatingLoader",
    "Init": "zero_core.zero.stage3.init_context:Init",
    "GatheredParameters": "zero_core.zero.stage3.gathered_parameters:GatheredParameters",
    "register_external_parameter": "zero_core.zero.stage3.external_params:register_external_parameter",
    "unregister_external_parameter": "zero_core.zero.stage3.external_params:unregister_external_parameter",
    "TiledLinear": "zero_core.zero.stage3.tiled_linear:TiledLinear",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'zero_core' has no attribute '{name}'")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", *_LAZY]
