"""zero-core: the shared protocol layer, config, distributed runtime, ZeRO partitioning and
the training engine of the zero family.

Public names are resolved lazily so that ``import zero_core`` stays cheap and optional
dependencies (tensorboard, wandb, mpi4py) are only imported when used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from zero_core.version import __version__


def _lazy_exports(
    module_name: str, namespace: dict[str, Any], table: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a package whose public names load lazily.

    ``table`` maps each lazy name to ``"module:attribute"``, or to ``"module"`` when the attribute
    has the public name. The first access imports the module and caches the value in
    ``namespace`` (the package's globals), so later reads are ordinary attribute reads.
    Used by this package and ``zero_core.utils``.
    """

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module '{module_name}' has no attribute '{name}'")
        module, _, attr = target.partition(":")
        value = getattr(importlib.import_module(module), attr or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__


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
    "OnDevice": "zero_core.zero.on_device:OnDevice",
    "OffloadStateTypeEnum": "zero_core.engine.model_states:OffloadStateTypeEnum",
    "OffloadDeviceEnum": "zero_core.engine.model_states:OffloadDeviceEnum",
    "MiCS_Init": "zero_core.zero.stage3.mics:MiCS_Init",
    "unwrap_model_for_generation": "zero_core.zero.stage3.generation:unwrap_model_for_generation",
    "set_z3_leaf_modules": "zero_core.zero.stage3.leaf_modules:set_z3_leaf_modules",
    "unset_z3_leaf_modules": "zero_core.zero.stage3.leaf_modules:unset_z3_leaf_modules",
    "get_z3_leaf_modules": "zero_core.zero.stage3.leaf_modules:get_z3_leaf_modules",
    "z3_leaf_module": "zero_core.zero.stage3.leaf_modules:z3_leaf_module",
}

__getattr__, __dir__ = _lazy_exports(__name__, globals(), _LAZY)


__all__ = ["__version__", *_LAZY]
